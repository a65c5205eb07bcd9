"""The ``numba`` backend (derives from ``numpy``): ``backend`` holds the op overrides and the
greedy decoder, ``kernels`` the index of the jitted kernels, which live in ``fastmath`` (flags,
e^x), ``rope``, ``attention`` (forward loops), ``attention_backward``, ``attention_blas`` (tiled
with BLAS) and ``rows`` (cross-entropy, RMSNorm, SwiGLU); ``blas`` OpenBLAS's GEMM called from
kernels, ``gemv`` the small-batch products, ``decode`` the fused decode step, ``optim`` the one-pass
AdamW; ``_cache`` keys every kernel's disk cache on all of the folder's sources. The thread
count of the decode steps, by measured speed, is ``backends/tuner.py``.
"""

import os

# Numba's parallel kernels run on GNU OpenMP, whose threads spin at each barrier for about 300,000
# iterations before they sleep. A decode step ends a few hundred parallel regions; on a machine
# where other processes want the cores, a thread spinning for a partner that lost its core holds
# that core from everyone. A short spin keeps the quiet speed (measured the same within noise:
# SmolLM2-135M Q4_1, 123 tokens/s either way) and lifts the contended one (31 -> 41 tokens/s with
# two busy processes on two cores; docs/BENCHMARKS.md, "Decode on a busy machine"). Read by
# libgomp when it loads, so set before the first parallel kernel runs; the user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

