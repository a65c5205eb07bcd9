"""What every benchmark script does before NumPy loads: pin the thread counts of every library
(BLAS, OpenMP, Numba, minillama's row threads) and put the repository on ``sys.path``.

Thread pools size themselves when their library is first imported, so :func:`pin_threads` must run
before ``import numpy``. Model shapes come from :data:`minillama.core.config.SHAPES`.
"""

from __future__ import annotations

import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS", "MINILLAMA_NUM_THREADS")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def pin_threads(n: int) -> None:
    """Set every thread-count variable to ``n`` and make the package importable."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


def shape(name: str, **overrides) -> dict:
    """A copy of the named model shape of :data:`minillama.core.config.SHAPES`, with overrides."""
    from minillama.core.config import SHAPES

    return {**SHAPES[name], **overrides}


def train_configs() -> dict:
    """The training-step benchmark configs: name -> (model shape, B, T), shared by
    scripts/bench_train.py, profile_step.py train and bench_ops.py --gemm."""
    return {"tiny": (shape("tiny"), 16, 128), "s15": (shape("s15"), 8, 256)}
