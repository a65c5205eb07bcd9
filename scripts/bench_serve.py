#!/usr/bin/env python
"""Throughput and time to first token of ``minillama serve`` under 1, 4 and 16 concurrent
streaming clients; with ``--peer`` side by side with llama.cpp's ``llama-server`` on the same GGUF
file; with ``--reuse`` the time to first token of a conversation's second turn, its earlier
turns cached or not.

The script starts ``python -m minillama serve`` in a subprocess on a free loopback port (its
model: the shipped Shakespeare model, or ``--checkpoint``), then for each client count C runs C
threads that each stream one completion of ``--tokens`` tokens (greedy, distinct prompts,
raw-socket streaming: the client side stays light), all released at once. ``--chat`` sends chat
completions (one user message each, rendered with the model's chat template) instead of text
completions. It prints per C

* aggregate generated tokens/s (every client's tokens over the wall time of the round) and its
  ratio to C = 1 (with ``--peer``: to the peer's at the same C),
* time to first token (request sent -> first text chunk received): median and 95th percentile
  over every client of every round,
* each client's own tokens/s (median),

the medians over ``--rounds`` rounds, the rounds interleaved so they see the same background
load, and the load average (1, 5 and 15 minutes) before and after.

``--peer PATH`` starts ``PATH -m FILE -np C -t THREADS -c C*MAX_CONTEXT`` (llama.cpp's server,
built separately: a peer to compare with, never a dependency of minillama) for each C, beside
``minillama serve --max-batch C``, and alternates their rounds. The peer reports its own token
counts (its streamed ``usage``); both stop at the model's end-of-turn token, so a reply may be
shorter than ``--tokens``.

    python -m scripts.bench_serve                       # shakespeare, numpy backend
    python -m scripts.bench_serve --backend numba --clients 1,4,16 --tokens 128 --rounds 3
    python -m scripts.bench_serve --checkpoint model.gguf --chat --backend numba --threads 2 \\
        --peer /path/to/llama-server --clients 1,4,8 --tokens 64 --rounds 2
    python -m scripts.bench_serve --checkpoint model.gguf --backend numba --threads 2 --reuse
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
import tempfile
import threading
import time

from scripts._measure import REPO, pin_threads

FIRST_TEXT = re.compile(rb'"text":"[^"]')  # a chunk holding text
FIRST_CONTENT = re.compile(rb'"content":"[^"]')  # a chat chunk holding text
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
PROMPT_TOKENS = re.compile(rb'"prompt_tokens":(\d+)')
CACHED_TOKENS = re.compile(rb'"cached_tokens":(\d+)')
PROMPTS = ["ROMEO.", "KING.\nWhat", "First Citizen:\n", "JULIET.\n", "To be", "HAMLET.\nO",
           "My lord,", "Enter", "\n", "MACBETH.\n", "Good morrow", "LEAR.\n", "Sir,", "Why",
           "PORTIA.\n", "OTHELLO.\n"]
QUESTIONS = ["Write a short poem about the sea.", "Explain how a bicycle works.",
             "Tell me a story about a brave mouse.", "Describe the water cycle.",
             "What makes a good friend?", "Explain photosynthesis simply.",
             "Describe a busy city street.", "Why is the sky blue?",
             "Give advice to a new student.", "Describe your favourite season.",
             "How do bees make honey?", "Write a letter to a future self.",
             "Explain how rain forms.", "What is a computer?", "Describe a forest at night.",
             "How does a train work?"]
SYSTEM = ("You are a patient, friendly assistant for a public library. You help visitors find "
          "books, explain how to borrow and return them, describe the opening hours, the reading "
          "rooms and the children's corner, and answer general questions clearly and briefly. ")


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_minillama(args, max_batch: int, extra=()):
    """``minillama serve`` on a free port: (process, url, model name, banner)."""
    cmd = [sys.executable, "-m", "minillama", "serve", "--port", "0",
           "--max-batch", str(max_batch), "--max-context", str(args.max_context), *extra]
    for flag in ("checkpoint", "backend", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    while not seen or " on http://" not in seen[-1]:  # (warm-up notes come first)
        seen.append(proc.stderr.readline())
        if not seen[-1]:
            proc.kill()
            raise SystemExit("the server did not start: " + "".join(seen))
    line = seen[-1]
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # never block its writes
    name = line.split("serving ")[1].split(" on ")[0].strip("'")
    url = line.split(" on ")[1].split()[0]
    wait_ready(url)
    return proc, url, name, line.strip()


def start_peer(args, slots: int):
    """llama.cpp's server on the same file with ``slots`` slots of --max-context positions:
    (process, url, model name, banner)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    cmd = [args.peer, "-m", args.checkpoint, "-np", str(slots), "-t", str(args.threads),
           "-c", str(slots * args.max_context), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except SystemExit:
        proc.kill()
        log.seek(0)
        raise SystemExit(f"llama-server did not start ({' '.join(cmd)}):\n"
                         f"{log.read()[-3000:]}") from None
    return proc, url, "peer", f"llama-server: {' '.join(cmd)} (log {log.name})"


def wait_ready(url: str, proc=None, timeout: float = 300) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server at {url} did not get ready in {timeout:.0f} s")


def stop(proc) -> None:
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------------------------------------
# clients
# ---------------------------------------------------------------------------------------------
def request_body(name: str, i: int, tokens: int, chat: bool, messages=None) -> tuple[str, dict]:
    """(path, JSON body) of client i's greedy streamed request."""
    body = {"model": name, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = messages or [{"role": "user", "content": QUESTIONS[i % 16]}]
        return "/v1/chat/completions", body
    body["prompt"] = PROMPTS[i % 16]
    return "/v1/completions", body


def stream_once(url: str, path: str, body: dict, gate=None) -> dict:
    """Stream one completion over a raw socket (HTTP/1.1, the chunked events read as bytes and
    only scanned for the first text while they arrive), so the client spends little CPU per token
    and the figures are the server's; the usage is read once the stream has ended."""
    host, port = url.split("//")[1].split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    first_re = FIRST_CONTENT if "messages" in body else FIRST_TEXT
    with socket.create_connection((host, int(port.rstrip("/"))), timeout=600) as sock:
        if gate is not None:
            gate.wait()
        t0 = time.perf_counter()
        sock.sendall(head + data)
        first, parts = None, []
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            if first is None and first_re.search(chunk):
                first = time.perf_counter()
            parts.append(chunk)
            if chunk.endswith(b"0\r\n\r\n") and b"[DONE]" in b"".join(parts[-2:]):
                break
        t1 = time.perf_counter()
    raw = b"".join(parts)
    if not raw.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"{url} answered {raw[:300]!r}")
    counts = [int(m) for m in COMPLETION_TOKENS.findall(raw)]
    n = counts[-1] if counts else len(first_re.findall(raw))
    prompt, cached = PROMPT_TOKENS.findall(raw), CACHED_TOKENS.findall(raw)
    return {"t0": t0, "first": first if first is not None else t1, "t1": t1, "n": n,
            "prompt": int(prompt[-1]) if prompt else None,
            "cached": int(cached[-1]) if cached else None, "raw": raw}


def reply_text(raw: bytes) -> str:
    """The text a streamed chat reply ``raw`` (the whole HTTP response) carried."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, i = [], 0
        while i < len(body):
            j = body.index(b"\r\n", i)
            size = int(body[i:j].split(b";")[0], 16)
            if size == 0:
                break
            out.append(body[j + 2:j + 2 + size])
            i = j + 4 + size
        body = b"".join(out)
    text = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for ch in json.loads(line[6:]).get("choices", []):
                text.append((ch.get("delta") or {}).get("content") or "")
    return "".join(text)


def run_round(url, name, C, tokens, chat) -> dict:
    out = [None] * C
    gate = threading.Barrier(C)

    def client(i):
        path, body = request_body(name, i, tokens, chat)
        out[i] = stream_once(url, path, body, gate)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start, end = min(o["t0"] for o in out), max(o["t1"] for o in out)
    return {"tok_s": sum(o["n"] for o in out) / (end - start),
            "ttft": [o["first"] - o["t0"] for o in out],
            "client_tok_s": statistics.median(o["n"] / (o["t1"] - o["t0"]) for o in out)}


def quantile(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def loads() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------
# the three modes
# ---------------------------------------------------------------------------------------------
def bench_alone(args) -> None:
    """minillama alone (or the server at --url), one server for every C, rounds interleaved."""
    import httpx

    if args.url:
        proc, url = None, args.url.rstrip("/")
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        banner = f"minillama: measuring {name!r} served on {url}"
    else:
        proc, url, name, banner = start_minillama(args, max(args.clients))
    load0 = loads()
    try:
        run_round(url, name, 2, 16, args.chat)  # warm-up (compiles, thread pools)
        rounds: dict[int, list[dict]] = {C: [] for C in args.clients}
        for _ in range(args.rounds):
            for C in args.clients:  # interleaved: each round sees the same background load
                rounds[C].append(run_round(url, name, C, args.tokens, args.chat))
    finally:
        stop(proc)
    print(banner)
    print(f"{args.tokens} tokens per streamed {'chat ' if args.chat else ''}completion, "
          f"{args.rounds} rounds (medians; the ratio is taken within each round), load average "
          f"{load0} before, {loads()} after, {os.cpu_count()} cores")
    print(f"{'clients':>7} {'tokens/s':>9} {'best':>8} {'x vs ' + str(args.clients[0]):>8} "
          f"{'TTFT p50':>9} {'TTFT p95':>9} {'per-client tok/s':>17}")
    med, one = statistics.median, rounds[args.clients[0]]
    for C in args.clients:
        rs = rounds[C]
        ratio = med(r["tok_s"] / o["tok_s"] for r, o in zip(rs, one))
        ttft = [t for r in rs for t in r["ttft"]]
        print(f"{C:>7} {med(r['tok_s'] for r in rs):>9.1f} {max(r['tok_s'] for r in rs):>8.1f} "
              f"{ratio:>8.2f} {quantile(ttft, 0.5) * 1e3:>7.1f}ms "
              f"{quantile(ttft, 0.95) * 1e3:>7.1f}ms "
              f"{med(r['client_tok_s'] for r in rs):>17.1f}")


def bench_peer(args) -> None:
    """For each C: minillama (--max-batch C) and llama-server (-np C) on the same file, their
    rounds alternating; one row per C with both side by side."""
    rows, banners, load0 = [], [], loads()
    for C in args.clients:
        servers = []
        try:
            servers.append(start_minillama(args, C))
            servers.append(start_peer(args, C))
            for _, url, name, _ in servers:
                run_round(url, name, min(C, 2), 16, args.chat)  # warm-up
            got: list[list[dict]] = [[], []]
            for _ in range(args.rounds):
                for k, (_, url, name, _) in enumerate(servers):
                    got[k].append(run_round(url, name, C, args.tokens, args.chat))
            banners = [s[3] for s in servers]
        finally:
            for s in servers:
                stop(s[0])
        rows.append((C, got))
    print("\n".join(banners))
    print(f"{args.tokens} tokens per streamed {'chat ' if args.chat else ''}completion (greedy), "
          f"{args.rounds} rounds per C alternating the servers, --threads {args.threads}; "
          f"load average {load0} before, {loads()} after, {os.cpu_count()} cores")
    print(f"{'clients':>7} | {'minillama tok/s':>15} {'TTFT p50/p95 ms':>16} | "
          f"{'llama-server tok/s':>18} {'TTFT p50/p95 ms':>16} | {'ratio':>5}")
    med = statistics.median
    for C, (ours, peer) in rows:
        cells = []
        for rs in (ours, peer):
            ttft = [t for r in rs for t in r["ttft"]]
            cells.append((med(r["tok_s"] for r in rs),
                          f"{quantile(ttft, 0.5) * 1e3:.0f}/{quantile(ttft, 0.95) * 1e3:.0f}"))
        ratio = med(a["tok_s"] / b["tok_s"] for a, b in zip(ours, peer))
        print(f"{C:>7} | {cells[0][0]:>15.1f} {cells[0][1]:>16} | {cells[1][0]:>18.1f} "
              f"{cells[1][1]:>16} | {ratio:>5.2f}")


def bench_reuse(args) -> None:
    """A conversation's second turn, its first turn cached (minillama) or not (minillama
    --no-prefix-reuse), and on the peer when given: time to first token of turn 2."""
    servers, load0 = [], loads()
    try:
        servers.append(("minillama, reuse", start_minillama(args, 1)))
        servers.append(("minillama, --no-prefix-reuse",
                        start_minillama(args, 1, ["--no-prefix-reuse"])))
        if args.peer:
            servers.append(("llama-server", start_peer(args, 1)))
        results: dict[str, list[dict]] = {label: [] for label, _ in servers}
        system = {"role": "system", "content": SYSTEM * args.system_repeat}
        for r in range(args.rounds + 1):  # round 0 warms up
            user1 = {"role": "user", "content": QUESTIONS[r % 16]}
            for label, (_, url, name, _) in servers:
                path, body = request_body(name, 0, args.tokens, True, [system, user1])
                first = stream_once(url, path, body)
                reply = reply_text(first["raw"])
                msgs = [system, user1, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "Please say that again in fewer words."}]
                path, body = request_body(name, 0, args.tokens, True, msgs)
                second = stream_once(url, path, body)
                if r:
                    results[label].append({**second, "turn1": first})
    finally:
        for _, s in servers:
            stop(s[0])
    print(f"second turn of a chat ({args.tokens} new tokens per turn, {args.rounds} rounds, "
          f"--threads {args.threads}); load average {load0} before, {loads()} after, "
          f"{os.cpu_count()} cores")
    print(f"{'server':>30} {'turn-2 prompt':>13} {'cached':>7} {'TTFT turn 2 ms':>15} "
          f"{'TTFT turn 1 ms':>15}")
    for label, rs in results.items():
        ttft2 = statistics.median(x["first"] - x["t0"] for x in rs) * 1e3
        ttft1 = statistics.median(x["turn1"]["first"] - x["turn1"]["t0"] for x in rs) * 1e3
        cached = rs[-1]["cached"]
        print(f"{label:>30} {rs[-1]['prompt'] or 0:>13} {cached if cached is not None else '-':>7}"
              f" {ttft2:>15.1f} {ttft1:>15.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--chat", action="store_true",
                    help="chat completions (one user message each) instead of text completions")
    ap.add_argument("--url", default=None,
                    help="measure a server already running there (e.g. http://127.0.0.1:8000) "
                         "instead of starting one; --api-key is not supported")
    ap.add_argument("--peer", default=None, metavar="LLAMA_SERVER",
                    help="path of llama.cpp's llama-server: run it on the same --checkpoint "
                         "(a GGUF file) beside minillama for each C and print both")
    ap.add_argument("--reuse", action="store_true",
                    help="time to first token of a chat's second turn, cached and not")
    ap.add_argument("--system-repeat", type=int, default=8,
                    help="--reuse: how many times the system prompt's paragraph repeats")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of BLAS/Numba in the server (and the peer's -t; default 1)")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    pin_threads(args.threads)
    if args.peer and not (args.checkpoint and args.checkpoint.endswith(".gguf")):
        ap.error("--peer needs --checkpoint FILE.gguf (the file both servers load)")
    if args.reuse:
        bench_reuse(args)
    elif args.peer:
        bench_peer(args)
    else:
        bench_alone(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
