#!/usr/bin/env python
"""How many distinct texts ``minillama serve`` gives to one greedy request sent many times under a
mixed concurrent load (and, with ``--peer``, llama.cpp's ``llama-server`` on the same file).

The server is started as in ``bench_serve.py``. Rounds of ``--clients`` concurrent streaming
chat requests follow one another; in each round a random number of the clients (at least one)
send the target question, the others send other questions (companions of other lengths), all at
temperature 0 with ``--tokens`` new tokens. The first target request of a run meets a cold
prefix cache, later ones may find its prefix cached. During the middle third of the rounds
``--busy`` processes spin on the CPU beside the server (the thread tuner then sees another
machine). The script prints, per server, how many target replies came back and how many distinct
texts they held (1 is the promise of a batch- and load-invariant engine), and the most common
text's share.

With ``--second-turn TEXT`` the target is a conversation's second turn instead: the target
question, the reply a first cold request got, then TEXT. Half of the target clients send the
first turn and then, on its reply, the second (so the second finds the first turn's row in the
cache), the others send the second turn directly; the texts counted are (first reply, second
reply) pairs.

    python -m scripts.probe_determinism --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --requests 200 --clients 8 --tokens 48 --busy 2 [--peer /path/to/llama-server]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys
import threading
import time

from scripts.bench_serve import (
    QUESTIONS,
    reply_text,
    start_minillama,
    start_peer,
    stop,
    stream_once,
)

TARGET = "Tell me about a violin."


def busy(n: int) -> list:
    """n processes that spin on the CPU until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def probe(url: str, name: str, args, rng: random.Random) -> collections.Counter:
    """Send rounds until ``args.requests`` target requests have come back; the texts counted. A
    request that fails (a refusal, a broken connection) is retried in a later round, never
    counted as a text."""
    texts: collections.Counter = collections.Counter()
    # the first turn's reply to a cold request (the second turn's history when sent directly)
    first = ask(url, name, args, [user(TARGET)]) if args.second_turn else None
    rounds = -(-args.requests // max(1, args.clients // 2))
    spinners: list = []
    r = 0
    try:
        while sum(texts.values()) < args.requests:
            if r == rounds // 3 and args.busy:
                spinners = busy(args.busy)
            if r == 2 * rounds // 3:
                stop_spinners(spinners)
            n_target = rng.randint(1, args.clients)
            who = set(rng.sample(range(args.clients), n_target))
            asks = [TARGET if i in who else QUESTIONS[rng.randrange(len(QUESTIONS))]
                    for i in range(args.clients)]  # drawn here: --seed gives the same mix
            out: list = [None] * args.clients
            gate = threading.Barrier(args.clients, timeout=60)

            def client(i, asks=asks, out=out, gate=gate, who=who):
                try:
                    if args.second_turn and i in who:
                        out[i] = second_turn(url, name, args, first, gate, i % 2 == 0)
                    else:
                        out[i] = ask(url, name, args, [user(asks[i])], gate)
                except (Exception, SystemExit) as e:  # counted as a failure, not a text
                    gate.abort()
                    print(f"  client {i}: {e}", file=sys.stderr, flush=True)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in sorted(who):
                if out[i] is not None:
                    texts[out[i]] += 1
            r += 1
    finally:
        stop_spinners(spinners)
    return texts


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def ask(url: str, name: str, args, messages: list, gate=None) -> str:
    """One greedy streamed chat request: the reply's text."""
    body = {"model": name, "max_tokens": args.tokens, "temperature": 0, "stream": True,
            "messages": messages}
    return reply_text(stream_once(url, "/v1/chat/completions", body, gate)["raw"])


def second_turn(url: str, name: str, args, first: str, gate, on_cache: bool) -> tuple:
    """(first reply, second reply): after the first turn sent now (``on_cache``: its row then
    holds the conversation so far), else on the cold first reply ``first``."""
    if on_cache:
        first = ask(url, name, args, [user(TARGET)], gate)
    elif gate is not None:
        gate.wait()
    history = [user(TARGET), {"role": "assistant", "content": first}, user(args.second_turn)]
    return first, ask(url, name, args, history)


def stop_spinners(spinners: list) -> None:
    """End the spinning processes (and reap them)."""
    for p in spinners:
        p.kill()
        p.wait()
    spinners.clear()


def report(label: str, texts: collections.Counter) -> None:
    n = sum(texts.values())
    top = texts.most_common(1)[0][1] if texts else 0
    print(f"{label}: {n} target replies, {len(texts)} distinct texts, the most common "
          f"{top}/{n}", flush=True)
    for text, k in texts.most_common(4):
        text = text if isinstance(text, str) else " / ".join(t[:44] for t in text)
        print(f"    {k:4d} x {text[:90]!r}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a GGUF (or other) chat model")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--requests", type=int, default=200, help="target requests per server")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--busy", type=int, default=2, help="spinning processes in the middle third")
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", default=None, help="llama-server to compare with")
    ap.add_argument("--second-turn", default=None, metavar="TEXT",
                    help="the target is the second turn TEXT after the target question")
    args = ap.parse_args()
    t0 = time.time()
    print(f"load average before: {os.getloadavg()}", flush=True)
    servers = [("minillama serve", start_minillama)]
    if args.peer:
        servers.append(("llama-server", start_peer))
    for label, start in servers:
        proc, url, name, banner = start(args, args.clients)
        print(banner, flush=True)
        try:
            report(label, probe(url, name, args, random.Random(args.seed)))
        finally:
            stop(proc)
    print(f"load average after: {os.getloadavg()}; {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
