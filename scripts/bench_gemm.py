#!/usr/bin/env python
"""The matrix products of one training step, side by side: minillama's GEMM as the chosen backend
runs it (``--backend numba``, the default: OpenBLAS called from Numba kernels, rows split over
the Numba threads; ``numpy``: rows split over Python threads, one-threaded BLAS each), the same
product with OpenBLAS's own threads, and PyTorch's (MKL / oneDNN) at the same thread count.
Each linear layer of a benchmark shape has three products per step: the forward y = x W^T, and
backward dx = dy W and dW = dy^T x. Best of ``--reps``, each side after ``--gap`` seconds of
sleep (measured 2026-11-23: timed right after PyTorch's product, while its OpenMP threads were
still spinning, one of ours ran 7x slower); the last column is torch time / ours.

    python scripts/bench_gemm.py --backend numba --configs tiny,s15 --threads 2

This says how much of a training-step gap to PyTorch is the GEMM library itself.
"""

from __future__ import annotations

import argparse
import time

import _bench_common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numba", help="numba (default) or numpy")
    ap.add_argument("--configs", default="tiny,s15", help="comma list of: tiny, s15")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gap", type=float, default=0.3,
                    help="seconds of sleep before each timed product, so that the previous "
                         "side's idle threads have stopped spinning (default 0.3; see "
                         "scripts/bench_train.py --gap)")
    return ap.parse_args(argv)


ARGS = parse_args()
_bench_common.pin_threads(ARGS.threads)

import numpy as np  # noqa: E402

from minillama import ModelConfig  # noqa: E402
from minillama.backends import get_backend  # noqa: E402

#: name -> (config, B, T)
CONFIGS = _bench_common.train_configs()


def best(fn, reps):
    if ARGS.gap > 0:
        time.sleep(ARGS.gap)
    fn()
    t = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> int:
    try:
        import torch  # noqa: PLC0415
        torch.set_num_threads(ARGS.threads)
    except ImportError:
        torch = None
    gemm = get_backend(ARGS.backend)._gemm
    print(f"# GEMMs of one training step — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"backend {ARGS.backend}, threads={ARGS.threads}, numpy {np.__version__}"
          + (f", torch {torch.__version__}" if torch else ", no torch"))
    print("\n| config | product | M x K x N | ours ms (GFLOP/s) | OpenBLAS threads ms | "
          "torch ms (GFLOP/s) | torch/ours |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name in ARGS.configs.split(","):
        kw, B, T = CONFIGS[name.strip()]
        cfg = ModelConfig(**kw)
        N, D, F, V = B * T, cfg.dim, cfg.hidden_dim, cfg.vocab_size
        qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        layers = {"wq": (qd, D), "wk/wv": (kvd, D), "wo": (D, qd), "w1/w3": (F, D),
                  "w2": (D, F), "head": (V, D)}
        tot = {"ours": 0.0, "torch": 0.0}
        for lname, (out_f, in_f) in layers.items():
            count = 1 if lname == "head" else cfg.n_layers * (2 if "/" in lname else 1)
            x = rng.standard_normal((N, in_f), dtype=np.float32)
            w = rng.standard_normal((out_f, in_f), dtype=np.float32)
            dy = rng.standard_normal((N, out_f), dtype=np.float32)
            for prod, a, b, shape in (("fwd x W^T", x, w.T, (N, in_f, out_f)),
                                      ("dx = dy W", dy, w, (N, out_f, in_f)),
                                      ("dW = dy^T x", dy.T, x, (out_f, N, in_f))):
                out = np.empty((a.shape[0], b.shape[1]), np.float32)
                t_ours = best(lambda: gemm(a, b, out), ARGS.reps)
                t_blas = best(lambda: np.matmul(a, b, out=out), ARGS.reps)
                flops = 2.0 * shape[0] * shape[1] * shape[2]
                row = (f"| {name} | {lname} {prod} | {' x '.join(map(str, shape))} "
                       f"| {t_ours * 1e3:.2f} ({flops / t_ours / 1e9:.0f}) | {t_blas * 1e3:.2f} ")
                tot["ours"] += count * t_ours
                if torch is not None:
                    ta, tb = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(
                        np.ascontiguousarray(b))
                    if prod.startswith("fwd"):
                        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
                        t_t = best(lambda: torch.nn.functional.linear(tx, tw), ARGS.reps)
                    elif prod.startswith("dW"):
                        tdy, tx = torch.from_numpy(dy), torch.from_numpy(x)
                        t_t = best(lambda: tdy.t().mm(tx), ARGS.reps)
                    else:
                        t_t = best(lambda: ta.mm(tb), ARGS.reps)
                    tot["torch"] += count * t_t
                    row += f"| {t_t * 1e3:.2f} ({flops / t_t / 1e9:.0f}) | {t_t / t_ours:.2f} |"
                else:
                    row += "| – | – |"
                print(row, flush=True)
        line = f"| {name} | **all products of a step** | | {tot['ours'] * 1e3:.1f} | "
        if torch is not None:
            line += f"| {tot['torch'] * 1e3:.1f} | {tot['torch'] / tot['ours']:.2f} |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
