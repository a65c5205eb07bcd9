#!/usr/bin/env python
"""Numba backend vs the numpy backend, side by side: per-op times of causal attention (forward,
backward, peak memory) and RoPE, then the end-to-end training step and batch-1 cached decode of
a stories15M-shaped model on both backends.

    python -m scripts.bench_ops --threads 2

Attention uses the stories15M heads (H = KVH = 6, hd = 48), float32, at T = 128, 512, 2048.
Times are the best of ``--reps`` runs (the first call, which loads or compiles the kernels, is
not timed). Peak memory: the most bytes allocated at once during forward + backward (tracemalloc,
which sees every NumPy array, outputs and gradients included) plus, for Numba, the bound on its
in-kernel scratch (not traced). The test suite checks the same with the peak RSS at T = 2048.
``--scripts`` also runs scripts/bench_train.py and scripts/bench_decode.py with
``--backend numpy`` and ``--backend numba`` and prints their reports.

``--torch`` prints instead causal attention forward and backward on the training benchmarks'
shapes (scripts/bench_train.py's tiny and s15), the numba backend beside PyTorch's
scaled_dot_product_attention, in turns:

    python -m scripts.bench_ops --torch --threads 2 --reps 9

``--latent`` prints instead the cost of the latent (Perceiver-style) block of
minillama/core/notes_latent.py beside a full self-attention block over the same L inputs, as L
grows: forward + backward time and the size of the attention matrices (B H M L against B H L^2).

``--gemm`` prints instead the matrix products of one training step (forward y = x W^T, backward
dx = dy W and dW = dy^T x of each linear layer of tiny and s15): the chosen backend's GEMM path
(``--backend numba``: OpenBLAS called from Numba kernels, rows over the Numba threads; ``numpy``:
rows over Python threads, one-threaded BLAS each), the same product on OpenBLAS's own threads,
and PyTorch's (MKL / oneDNN) at the same thread count, each after ``--gap`` seconds of sleep (a
product timed right after PyTorch's, while its OpenMP threads still spin, can run 7x slower).
It says how much of a training-step gap to PyTorch is the GEMM library itself:

    python -m scripts.bench_ops --gemm --configs tiny,s15 --threads 2 --reps 7

``--old-ops PATH`` prints instead an A/B in one process: the training step on the ``numpy``
backend as it is, against the same backend with the op functions of another ``ops.py`` (an older
commit's) bound in their place; same weights and tokens, steps alternating so that both see the
same load; the ratio is after / before (< 1: now is faster):

    git worktree add --detach /tmp/old <commit>
    python -m scripts.bench_ops --old-ops /tmp/old/minillama/ops.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from functools import partial

from scripts._measure import (
    CLOCKS,
    best_after_gap,
    model_shape,
    peak_alloc,
    pin_threads,
    train_configs,
)
from scripts._measure import best as best_on


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="BLAS / Numba threads (default 2)")
    ap.add_argument("--T", default="128,512,2048", help="attention lengths (comma list)")
    ap.add_argument("--batch", type=int, default=1, help="attention batch size B (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions, best kept")
    ap.add_argument("--train-batch", type=int, default=8, help="training step B (T = 256)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps")
    ap.add_argument("--decode-start", default="16,1000",
                    help="prompt lengths after which decode is timed (comma list)")
    ap.add_argument("--skip-model", action="store_true", help="ops only")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter (default); cpu: process CPU time, steadier on a "
                         "shared machine with --threads 1")
    ap.add_argument("--latent", action="store_true",
                    help="only the latent block against full self-attention, as L grows")
    ap.add_argument("--latent-L", default="256,1024,4096", help="input lengths for --latent")
    ap.add_argument("--latents", type=int, default=32, help="M, latents for --latent")
    ap.add_argument("--torch", action="store_true",
                    help="only causal attention, numba against PyTorch's SDPA, on the training "
                         "benchmarks' shapes (tiny, s15)")
    ap.add_argument("--gemm", action="store_true",
                    help="only the GEMMs of a training step, ours against OpenBLAS threads and "
                         "PyTorch")
    ap.add_argument("--backend", default="numba", help="--gemm: numba (default) or numpy")
    ap.add_argument("--configs", default="tiny,s15",
                    help="--gemm / --old-ops: comma list of: tiny, s15")
    ap.add_argument("--gap", type=float, default=0.3,
                    help="--gemm: seconds of sleep before each timed product (default 0.3)")
    ap.add_argument("--old-ops", metavar="PATH",
                    help="only an A/B training step: the numpy backend against the same backend "
                         "with the ops of the ops.py at PATH")
    ap.add_argument("--steps", type=int, default=0,
                    help="--old-ops: timed steps per side (0: 15 tiny, 3 s15)")
    ap.add_argument("--scripts", action="store_true",
                    help="also run bench_train.py / bench_decode.py on both backends")
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama.backends import get_backend  # noqa: E402
from minillama.core import notes_ops, ops  # noqa: E402
from minillama.core.config import ModelConfig  # noqa: E402
from minillama.model.transformer import Transformer, init_params  # noqa: E402

clock = CLOCKS[ARGS.clock]
#: the best of ``reps`` calls on the ``--clock`` clock
best = partial(best_on, clock=clock)


def numba_scratch_bytes(nb_threads: int, G: int, hd: int, itemsize: int = 4) -> int:
    """Upper bound of the attention kernels' scratch: per running work item, for the loop
    kernels two (BR G, BC) tiles, a (BR G, hd) accumulator and a few (BR G) / (hd) vectors; for
    the BLAS-tiled kernels (T >= 16) two (TILE_BQ, TILE_BK) tiles and four TILE_BQ vectors."""
    from minillama.backends.numba import backend_attention as NB
    from minillama.backends.numba.floats import attention_forward as K

    R = K.BR * G
    loops = 2 * R * K.BC + R * hd + 4 * R + 2 * hd
    tiled = 2 * NB.TILE_BQ * NB.TILE_BK + 4 * NB.TILE_BQ
    return nb_threads * itemsize * max(loops, tiled)


def bench_attention_torch(nb, reps):
    """Causal attention forward and backward, the numba backend against PyTorch's
    scaled_dot_product_attention (its CPU flash kernel; GQA through ``enable_gqa``) on the
    training benchmarks' attention shapes, float32. Rows of a markdown table."""
    import torch

    torch.set_num_threads(ARGS.threads)
    F = torch.nn.functional
    rows = []
    for name in ("tiny", "s15"):
        kw, B, T = train_configs()[name]
        H, KVH = kw["n_heads"], kw["n_kv_heads"]
        hd = kw["dim"] // H
        rng = np.random.default_rng(0)
        q, do = (rng.standard_normal((B, T, H, hd)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((B, T, KVH, hd)).astype(np.float32) for _ in range(2))
        tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).contiguous().requires_grad_()
                      for a in (q, k, v))
        tdo = torch.from_numpy(do).transpose(1, 2).contiguous()

        def t_fwd():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                  enable_gqa=KVH != H)

        def t_bwd(out):
            tq.grad = tk.grad = tv.grad = None
            out.backward(tdo)

        nb.attention_backward(do, nb.attention_forward(q, k, v)[1])  # warm-up
        t_bwd(t_fwd())
        res = {"numba": [], "torch": []}
        for _ in range(reps):  # the two sides take turns
            res["numba"].append((best(lambda: nb.attention_forward(q, k, v), 1),
                                 best(lambda c: nb.attention_backward(do, c), 1,
                                      setup=lambda: nb.attention_forward(q, k, v)[1])))
            res["torch"].append((best(t_fwd, 1), best(t_bwd, 1, setup=t_fwd)))
        (f1, b1), (f2, b2) = ([min(x[i] for x in res[s]) for i in (0, 1)]
                              for s in ("numba", "torch"))
        rows.append(f"| {name} | {B}x{T}x{H}/{KVH}x{hd} | {fmt_ms(f1)} | {fmt_ms(f2)} "
                    f"| {f2 / f1:.2f} | {fmt_ms(b1)} | {fmt_ms(b2)} | {b2 / b1:.2f} "
                    f"| {(f2 + b2) / (f1 + b1):.2f} |")
    return rows


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:.0f}"


def bench_attention(nb, T_list, B, reps):
    npb = get_backend("numpy")
    H, KVH, hd = 6, 6, 48
    rows = []
    for T in T_list:
        rng = np.random.default_rng(T)
        q, k, v, do = (rng.standard_normal((B, T, n, hd)).astype(np.float32)
                       for n in (H, KVH, KVH, H))
        res = {}
        for name, fwd, bwd in (("numpy", npb.attention_forward, npb.attention_backward),
                               ("numba", nb.attention_forward, nb.attention_backward)):
            o, c = fwd(q, k, v)  # warm-up (kernel load/compile)
            bwd(do, c)
            del o, c
            r = max(1, reps if T < 2048 else min(reps, 2))
            tf = best(lambda: fwd(q, k, v), r)
            tb = best(lambda ctx: bwd(do, ctx), r, setup=lambda: fwd(q, k, v)[1])
            mem = peak_alloc(lambda: bwd(do, fwd(q, k, v)[1]))
            if name == "numba":
                mem += numba_scratch_bytes(nb.num_threads, H // KVH, hd)
            res[name] = (tf, tb, mem)
        (f0, b0, m0), (f1, b1, m1) = res["numpy"], res["numba"]
        rows.append(
            f"| attention | {B}x{T}x{H}x{hd} | {fmt_ms(f0)} | {fmt_ms(f1)} | {f0 / f1:.1f}x "
            f"| {fmt_ms(b0)} | {fmt_ms(b1)} | {b0 / b1:.1f}x | {(f0 + b0) / (f1 + b1):.1f}x "
            f"| {m0 / 2**20:.1f} | {m1 / 2**20:.1f} |")
    return rows


def bench_rope(nb, reps):
    npb = get_backend("numpy")
    rows = []
    for B, T, nh, hd in ((8, 256, 6, 48), (1, 2048, 6, 48), (1, 1, 6, 48)):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((B, T, nh, hd)).astype(np.float32)
        cos, sin = ops.rope_tables(hd, max(T, 256), 10000.0, np.float32)
        cos, sin = cos[:T], sin[:T]
        res = {}
        for name, fwd, bwd in (("numpy", npb.rope_forward, npb.rope_backward),
                               ("numba", nb.rope_forward, nb.rope_backward)):
            _, c = fwd(x, cos, sin)
            bwd(x, c)
            r = reps * 20
            res[name] = (best(lambda: fwd(x, cos, sin), r), best(lambda: bwd(x, c), r))
        (f0, b0), (f1, b1) = res["numpy"], res["numba"]
        rows.append(
            f"| rope | {B}x{T}x{nh}x{hd} | {f0 * 1e3:.3f} | {f1 * 1e3:.3f} | {f0 / f1:.1f}x "
            f"| {b0 * 1e3:.3f} | {b1 * 1e3:.3f} | {b0 / b1:.1f}x | {(f0 + b0) / (f1 + b1):.1f}x "
            f"| | |")
    return rows


def bench_cross_entropy(nb, reps):
    """Softmax cross-entropy over the s15 training step's logits (B*T = 2048 rows, V = 32000)."""
    npb = get_backend("numpy")
    rng = np.random.default_rng(0)
    N, V = 2048, 32000
    z = rng.standard_normal((N, V)).astype(np.float32)
    t = rng.integers(0, V, size=N)
    res = {}
    for name, fwd, bwd in (("numpy", npb.cross_entropy_forward, npb.cross_entropy_backward),
                           ("numba", nb.cross_entropy_forward, nb.cross_entropy_backward)):
        bwd(1.0, fwd(z, t)[1])
        tf = best(lambda: fwd(z, t), reps)
        tb = best(lambda ctx: bwd(1.0, ctx), reps, setup=lambda: fwd(z, t)[1])
        mem = peak_alloc(lambda: bwd(1.0, fwd(z, t)[1]))
        res[name] = (tf, tb, mem)
    (f0, b0, m0), (f1, b1, m1) = res["numpy"], res["numba"]
    return [f"| cross-entropy | {N}x{V} (N x V) | {fmt_ms(f0)} | {fmt_ms(f1)} | {f0 / f1:.1f}x "
            f"| {fmt_ms(b0)} | {fmt_ms(b1)} | {b0 / b1:.1f}x | {(f0 + b0) / (f1 + b1):.1f}x "
            f"| {m0 / 2**20:.0f} | {m1 / 2**20:.0f} |"]


S15 = model_shape("s15", max_seq_len=1280)


def bench_model(reps):
    """Training step and cached batch-1 decode, the two backends' models timed alternately in
    the same loop (so a busy spell on a shared machine hits both), best of ``reps``."""
    cfg = ModelConfig(**S15)
    params = init_params(cfg, seed=0, dtype=np.float32)
    rng = np.random.default_rng(0)
    Bt, Tt = ARGS.train_batch, 256
    tok = rng.integers(0, cfg.vocab_size, size=(Bt, Tt))
    tgt = rng.integers(0, cfg.vocab_size, size=(Bt, Tt))
    starts = [int(s) for s in ARGS.decode_start.split(",")]
    n_dec = ARGS.decode_tokens
    names = ("numpy", "numba")
    models = {name: Transformer(cfg, params=params, backend=name) for name in names}
    for m in models.values():
        m.loss_and_grads(tok[:1, :32], tgt[:1, :32])  # warm-up (kernel load/compile)
    train = {name: [] for name in names}
    for _ in range(max(1, reps)):
        for name in names:
            t0 = clock()
            models[name].loss_and_grads(tok, tgt)
            train[name].append(clock() - t0)
    dec = {name: [] for name in names}
    for start in starts:
        prompt = rng.integers(0, cfg.vocab_size, size=(1, start))
        steps = rng.integers(0, cfg.vocab_size, size=(n_dec, 1, 1))
        best_t = {name: float("inf") for name in names}
        for _ in range(max(1, reps)):
            for name in names:
                model = models[name]
                cache = model.new_cache(1)
                model.forward(prompt, 0, cache, last_only=True)
                t0 = clock()
                for i in range(n_dec):
                    model.forward(steps[i], start + i, cache, last_only=True)
                best_t[name] = min(best_t[name], (clock() - t0) / n_dec)
        for name in names:
            dec[name].append(best_t[name])
    t0, t1 = min(train["numpy"]), min(train["numba"])
    toks = Bt * Tt
    rows = [f"| training step (loss + all grads) | s15, B={Bt}, T={Tt} | {fmt_ms(t0)} ms "
            f"({toks / t0:.0f} tok/s) | {fmt_ms(t1)} ms ({toks / t1:.0f} tok/s) "
            f"| {t0 / t1:.2f}x |"]
    for start, a, b in zip(starts, dec["numpy"], dec["numba"]):
        rows.append(f"| batch-1 decode, positions {start}..{start + n_dec - 1} | s15 "
                    f"| {a * 1e3:.2f} ms/tok | {b * 1e3:.2f} ms/tok | {a / b:.2f}x |")
    return rows


def run_scripts():
    here = os.path.dirname(os.path.abspath(__file__))
    jobs = []
    for be in ("numpy", "numba"):
        jobs.append(["bench_train", "--backend", be, "--configs", "s15", "--no-torch", "--steps",
                     "3", "--threads", str(ARGS.threads)])
        jobs.append(["bench_decode", "--backend", be, "--shapes", "s15", "--no-hf", "--plot", "",
                     "--reps", "2", "--threads", str(ARGS.threads)])
    for name, *args in jobs:
        if not os.path.exists(os.path.join(here, f"{name}.py")):
            print(f"\n({name}.py not found, skipped)")
            continue
        shown = [a or "''" for a in args]
        print(f"\n$ python -m scripts.{name} {' '.join(shown)}")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", f"scripts.{name}", *args], check=False)


def bench_latent(reps):
    """Rows: a full self-attention block over L tokens (LN, non-causal attention, LN, GELU FFN)
    against the latent block (M latents read the L tokens by cross-attention, then attend among
    themselves, then the FFN), forward + backward, float32, B = 1, D = 128, H = 4."""
    from minillama.core import notes_latent as latent

    B, D, H, M = 1, 128, 4, ARGS.latents
    cfg = latent.LatentConfig(dim=D, n_latents=M, n_heads=H, n_kv_heads=H, hidden_dim=4 * D)
    p = latent.init_block(cfg, np.random.default_rng(0), dtype=np.float32)

    def full_fwd_bwd(x):
        n1, c1 = latent._ln(x, p, "self_norm", 1e-5)
        o, ca = latent._attend(n1, n1, p, "self.", H, H)
        h = x + o
        n2, c2 = latent._ln(h, p, "ffn_norm", 1e-5)
        f, cf = notes_ops.mlp_forward(n2, p["ffn.w1.weight"], p["ffn.w2.weight"], "gelu")
        dy = np.ones_like(h)
        g = {}
        dn2 = notes_ops.mlp_backward(dy, cf)[0]
        dh = dy + latent._ln_backward(dn2, c2, "ffn_norm", g)
        dq, dkv = latent._attend_backward(dh, ca, "self.", g)
        return dh + latent._ln_backward(dq + dkv, c1, "self_norm", g)

    def latent_fwd_bwd(x):
        z, _ = notes_ops.latent_expand_forward(np.zeros((M, D), np.float32) + 0.1, B)
        out, ctx = latent.latent_block_forward(z, x, p, H, H)
        return latent.latent_block_backward(np.ones_like(out), ctx)[1]

    rows = []
    for L in [int(t) for t in ARGS.latent_L.split(",") if t]:
        x = np.random.default_rng(L).standard_normal((B, L, D)).astype(np.float32)
        full_fwd_bwd(x), latent_fwd_bwd(x)  # warm-up
        tf = best(lambda: full_fwd_bwd(x), ARGS.reps)
        tl = best(lambda: latent_fwd_bwd(x), ARGS.reps)
        rows.append(f"| {L} | {M} | {fmt_ms(tf)} | {fmt_ms(tl)} | {tf / tl:.1f}x "
                    f"| {B * H * L * L * 4 / 2**20:.1f} "
                    f"| {B * H * (M * L + M * M) * 4 / 2**20:.2f} |")
    return rows


def bench_gemm() -> int:
    """--gemm: each product of one training step, ours / OpenBLAS threads / PyTorch."""
    try:
        import torch
        torch.set_num_threads(ARGS.threads)
    except ImportError:
        torch = None
    gemm = get_backend(ARGS.backend)._gemm
    print(f"# bench_ops --gemm: the GEMMs of one training step — "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, backend {ARGS.backend}, "
          f"threads={ARGS.threads}, numpy {np.__version__}"
          + (f", torch {torch.__version__}" if torch else ", no torch"))
    print(f"command: python {' '.join(sys.argv)}")
    print("\n| config | product | M x K x N | ours ms (GFLOP/s) | OpenBLAS threads ms | "
          "torch ms (GFLOP/s) | torch/ours |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    configs = train_configs()
    for name in ARGS.configs.split(","):
        kw, B, T = configs[name.strip()]
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
                t_ours = best_after_gap(lambda: gemm(a, b, out), ARGS.reps, ARGS.gap)
                t_blas = best_after_gap(lambda: np.matmul(a, b, out=out), ARGS.reps, ARGS.gap)
                flops = 2.0 * shape[0] * shape[1] * shape[2]
                row = (f"| {name} | {lname} {prod} | {' x '.join(map(str, shape))} "
                       f"| {t_ours * 1e3:.2f} ({flops / t_ours / 1e9:.0f}) | {t_blas * 1e3:.2f} ")
                tot["ours"] += count * t_ours
                if torch is not None:
                    ta, tb = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(
                        np.ascontiguousarray(b))
                    if prod.startswith("fwd"):
                        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
                        t_t = best_after_gap(lambda: torch.nn.functional.linear(tx, tw),
                                             ARGS.reps, ARGS.gap)
                    elif prod.startswith("dW"):
                        tdy, tx = torch.from_numpy(dy), torch.from_numpy(x)
                        t_t = best_after_gap(lambda: tdy.t().mm(tx), ARGS.reps, ARGS.gap)
                    else:
                        t_t = best_after_gap(lambda: ta.mm(tb), ARGS.reps, ARGS.gap)
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


#: --old-ops: name -> (B, T, default steps)
AB_RUNS = {"tiny": (16, 128, 15), "s15": (8, 256, 3)}


def backend_with_ops(path: str):
    """A NumpyBackend whose public forward/backward functions come from the ops.py at ``path``."""
    import importlib.util

    from minillama.backends.numpy.backend import NumpyBackend

    spec = importlib.util.spec_from_file_location("minillama_old_ops", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cls = type("OldOpsBackend", (NumpyBackend,), {"name": "numpy-old-ops"})
    for name in dir(old):
        if name.endswith(("_forward", "_backward")) and not name.startswith("_"):
            setattr(cls, name, staticmethod(getattr(old, name)))
    return cls()


def bench_old_ops() -> int:
    """--old-ops: the numpy backend's training step now against another ops.py, alternating."""
    before = backend_with_ops(ARGS.old_ops)
    print(f"# bench_ops --old-ops: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"threads={ARGS.threads}, clock={ARGS.clock}, old ops: {ARGS.old_ops}")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| config | B x T | before ms/step | after ms/step | after/before |")
    print("|---|---|---|---|---|")
    for name in ARGS.configs.split(","):
        B, T, steps = AB_RUNS[name.strip()]
        cfg = ModelConfig(**model_shape(name.strip()))
        params = init_params(cfg, seed=0)
        x = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1))
        models = {"before": Transformer(cfg, params, backend=before),
                  "after": Transformer(cfg, params, backend="numpy")}
        times: dict[str, list[float]] = {k: [] for k in models}
        for m in models.values():  # warm-up
            m.loss_and_grads(x[:, :-1], x[:, 1:])
        for i in range(ARGS.steps or steps):
            for k in ("before", "after") if i % 2 else ("after", "before"):
                t0 = clock()
                models[k].loss_and_grads(x[:, :-1], x[:, 1:])
                times[k].append(clock() - t0)
        b, a = (float(np.median(times[k])) * 1e3 for k in ("before", "after"))
        print(f"| {name} | {B} x {T} | {b:.1f} | {a:.1f} | {a / b:.3f} |", flush=True)
    return 0


def main() -> int:
    if ARGS.gemm:
        return bench_gemm()
    if ARGS.old_ops:
        return bench_old_ops()
    if ARGS.latent:
        print(f"# bench_ops --latent: latent block vs full self-attention — "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
              f"numpy {np.__version__}; threads={ARGS.threads}; clock={ARGS.clock}; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"command: python {' '.join(sys.argv)}\n")
        print("| L | M | full self-attention block fwd+bwd ms | latent block fwd+bwd ms | "
              "latent speed-up | full attention matrix MiB (H L^2) | latent MiB (H (M L + M^2)) |")
        print("|---|---|---|---|---|---|---|")
        for row in bench_latent(ARGS.reps):
            print(row, flush=True)
        return 0
    nb = get_backend("numba")
    if ARGS.torch:
        import torch

        print(f"# bench_ops --torch: causal attention, numba vs PyTorch SDPA — "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"numpy {np.__version__}, numba {nb._numba.__version__}, torch {torch.__version__}; "
              f"threads={ARGS.threads}; clock={ARGS.clock}; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"command: python {' '.join(sys.argv)}\n")
        print("| config | B x T x H/KVH x hd | numba fwd ms | torch fwd ms | torch/numba "
              "| numba bwd ms | torch bwd ms | torch/numba | fwd+bwd torch/numba |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in bench_attention_torch(nb, max(ARGS.reps, 5)):
            print(row, flush=True)
        return 0
    print(f"# bench_ops: numba vs numpy — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} CPUs; python {platform.python_version()}, numpy "
          f"{np.__version__}, numba {nb._numba.__version__}; threads={ARGS.threads} "
          f"(numba {nb.num_threads}); clock={ARGS.clock}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| op | shape (B x T x H x hd) | numpy fwd ms | numba fwd ms | fwd speed-up "
          "| numpy bwd ms | numba bwd ms | bwd speed-up | fwd+bwd speed-up "
          "| numpy peak MiB | numba peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    T_list = [int(t) for t in ARGS.T.split(",") if t]
    for row in bench_attention(nb, T_list, ARGS.batch, ARGS.reps):
        print(row, flush=True)
    for row in bench_rope(nb, ARGS.reps):
        print(row, flush=True)
    for row in bench_cross_entropy(nb, ARGS.reps):
        print(row, flush=True)
    if not ARGS.skip_model:
        print("\n| end to end | model | numpy | numba | numba speed-up |")
        print("|---|---|---|---|---|")
        for row in bench_model(ARGS.reps):
            print(row, flush=True)
    if ARGS.scripts:
        run_scripts()
    return 0


if __name__ == "__main__":
    sys.exit(main())
