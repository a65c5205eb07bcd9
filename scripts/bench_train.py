#!/usr/bin/env python
"""Time one training step of minillama against PyTorch eager on the same machine, same weights.

One step = forward + backward (loss and every parameter gradient), no optimizer; with
``--optimizer`` also the full step with AdamW on both sides. Prints a markdown table with
tokens/s, the share of the measured float32 matmul peak (a large NumPy matmul timed in the same
run) and the PyTorch/minillama time ratio (> 1: minillama is faster).

    python -m scripts.bench_train --backend numpy --configs tiny,s15 --steps 5 --threads 2

The peer is ``TorchLlama`` of tests/support/torch_llama.py (eager ops, SDPA attention, autograd,
``torch.optim.AdamW``). Thread counts are fixed through OMP/OPENBLAS/MKL_NUM_THREADS *before*
NumPy is imported, and ``torch.set_num_threads`` for the peer.

The two sides take turns step by step, and before every timed step the script sleeps ``--gap``
seconds (default 0.3): OpenBLAS's worker threads busy-wait about 2^28 cycles (~0.1 s here) after
a threaded GEMM before they sleep, so a step that starts right after the other side's step shares
the cores with those spinning threads. Measured on the 2-core machine (2026-11-23):
with no gap PyTorch's tiny step took 25-40 % longer right after a minillama step than alone,
which inflated the ratio; ``--gap 0`` restores that back-to-back timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from scripts._measure import CLOCKS, matmul_peak, median_times, pin_threads, train_configs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", help="minillama backend (default numpy)")
    ap.add_argument("--configs", default="tiny,s15", help="comma list of: tiny, s15")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per config (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / torch threads (default 2)")
    ap.add_argument("--optimizer", action="store_true",
                    help="also time the full step with AdamW "
                         "(minillama.train.optim vs torch.optim)")
    ap.add_argument("--gap", type=float, default=0.3,
                    help="seconds of sleep before every timed step, so that the other side's "
                         "idle BLAS/OpenMP threads have stopped spinning (default 0.3; 0 = "
                         "back to back)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter (default); cpu: process CPU time, steadier on a "
                         "shared machine with --threads 1")
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.model.transformer import init_params  # noqa: E402

#: name -> (config, B, T)
CONFIGS = train_configs()
CLOCK = CLOCKS[ARGS.clock]


def step_flops(cfg: ModelConfig, B: int, T: int) -> float:
    r"""FLOPs of forward + backward: 6 N_mm B T for the weight matmuls (N_mm = the layers' matrices
    plus the V x D head; the embedding lookup does no arithmetic) plus the attention products
    S = QK^T and O = PV on the full T x T square as the code computes them: 2 * 2 B H T^2 hd
    forward, twice that backward, per layer."""
    D, F, V, L = cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.n_layers
    kvd = cfg.n_kv_heads * cfg.head_dim
    n_mm = L * (2 * D * D + 2 * D * kvd + 3 * D * F) + V * D
    attn = L * 3 * (4 * B * cfg.n_heads * T * T * cfg.head_dim)
    return 6.0 * n_mm * B * T + attn


def main() -> int:
    args = ARGS
    torch = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads)
        except ImportError:
            torch = None
    AdamW = None
    if args.optimizer:
        try:
            from minillama.train.optim import AdamW
        except ImportError as e:
            print(f"note: --optimizer: minillama.train.optim.AdamW not available yet ({e}); "
                  "optimizer columns skipped")

    peak = matmul_peak(clock=CLOCK)
    print(f"# minillama training-step benchmark — "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, "
          f"{platform.python_implementation()} "
          f"{platform.python_version()}, numpy {np.__version__}"
          + (f", torch {torch.__version__}" if torch else ", torch not installed")
          + f"; threads={args.threads}; clock={args.clock}; gap={args.gap:g} s; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"measured float32 matmul peak (NumPy 2048^3 GEMM): {peak / 1e9:.1f} GFLOP/s")
    print(f"command: python -m scripts.bench_train {' '.join(sys.argv[1:])}\n")

    head = ("| config | backend | B x T | params | ms/step | tokens/s | % of matmul peak "
            "| torch ms/step | torch tokens/s | torch/minillama |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    opt_rows = []
    for name in args.configs.split(","):
        name = name.strip()
        if name not in CONFIGS:
            print(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
            return 2
        kw, B, T = CONFIGS[name]
        cfg = ModelConfig(**kw)
        params = init_params(cfg, seed=0, dtype=np.float32)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, (B, T))
        targets = np.roll(tokens, -1, axis=1)
        model = Transformer(cfg, params, backend=args.backend, dtype=np.float32)
        sync = model.backend.synchronize
        ours = [lambda: model.loss_and_grads(tokens, targets)]
        if torch is not None:
            from tests.support.torch_llama import train_step_fns

            step, step_opt = train_step_fns(cfg, params, tokens, targets, bool(AdamW))
            ours.append(step)
        t_ours, *t_peer = median_times(ours, args.steps, args.warmup, sync, CLOCK, args.gap)
        ntok = B * T
        flops = step_flops(cfg, B, T)
        row = (f"| {name} | {model.backend.name} | {B} x {T} | {cfg.n_params() / 1e6:.2f}M "
               f"| {t_ours * 1e3:.1f} | {ntok / t_ours:,.0f} | {100 * flops / t_ours / peak:.0f}% ")
        if t_peer:
            t_torch = t_peer[0]
            row += f"| {t_torch * 1e3:.1f} | {ntok / t_torch:,.0f} | {t_torch / t_ours:.2f} |"
        else:
            row += "| – | – | – |"
        rows.append(row)
        print(row, flush=True)
        if AdamW is not None:
            opt = AdamW(model.params, lr=1e-4, weight_decay=0.1, backend=model.backend)

            def full_step():
                _, grads = model.loss_and_grads(tokens, targets)
                opt.step(grads)

            fns = [full_step] + ([step_opt] if torch is not None else [])
            t_full, *t_tf = median_times(fns, args.steps, args.warmup, sync, CLOCK, args.gap)
            orow = f"| {name} | {model.backend.name} | {t_full * 1e3:.1f} | {ntok / t_full:,.0f} "
            if t_tf:
                t_tfull = t_tf[0]
                orow += f"| {t_tfull * 1e3:.1f} | {t_tfull / t_full:.2f} |"
            else:
                orow += "| – | – |"
            opt_rows.append(orow)

    print("\nOne training step (forward + backward, no optimizer), median of "
          f"{args.steps} after {args.warmup} warm-up, minillama and torch steps alternating:\n")
    print("\n".join(rows))
    if opt_rows:
        print("\nFull step with AdamW (minillama.train.optim.AdamW vs torch.optim.AdamW):\n")
        print("| config | backend | ms/step | tokens/s | torch ms/step | torch/minillama |")
        print("|---|---|---|---|---|---|")
        print("\n".join(opt_rows))
    print("\ntorch/minillama > 1 means minillama is faster. % of peak counts "
          "6 * N_matmul * tokens + full-square attention FLOPs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
