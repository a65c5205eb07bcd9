r"""A Numba matrix-vector product for decoding: y = x W^T with few rows in x.

Decoding one token multiplies a (1, in) activation by every weight matrix (out, in): the time is
that of streaming W from memory once. On the project's CPU, OpenBLAS's sgemv reaches about half
of the copy bandwidth on one core; this loop (one dot product per output row, W read row by row
in memory order, vectorised by LLVM under ``fastmath`` into many partial sums) reaches close to
it. Sums are accumulated in the input dtype. Serial by design: the product is memory-bound and
waking a thread pool costs more than it gains on a busy machine. From about 8 rows on the
product is compute-bound and BLAS is as fast.

Imported only by the numba backend (importing it imports Numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)

#: at most this many rows of x take the GEMV loop; more rows go to BLAS (compute-bound there)
GEMV_MAX_ROWS = 4


@njit(fastmath=True, cache=True, nogil=True)
def _gemv_rows(x, w, y, zero):  # pragma: no cover - compiled
    M, K = x.shape
    N = w.shape[0]
    for i in range(N):
        for m in range(M):
            s = zero
            for k in range(K):
                s += x[m, k] * w[i, k]
            y[m, i] = s


def gemv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    r"""y = x W^T, y_{mi} = \sum_k x_{mk} W_{ik}, for x: (M, in) with M small and W: (out, in)
    C-contiguous, both of one float dtype. Returns y: (M, out)."""
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], w.shape[0]), dtype=w.dtype)
    _gemv_rows(x, w, y, y.dtype.type(0))
    return y
