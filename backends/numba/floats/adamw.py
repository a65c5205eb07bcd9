r"""A fused AdamW update for NumPy arrays (Numba): one pass over a parameter buffer.

The array-expression AdamW of :class:`minillama.train.optim.AdamW` reads and writes each parameter's
buffers about a dozen times (decay, two moment updates, square root, division, scaling) and on
a small model its optimizer step costs as much as the backward pass. Here every element is read
once (θ, g, m, v) and written once (θ, m, v):

    m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
    \theta \leftarrow \theta (1 - \eta\lambda) - \frac{\eta}{1-\beta_1^t}
        \frac{m}{\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon}

Large buffers are split over the Numba threads in contiguous chunks. Imported only by the numba
backend (importing it imports Numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)

#: buffers of at least this many elements are split over the threads (measured on the 2-core VM,
#: 2026-11-23: the tiny model's 38 buffers, 0.8M numbers, 2.5 ms per step serial below 2^18,
#: 2.2 ms with every buffer from 2^14 on split)
PARALLEL_MIN_SIZE = 1 << 14


@njit(fastmath=True, cache=True, nogil=True)
def _adamw_range(p, g, m, v, lo, hi, decay, b1, c1, b2, c2, inv_bc2, eps, step_size):
    # pragma: no cover - compiled
    for i in range(lo, hi):
        gi = g[i]
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - step_size * (mi / (np.sqrt(vi) * inv_bc2 + eps))


@njit(fastmath=True, cache=True, nogil=True)
def adamw_serial(p, g, m, v, decay, b1, c1, b2, c2, inv_bc2, eps, step_size):
    # pragma: no cover - compiled
    """AdamW over flat buffers p, g, m, v (same length and dtype); scalars in that dtype:
    decay = 1 - ηλ, c1 = 1 - β1, c2 = 1 - β2, inv_bc2 = 1/sqrt(1 - β2^t),
    step_size = η / (1 - β1^t)."""
    _adamw_range(p, g, m, v, 0, p.shape[0], decay, b1, c1, b2, c2, inv_bc2, eps, step_size)


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def adamw_parallel(p, g, m, v, decay, b1, c1, b2, c2, inv_bc2, eps, step_size, parts):
    # pragma: no cover - compiled
    """:func:`adamw_serial` with the buffer split into ``parts`` contiguous blocks over the
    threads."""
    n = p.shape[0]
    step = (n + parts - 1) // parts
    for c in prange(parts):
        lo = min(n, c * step)
        hi = min(n, lo + step)
        _adamw_range(p, g, m, v, lo, hi, decay, b1, c1, b2, c2, inv_bc2, eps, step_size)
