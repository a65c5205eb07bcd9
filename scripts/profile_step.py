#!/usr/bin/env python
"""Where the time goes, op by op: ``train`` profiles one training step, ``decode`` one batch-1
KV-cached decode step.

``train``: every backend op of forward and backward timed by a wrapper (the CPU backends run
synchronously, so each wrapper times the op's whole work), the linear layers split by weight, the
rest of the step (residual adds, Python, the loss) as one line, and the AdamW update. Random weights
of a benchmark shape and batch (those of ``scripts/bench_train.py``); the median over ``--steps``
steps after one warm-up.

    python -m scripts.profile_step train --backend numba --configs tiny,s15 --threads 2

Prints one markdown table per config and backend: ms per step for each op, its share of the step,
and for the linear layers the GFLOP/s reached against the measured 2048^3 matmul peak.

``decode``: per op on the per-op path (every backend op timed by a wrapper), and for the numba
backend's fused step (one compiled call) the kernel against the Python work around it. Random
weights of a benchmark shape, a 16-token prompt, then ``--steps`` greedy steps; the per-op and fused
runs take turns ``--reps`` times and the best run of each counts.

    python -m scripts.profile_step decode --shape s15 --threads 2

"before" is the numba backend with its fused step switched off (each op a backend call, the
GEMVs Numba, the rest NumPy); "after" is the fused step, called once per token, then the greedy
decoder that ``generate`` uses for one sequence (16 steps per compiled call).
"""

from __future__ import annotations

import argparse
import os
import time

from scripts._measure import matmul_peak, model_shape, pin_threads, train_configs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    tr = sub.add_parser("train", help="one training step, per op")
    tr.add_argument("--backend", default="numba", help="comma list of minillama backends")
    tr.add_argument("--configs", default="tiny,s15", help="comma list of: tiny, s15")
    tr.add_argument("--steps", type=int, default=3, help="timed steps (median per op)")
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--torch", action="store_true",
                    help="also profile the PyTorch peer's step (torch.profiler, self CPU time "
                         "per aten op, the model of scripts/bench_train.py); note: on a 2-core "
                         "VM the profiler slowed torch's SDPA 20-30x, so read only the other rows")
    de = sub.add_parser("decode", help="one batch-1 decode step, per op and fused")
    de.add_argument("--shape", default="s15", help="s15, s15gqa or s110")
    de.add_argument("--threads", type=int, default=2)
    de.add_argument("--steps", type=int, default=64, help="decode steps per run")
    de.add_argument("--reps", type=int, default=3)
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.backends import get_backend  # noqa: E402
from minillama.model.transformer import init_params  # noqa: E402
from minillama.train.optim import AdamW  # noqa: E402

# ------------------------------------------------------------------------------------------------
# train
# ------------------------------------------------------------------------------------------------
#: name -> (config, B, T)
CONFIGS = train_configs()
#: backend attributes timed (those a plain LLaMA training step calls)
TRAIN_OPS = ("embedding", "linear", "rmsnorm", "rope", "attention", "swiglu", "cross_entropy",
       "linear_cross_entropy")


def _weight_label(model, w) -> str:
    for k, p in model.params.items():
        if p is w:
            return k.split(".", 2)[-1] if k.startswith("layers.") else k
    return "?"


def instrument(model, timers):
    """Wrap every op of the model's backend (instance attributes, removed by the caller)."""
    be = model.backend
    names = []

    def wrap(attr, fn, label_of):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            label = label_of(a, out)
            timers.setdefault(label, 0.0)
            timers[label] += time.perf_counter() - t0
            return out
        return timed

    for op in TRAIN_OPS:
        for side in ("forward", "backward"):
            attr = f"{op}_{side}"
            fn = getattr(be, attr, None)
            if fn is None:
                continue
            if op == "linear" and side == "forward":
                lab = lambda a, out: f"linear fwd {_weight_label(model, a[1])}"  # noqa: E731
            elif op == "linear":
                lab = lambda a, out: f"linear bwd {_weight_label(model, a[1][1])}"  # noqa: E731
            else:
                lab = (lambda s: lambda a, out: s)(f"{op} {side[:3]}")
            setattr(be, attr, wrap(attr, fn, lab))
            names.append(attr)
    return names


def linear_flops(cfg, B, T) -> dict[str, float]:
    """FLOPs of each linear (forward: 2 N in out; backward twice that), by weight label."""
    D, F, V = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    N, L = B * T, cfg.n_layers
    per = {"attention.wq.weight": D * qd, "attention.wk.weight": D * kvd,
           "attention.wv.weight": D * kvd, "attention.wo.weight": qd * D,
           "feed_forward.w1.weight": D * F, "feed_forward.w3.weight": D * F,
           "feed_forward.w2.weight": F * D}
    out = {}
    for k, n in per.items():
        out[f"linear fwd {k}"] = 2.0 * N * n * L
        out[f"linear bwd {k}"] = 4.0 * N * n * L
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    out[f"linear fwd {head}"] = 2.0 * N * V * D
    out[f"linear bwd {head}"] = 4.0 * N * V * D
    return out


def profile(name, backend, peak):
    kw, B, T = CONFIGS[name]
    cfg = ModelConfig(**kw)
    model = Transformer(cfg, init_params(cfg, seed=0), backend=backend, dtype=np.float32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = np.roll(tokens, -1, axis=1)
    opt = AdamW(model.params, lr=1e-4, weight_decay=0.1, backend=model.backend)
    be = model.backend
    runs = []
    timers: dict[str, float] = {}
    names = instrument(model, timers)
    try:
        for i in range(ARGS.steps + 1):
            timers.clear()
            t0 = time.perf_counter()
            _, grads = model.loss_and_grads(tokens, targets)
            t1 = time.perf_counter()
            opt.step(grads)
            t2 = time.perf_counter()
            del grads
            rec = dict(timers)
            rec["(rest of forward+backward)"] = (t1 - t0) - sum(timers.values())
            rec["AdamW step"] = t2 - t1
            rec["step total"] = t2 - t0
            if i:
                runs.append(rec)
    finally:
        for attr in names:
            delattr(be, attr)
    keys = list(runs[0])
    med = {k: float(np.median([r.get(k, 0.0) for r in runs])) for k in keys}
    total = med["step total"]
    flops = linear_flops(cfg, B, T)
    print(f"\n### {name} (B {B} x T {T}, {cfg.n_params() / 1e6:.2f}M params), backend "
          f"{be.name}: {total * 1e3:.1f} ms per step with AdamW\n")
    print("| op | ms/step | share | GFLOP/s (% of peak) |")
    print("|---|---|---|---|")
    lin = sum(v for k, v in med.items() if k.startswith("linear"))
    for k in sorted((k for k in keys if k != "step total"), key=lambda k: -med[k]):
        rate = ""
        if k in flops and med[k] > 0:
            g = flops[k] / med[k]
            rate = f"{g / 1e9:.0f} ({100 * g / peak:.0f}%)"
        print(f"| {k} | {med[k] * 1e3:.1f} | {100 * med[k] / total:.1f}% | {rate} |")
    lf = sum(flops.values())
    print(f"| all linear layers | {lin * 1e3:.1f} | {100 * lin / total:.1f}% | "
          f"{lf / lin / 1e9:.0f} ({100 * lf / lin / peak:.0f}%) |")
    print(f"| **step total** | {total * 1e3:.1f} | 100% | |")


def profile_torch(name):
    """The PyTorch eager step of scripts/bench_train.py (with AdamW) under torch.profiler: self
    CPU time per aten op, grouped (matrix products, attention, the rest)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from tests.support.torch_llama import train_step_fns

    torch.set_num_threads(ARGS.threads)
    kw, B, T = CONFIGS[name]
    cfg = ModelConfig(**kw)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = np.roll(tokens, -1, axis=1)
    _, step_opt = train_step_fns(cfg, init_params(cfg, seed=0), tokens, targets, True)
    for _ in range(2):
        step_opt()
    steps = max(ARGS.steps, 1)
    t0 = time.perf_counter()
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step_opt()
    wall = (time.perf_counter() - t0) / steps
    rows = sorted(((e.key, e.self_cpu_time_total / steps / 1e3) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    total = sum(ms for _, ms in rows)
    groups = {"matrix products (mm, addmm, bmm, matmul, linear)": 0.0,
              "attention (scaled_dot_product / flash)": 0.0, "everything else": 0.0}
    for key, ms in rows:
        if any(w in key for w in ("::mm", "::addmm", "::bmm", "::matmul", "::linear")):
            groups["matrix products (mm, addmm, bmm, matmul, linear)"] += ms
        elif "attention" in key or "flash" in key:
            groups["attention (scaled_dot_product / flash)"] += ms
        else:
            groups["everything else"] += ms
    print(f"\n### {name}, PyTorch {torch.__version__} eager with AdamW: "
          f"{wall * 1e3:.1f} ms per step "
          f"(profiled; self CPU time of the main thread's ops {total:.1f} ms)\n")
    print("| aten op | self CPU ms/step | share |")
    print("|---|---|---|")
    for key, ms in rows[:14]:
        print(f"| {key} | {ms:.1f} | {100 * ms / total:.1f}% |")
    for g, ms in groups.items():
        print(f"| **{g}** | {ms:.1f} | {100 * ms / total:.1f}% |")


def main_train() -> int:
    peak = matmul_peak(reps=4, row_split=False)
    print(f"# training-step profile — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"threads={ARGS.threads}, numpy {np.__version__}; float32 2048^3 matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s")
    for name in ARGS.configs.split(","):
        for backend in ARGS.backend.split(","):
            profile(name.strip(), get_backend(backend.strip()), peak)
        if ARGS.torch:
            profile_torch(name.strip())
    return 0


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------
DECODE_OPS = ("embedding_forward", "rmsnorm_forward", "linear_forward", "rope_forward",
       "attention_forward", "swiglu_forward")


def run(model, steps, timers, fused):
    """Greedy decode of ``steps`` tokens after a 16-token prompt; returns seconds per step."""
    be = model.backend
    cache = model.new_cache(1, 16 + steps + 1)
    prompt = np.arange(3, 19)[None]
    tok = int(np.argmax(model.forward(prompt, cache=cache, last_only=True)[0]))
    for k in timers:
        timers[k] = [0, 0.0]
    if not fused:
        be.decode_step = lambda *a, **kw: None  # the per-op path (instance attribute)
    try:
        t0 = time.perf_counter()
        for pos in range(16, 16 + steps):
            t1 = time.perf_counter()
            z = model.forward(np.array([[tok]]), start_pos=pos, cache=cache, last_only=True)
            t2 = time.perf_counter()
            tok = int(np.argmax(z[0]))
            timers["greedy argmax"][0] += 1
            timers["greedy argmax"][1] += time.perf_counter() - t2
            timers["forward (all)"][0] += 1
            timers["forward (all)"][1] += t2 - t1
        total = time.perf_counter() - t0
    finally:
        if not fused:
            del be.decode_step
    return total / steps


def run_greedy(model, steps, timers, chunk=16):
    """The same decode through the backend's greedy decoder (``chunk`` steps per compiled call,
    the argmax in the kernel): seconds per token."""
    dec = model.backend.greedy_decoder(model, 16 + steps + 1)
    dec.prefill(np.arange(3, 19)[None])
    timers["fused decode_step kernel"] = [0, 0.0]
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        done += dec.more(min(chunk, steps - done)).shape[1]
    return (time.perf_counter() - t0) / steps


def main_decode() -> int:
    name = ARGS.shape
    shape = model_shape("s15", n_kv_heads=2) if name == "s15gqa" else model_shape(name)
    cfg = ModelConfig(**shape, tie_embeddings=True)
    be = get_backend("numba")
    model = Transformer(cfg, init_params(cfg, seed=0), backend=be)
    timers: dict[str, list] = {}
    for op in DECODE_OPS:  # wrap each op: calls and seconds per step
        fn = getattr(be, op)
        timers[op] = [0, 0.0]

        def timed(*a, _fn=fn, _op=op, **kw):
            t = time.perf_counter()
            out = _fn(*a, **kw)
            timers[_op][0] += 1
            timers[_op][1] += time.perf_counter() - t
            return out

        setattr(be, op, timed)
    timers["fused decode_step kernel"] = [0, 0.0]
    be.decode_step(model, np.array([[1]]), 0, model.new_cache(1, 2))  # loads + compiles
    mod = be._decode

    def timed(kernel):
        def run_kernel(*a):
            t = time.perf_counter()
            out = kernel(*a)
            timers["fused decode_step kernel"][0] += 1
            timers["fused decode_step kernel"][1] += time.perf_counter() - t
            return out
        return run_kernel

    import types

    # batch 1 runs decode_step_one, more sequences decode_step: both timed
    be._decode = types.SimpleNamespace(decode_step=timed(mod.decode_step),
                                       decode_step_one=timed(mod.decode_step_one))
    timers["greedy argmax"] = [0, 0.0]
    timers["forward (all)"] = [0, 0.0]
    run(model, 4, timers, False)
    run(model, 4, timers, True)
    run_greedy(model, 4, timers)
    best = {}
    for _ in range(ARGS.reps):
        for fused in (False, True):
            per = run(model, ARGS.steps, timers, fused)
            if fused not in best or per < best[fused][0]:
                best[fused] = (per, {k: list(v) for k, v in timers.items()})
        per = run_greedy(model, ARGS.steps, timers)
        if "greedy" not in best or per < best["greedy"][0]:
            best["greedy"] = (per, list(timers["fused decode_step kernel"]))
    print(f"# profile_step decode: {name}, batch 1, numba backend, threads {ARGS.threads}, "
          f"{ARGS.steps} steps from position 16, best of {ARGS.reps}, load average "
          f"{os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for fused, label in ((False, "before: per-op path"), (True, "after: fused step")):
        per, tm = best[fused]
        print(f"\n{label}: {per * 1e6:.0f} us/step ({1 / per:.0f} tok/s)\n")
        print("| part | calls/step | us/step | share of step |")
        print("|---|---|---|---|")
        fwd = tm["forward (all)"][1] / ARGS.steps
        inside = 0.0
        for k, (n, s) in tm.items():
            if n == 0 or k == "forward (all)":
                continue
            us = s / ARGS.steps
            if k != "greedy argmax":
                inside += us
            print(f"| {k} | {n / ARGS.steps:.0f} | {us * 1e6:.0f} | {100 * us / per:.0f}% |")
        print(f"| rest of forward (checks, reshapes, residual adds, Python) | – | "
              f"{(fwd - inside) * 1e6:.0f} | {100 * (fwd - inside) / per:.0f}% |")
    per, (n, s) = best["greedy"]
    kern = s / ARGS.steps
    print(f"\nafter, what `generate` runs at batch 1 greedy: the greedy decoder, 16 steps per "
          f"compiled call: {per * 1e6:.0f} us/token ({1 / per:.0f} tok/s)\n")
    print("| part | calls/token | us/token | share |")
    print("|---|---|---|---|")
    print(f"| fused kernel (16 steps, argmax included) | {n / ARGS.steps:.3f} | {kern * 1e6:.0f} | "
          f"{100 * kern / per:.0f}% |")
    rest = per - kern
    print(f"| Python around it | – | {rest * 1e6:.0f} | {100 * rest / per:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_train() if ARGS.mode == "train" else main_decode())
