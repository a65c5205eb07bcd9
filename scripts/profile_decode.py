#!/usr/bin/env python
"""Where the time of one batch-1 KV-cached decode step goes: per op on the per-op path (every
backend op timed by a wrapper), and for the numba backend's fused step (one compiled call) the
kernel against the Python work around it. Random weights of a benchmark shape, a 16-token
prompt, then ``--steps`` greedy steps; the per-op and fused runs take turns ``--reps`` times and
the best run of each counts.

    python scripts/profile_decode.py --shape s15 --threads 2

"before" is the numba backend with its fused step switched off (each op a backend call, the
GEMVs Numba, the rest NumPy); "after" is the fused step, called once per token, then the greedy
decoder that ``generate`` uses for one sequence (16 steps per compiled call).
"""

from __future__ import annotations

import argparse
import os
import time

import _bench_common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="s15", help="s15, s15gqa or s110")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")
    ap.add_argument("--reps", type=int, default=3)
    return ap.parse_args(argv)


ARGS = parse_args()
_bench_common.pin_threads(ARGS.threads)

import numpy as np  # noqa: E402

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.backends import get_backend  # noqa: E402
from minillama.model import init_params  # noqa: E402

OPS = ("embedding_forward", "rmsnorm_forward", "linear_forward", "rope_forward",
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


def main():
    name = ARGS.shape
    shape = _bench_common.shape("s15", n_kv_heads=2) if name == "s15gqa" else \
        _bench_common.shape(name)
    cfg = ModelConfig(**shape, tie_embeddings=True)
    be = get_backend("numba")
    model = Transformer(cfg, init_params(cfg, seed=0), backend=be)
    timers: dict[str, list] = {}
    for op in OPS:  # wrap each op: calls and seconds per step
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

    import types  # noqa: PLC0415

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
    print(f"# profile_decode: {name}, batch 1, numba backend, threads {ARGS.threads}, "
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


if __name__ == "__main__":
    main()
