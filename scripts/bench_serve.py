#!/usr/bin/env python
"""Throughput and time to first token of ``minillama serve`` with 1, 4 and 16 concurrent
streaming clients, side by side with the single-client rate (the ratio shows what continuous
batching buys: 16 clients sharing each decode step against one client alone).

The script starts ``python -m minillama serve`` in a subprocess on a free loopback port (its
model: the shipped Shakespeare model, or ``--checkpoint``), then for each client count C runs C
threads that each stream one completion of ``--tokens`` tokens (greedy, distinct prompts,
raw-socket streaming: the client side stays light), all released at once. It prints per C

* aggregate generated tokens/s (every client's tokens over the wall time of the round) and its
  ratio to C = 1,
* time to first token (request sent -> first text chunk received): median and worst,
* each client's own tokens/s (median),

the medians over ``--rounds`` rounds, the rounds of different C interleaved so they see the same
background load (the ratio is taken within each round), and the load average.

    python scripts/bench_serve.py                       # shakespeare, numpy backend
    python scripts/bench_serve.py --backend numba --clients 1,4,16 --tokens 128 --rounds 3
    python scripts/bench_serve.py --checkpoint path/to/hf-folder --max-context 512
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

from _bench_common import REPO, pin_threads

FIRST_TEXT = re.compile(rb'"text":"[^"]')  # a chunk holding text
PROMPTS = ["ROMEO.", "KING.\nWhat", "First Citizen:\n", "JULIET.\n", "To be", "HAMLET.\nO",
           "My lord,", "Enter", "\n", "MACBETH.\n", "Good morrow", "LEAR.\n", "Sir,", "Why",
           "PORTIA.\n", "OTHELLO.\n"]


def start_server(args):
    cmd = [sys.executable, "-m", "minillama", "serve", "--port", "0",
           "--max-batch", str(max(args.clients)), "--max-context", str(args.max_context)]
    for flag in ("checkpoint", "backend", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    name = line.split("serving ")[1].split(" on ")[0].strip("'")
    url = line.split(" on ")[1].split()[0]
    return proc, url, name, line.strip()


def one_client(url, name, prompt, tokens, gate, out, i):
    """Stream one completion over a raw socket (HTTP/1.1, the chunked events read as bytes and
    only scanned for the first text while they arrive), so the client spends little CPU per token
    and the figures are the server's; the usage is parsed once the stream has ended."""
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, int(port.rstrip("/"))), timeout=600) as sock:
        gate.wait()
        t0 = time.perf_counter()
        sock.sendall(head + body)
        first, parts = None, []
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            if first is None and FIRST_TEXT.search(data):
                first = time.perf_counter()
            parts.append(data)
            if data.endswith(b"0\r\n\r\n") and b"[DONE]" in b"".join(parts[-2:]):
                break
        t1 = time.perf_counter()
    raw = b"".join(parts)
    if not raw.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"the server answered {raw[:200]!r}")
    last = raw[raw.rindex(b'data: {"id"'):].split(b"\n", 1)[0]
    n = json.loads(last[6:])["usage"]["completion_tokens"]
    out[i] = (t0, first if first is not None else t1, t1, n)


def run_round(url, name, C, tokens):
    out = [None] * C
    gate = threading.Barrier(C)
    threads = [threading.Thread(target=one_client, args=(url, name, PROMPTS[i % 16],
                                                         tokens, gate, out, i))
               for i in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(o[0] for o in out)
    end = max(o[2] for o in out)
    total = sum(o[3] for o in out)
    ttft = sorted(o[1] - o[0] for o in out)
    per_client = [o[3] / (o[2] - o[0]) for o in out]
    return {"tok_s": total / (end - start), "tokens": total, "ttft_med": statistics.median(ttft),
            "ttft_max": ttft[-1], "client_tok_s": statistics.median(per_client)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--url", default=None,
                    help="measure a server already running there (e.g. http://127.0.0.1:8000) "
                         "instead of starting one; --api-key is not supported")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of BLAS/Numba in the server (default 1)")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    pin_threads(args.threads)
    import httpx

    if args.url:
        proc, url = None, args.url.rstrip("/")
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        banner = f"minillama: measuring {name!r} served on {url}"
    else:
        proc, url, name, banner = start_server(args)
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        run_round(url, name, 2, 16)  # warm-up (compiles, thread pools)
        rounds: dict[int, list[dict]] = {C: [] for C in args.clients}
        for _ in range(args.rounds):
            for C in args.clients:  # interleaved: each round sees the same background load
                rounds[C].append(run_round(url, name, C, args.tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
    one = rounds[args.clients[0]]
    print(banner)
    print(f"{args.tokens} tokens per streamed completion, {args.rounds} rounds (medians; the "
          f"ratio is taken within each round), load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    print(f"{'clients':>7} {'tokens/s':>9} {'best':>8} {'x vs ' + str(args.clients[0]):>8} "
          f"{'TTFT med':>9} {'TTFT max':>9} {'per-client tok/s':>17}")
    med = statistics.median
    for C in args.clients:
        rs = rounds[C]
        ratio = med(r["tok_s"] / o["tok_s"] for r, o in zip(rs, one))
        print(f"{C:>7} {med(r['tok_s'] for r in rs):>9.1f} {max(r['tok_s'] for r in rs):>8.1f} "
              f"{ratio:>8.2f} {med(r['ttft_med'] for r in rs) * 1e3:>7.1f}ms "
              f"{med(r['ttft_max'] for r in rs) * 1e3:>7.1f}ms "
              f"{med(r['client_tok_s'] for r in rs):>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
