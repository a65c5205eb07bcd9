#!/usr/bin/env python
"""A/B in one process: the training step on the ``numpy`` backend as it is now, against the same
backend with the op functions of another ``ops.py`` (an older commit's, say) bound in their place.

Both models share weights and tokens; their steps alternate (A B B A ...) so that both see the
same background load, which makes this steadier than two separate runs on a busy machine.
Prints the median step time of each side and the ratio (after / before; < 1: now is faster).

    git worktree add --detach /tmp/old 5c8a82c
    python scripts/bench_ops_ab.py --old-ops /tmp/old/minillama/ops.py --threads 1

With ``--threads 1`` the clock is the process CPU time, else wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import _bench_common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-ops", required=True, help="path of the other ops.py (self-contained)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS / row threads (default 1)")
    ap.add_argument("--configs", default="tiny,s15", help="comma list of: tiny, s15")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per side (0: 15 tiny, 3 s15)")
    return ap.parse_args(argv)


ARGS = parse_args()
_bench_common.pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.backends.numpy.backend import NumpyBackend  # noqa: E402
from minillama.model import init_params  # noqa: E402

#: name -> (B, T, default steps)
RUNS = {"tiny": (16, 128, 15), "s15": (8, 256, 3)}


def backend_with_ops(path: str) -> NumpyBackend:
    """A NumpyBackend whose public forward/backward functions come from the ops.py at ``path``."""
    spec = importlib.util.spec_from_file_location("minillama_old_ops", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cls = type("OldOpsBackend", (NumpyBackend,), {"name": "numpy-old-ops"})
    for name in dir(old):
        if name.endswith(("_forward", "_backward")) and not name.startswith("_"):
            setattr(cls, name, staticmethod(getattr(old, name)))
    return cls()


def main() -> None:
    clock = time.process_time if ARGS.threads == 1 else time.perf_counter
    before = backend_with_ops(ARGS.old_ops)
    print(f"# bench_ops_ab: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"threads={ARGS.threads}, clock={'cpu' if ARGS.threads == 1 else 'wall'}, "
          f"old ops: {ARGS.old_ops}")
    print("| config | B x T | before ms/step | after ms/step | after/before |")
    print("|---|---|---|---|---|")
    for name in ARGS.configs.split(","):
        B, T, steps = RUNS[name]
        cfg = ModelConfig(**_bench_common.shape(name))
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


if __name__ == "__main__":
    main()
