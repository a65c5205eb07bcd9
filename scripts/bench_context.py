#!/usr/bin/env python
"""Decode speed against the context length, with a float32 and a half-precision KV cache,
minillama against ``llama-bench -d`` on the same GGUF file and thread count.

At depth d a decode step reads the weights once and the d cached K/V rows of every layer once;
on a small model the cache is soon most of the bytes (SmolLM2-135M: 30 layers x 3 KV heads x
64 x 2 x 4 bytes = 92 KiB per position in float32, the Q4_1 weights 98 MB, so the cache passes
the weights near 1,000 positions). ``--kv-cache f16`` halves it. For each round, in turn:
minillama with each cache (a fresh process: the prompt of d random ids prefilled, then
``--tokens`` greedy steps timed, the deeper depths continuing the same cache) and llama-bench
``-d`` (its default F16 cache; llama-bench takes no F32 cache type). Prints tokens/s (medians
over the rounds) and each minillama cache over llama-bench.

    python -m scripts.bench_context --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --depths 0,4096,8000 --tokens 64 --rounds 3 --threads 2 --peer BIN/llama-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from scripts._measure import pin_threads

CACHES = ("f32", "f16")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a GGUF file")
    ap.add_argument("--depths", default="0,4096,8000",
                    help="cached positions before the timed steps, comma-separated (default "
                         "%(default)s; their largest plus --tokens must fit the context)")
    ap.add_argument("--tokens", type=int, default=64, help="timed steps (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, medians (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of both (default 2)")
    ap.add_argument("--peer", help="the llama-bench binary (without it: minillama alone)")
    ap.add_argument("--child", choices=CACHES, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def child(args) -> None:
    """minillama with the ``--child`` cache: tokens/s at each depth, one JSON line."""
    pin_threads(args.threads)
    import numpy as np

    from minillama.io.load import load_model

    model, _ = load_model(args.checkpoint, backend="numba")
    model.kv_cache = args.child
    depths = sorted(int(d) for d in args.depths.split(","))
    n = args.tokens
    S = depths[-1] + n + 1
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (1, max(depths[-1], 1)))
    warm = model.backend.greedy_decoder(model, 64)
    warm.prefill(ids[:, :8])
    warm.more(8)  # kernels loaded, the thread tuner past its first trials
    cache, out, done = model.new_cache(1, S), {}, 0
    for d in depths:
        dec = model.backend.greedy_decoder(model, S, cache=cache, cached=done)
        dec.prefill(ids[:, :max(d, 1)])
        t0 = time.perf_counter()
        got = dec.more(n).shape[1]
        out[str(d)] = got / (time.perf_counter() - t0)
        done = max(d, 1)
    print(json.dumps({"tg": out, "kv_bytes": int(cache.nbytes)}))


def run_minillama(cache: str, args) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench_context", "--child", cache, "--checkpoint",
           args.checkpoint, "--depths", args.depths, "--tokens", str(args.tokens), "--threads",
           str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"bench_context: minillama failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tg"]


def run_peer(args) -> dict:
    cmd = [args.peer, "-m", args.checkpoint, "-p", "0", "-n", str(args.tokens), "-d",
           args.depths, "-t", str(args.threads), "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"bench_context: llama-bench failed: {r.stderr.strip()[-400:]}")
    return {str(t["n_depth"]): float(t["avg_ts"]) for t in json.loads(r.stdout)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    runs = {who: [] for who in (*CACHES, "llama-bench")}
    for r in range(args.rounds):
        for c in CACHES:
            runs[c].append(run_minillama(c, args))
        if args.peer:
            runs["llama-bench"].append(run_peer(args))
        print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr)
    cols = [*CACHES, "llama-bench"] if args.peer else list(CACHES)
    print("| depth | " + " | ".join(f"minillama {c}" if c in CACHES else "llama-bench (f16)"
                                     for c in cols)
          + (" | f32 / llama-bench | f16 / llama-bench |" if args.peer else " |"))
    print("|" + "---|" * (1 + len(cols) + (2 if args.peer else 0)))
    for d in sorted(int(d) for d in args.depths.split(",")):
        med = {c: statistics.median(x[str(d)] for x in runs[c]) for c in cols}
        cells = [f"{med[c]:.1f}" for c in cols]
        if args.peer:
            cells += [f"{med[c] / med['llama-bench']:.2f}" for c in CACHES]
        print(f"| {d} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
