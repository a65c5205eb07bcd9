#!/usr/bin/env python
"""Throughput and time to first token of ``minillama serve`` with 1, 4 and 16 concurrent
streaming clients, side by side with the single-client rate (the ratio shows what continuous
batching buys: 16 clients sharing each decode step against one client alone).

The script starts ``python -m minillama serve`` in a subprocess on a free loopback port (its
model: the shipped Shakespeare model, or ``--checkpoint``), then for each client count C runs C
threads that each stream one completion of ``--tokens`` tokens (greedy, distinct prompts, raw
httpx streaming: the client side stays light), all released at once. It prints per C

* aggregate generated tokens/s (every client's tokens over the wall time of the round) and its
  ratio to C = 1,
* time to first token (request sent -> first text chunk received): median and worst,
* each client's own tokens/s (median),

the best of ``--rounds`` rounds per C, the rounds of different C interleaved so they see the
same background load, and the load average.

    python scripts/bench_serve.py                       # shakespeare, numpy backend
    python scripts/bench_serve.py --backend numba --clients 1,4,16 --tokens 128 --rounds 3
    python scripts/bench_serve.py --checkpoint path/to/hf-folder --max-context 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from _bench_common import REPO, pin_threads

PROMPTS = ["ROMEO.", "KING.\nWhat", "First Citizen:\n", "JULIET.\n", "To be", "HAMLET.\nO",
           "My lord,", "Enter", "\n", "MACBETH.\n", "Good morrow", "LEAR.\n", "Sir,", "Why",
           "PORTIA.\n", "OTHELLO.\n"]


def start_server(args):
    cmd = [sys.executable, "-m", "minillama", "serve", "--port", "0",
           "--max-batch", str(max(args.clients)), "--max-context", str(args.max_context)]
    for flag in ("checkpoint", "backend", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    name = line.split("serving ")[1].split(" on ")[0].strip("'")
    url = line.split(" on ")[1].split()[0]
    return proc, url, name, line.strip()


def one_client(httpx, url, name, prompt, tokens, gate, out, i):
    body = {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as c:
        gate.wait()
        t0 = time.perf_counter()
        first, n = None, 0
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if first is None and obj["choices"] and obj["choices"][0]["text"]:
                    first = time.perf_counter()
                if obj.get("usage"):
                    n = obj["usage"]["completion_tokens"]
        t1 = time.perf_counter()
    out[i] = (t0, first if first is not None else t1, t1, n)


def run_round(httpx, url, name, C, tokens):
    out = [None] * C
    gate = threading.Barrier(C)
    threads = [threading.Thread(target=one_client, args=(httpx, url, name, PROMPTS[i % 16],
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
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--url", default=None,
                    help="measure a server already running there (e.g. http://127.0.0.1:8000) "
                         "instead of starting one; --api-key is not supported")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of BLAS/Numba in the server (default 1)")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    pin_threads(args.threads)
    import httpx  # noqa: PLC0415

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
        run_round(httpx, url, name, 2, 16)  # warm-up (compiles, thread pools)
        best: dict[int, dict] = {}
        for _ in range(args.rounds):
            for C in args.clients:
                r = run_round(httpx, url, name, C, args.tokens)
                if C not in best or r["tok_s"] > best[C]["tok_s"]:
                    best[C] = r
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
    base = best[args.clients[0]]["tok_s"]
    print(banner)
    print(f"{args.tokens} tokens per streamed completion, best of {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'clients':>7} {'tokens/s':>9} {'x vs ' + str(args.clients[0]):>8} "
          f"{'TTFT med':>9} {'TTFT max':>9} {'per-client tok/s':>17}")
    for C in args.clients:
        r = best[C]
        print(f"{C:>7} {r['tok_s']:>9.1f} {r['tok_s'] / base:>8.2f} "
              f"{r['ttft_med'] * 1e3:>7.1f}ms {r['ttft_max'] * 1e3:>7.1f}ms "
              f"{r['client_tok_s']:>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
