#!/usr/bin/env python
"""Which CPU backend decodes fastest, per model size: the measurement behind the ``auto``
backend (:func:`minillama.backends.auto_backend`, docs/BACKENDS.md).

For each shape (random weights) it runs batch-1 decodes on every CPU backend, the backends
taking turns repetition by repetition (so all see the same background load), after one
untimed warm-up each (Numba compiles then, once). It prints the median decode tokens/s of each
backend, side by side, the ratio of each to ``reference``, the fastest, and what ``auto``
picks:

    python -m scripts.bench_default_backend --reps 5 --tokens 96

Greedy (``--temperature 0``, the default) and sampled (``--temperature 1``) decoding differ on
the numba backend (greedy runs many steps per compiled call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

#: (name, ModelConfig fields): the shipped Shakespeare model's shape, then llama2.c's stories
SHAPES = {
    "shakespeare": dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, vocab_size=258,
                        max_seq_len=256),
    "mid": dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=258, max_seq_len=256),
    "s15": dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000,
                max_seq_len=256),
    "s42": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=32000,
                max_seq_len=256),
    "s110": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                 max_seq_len=256),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=", ".join(SHAPES))
    ap.add_argument("--backends", default="reference,numpy,numba")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time over the whole generation (steadier on a "
                         "loaded machine; meaningful with one thread: MINILLAMA_NUM_THREADS=1 "
                         "OPENBLAS_NUM_THREADS=1)")
    args = ap.parse_args()

    from minillama.backends import auto_backend, get_backend
    from minillama.core.config import ModelConfig
    from minillama.infer.generate import GenerationStats, generate_steps
    from minillama.model.transformer import Transformer, init_params

    names = args.backends.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; decode of "
          f"{args.tokens} tokens at batch 1, temperature {args.temperature}, median of "
          f"{args.reps}, {args.clock} clock, tokens/s")
    head = "".join(f"{n:>12}" for n in names)
    print(f"{'shape':<12}{'params':>12}{head}  {'x ref':>20}  fastest   auto")
    for shape in args.shapes.split(","):
        cfg = ModelConfig(**SHAPES[shape])
        params = init_params(cfg, seed=0)
        models = {n: Transformer(cfg, params, backend=get_backend(n)) for n in names}

        def run(m):
            st = GenerationStats()
            t0 = time.process_time()
            for _ in generate_steps(m, [[1, 5, 9]], args.tokens, args.temperature, None,
                                    0.9 if args.temperature else None, 0, (), st):
                pass
            if args.clock == "cpu":
                return st.new_tokens / (time.process_time() - t0)
            return st.decode_tokens_per_s

        for m in models.values():
            run(m)  # warm-up (Numba compiles or loads its cache here)
        rates = {n: [] for n in names}
        for _ in range(args.reps):
            for n, m in models.items():
                rates[n].append(run(m))
            time.sleep(0.05)
        med = {n: statistics.median(v) for n, v in rates.items()}
        ref = med.get("reference") or next(iter(med.values()))
        cells = "".join(f"{med[n]:>12.{0 if med[n] >= 100 else 1}f}" for n in names)
        ratios = " ".join(f"{med[n] / ref:.2f}" for n in names)
        best = max(med, key=med.get)
        print(f"{shape:<12}{cfg.n_params():>12,}{cells}  {ratios:>20}  {best:<9} "
              f"{auto_backend(cfg)}")


if __name__ == "__main__":
    main()
