"""Rotary position embedding kernels of the ``numba`` backend: rotate pairs of features of
(B, T, heads, hd) rows by their position's angle, forward or inverse (the backward), in parallel
over rows or serially for small decode steps."""

from __future__ import annotations

from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .fastmath import IN_ORDER, JIT_OPTS


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
@njit(fastmath=IN_ORDER, cache=True, nogil=True)
def rotate_pair(x0, x1, c, s):  # pragma: no cover - compiled
    """(x0 c - x1 s, x0 s + x1 c): the pair turned by the angle of (c, s), each product rounded
    (no fused multiply-add), the decode steps' and the prompt rows' one expression."""
    return x0 * c - x1 * s, x0 * s + x1 * c


@njit(**JIT_OPTS)
def _rope_item(x, cos, sin, bsel, inverse, out, bt):
    # one (b, t): rotate every head's pairs by +angle (forward) or -angle (inverse)
    T = x.shape[1]
    b = bt // T
    t = bt - b * T
    cb = b * bsel
    nh = x.shape[2]
    half = x.shape[3] // 2
    for h in range(nh):
        for i in range(half):
            c = cos[cb, t, i]
            s = sin[cb, t, i]
            if inverse:
                s = -s
            x0 = x[b, t, h, 2 * i]
            x1 = x[b, t, h, 2 * i + 1]
            # both inputs are read before either output is written: safe when out is x
            out[b, t, h, 2 * i], out[b, t, h, 2 * i + 1] = rotate_pair(x0, x1, c, s)


@njit(parallel=True, **JIT_OPTS)
def rope_parallel(x, cos, sin, bsel, inverse, out):
    r"""y_{2i} = x_{2i}\cos - x_{2i+1}\sin, y_{2i+1} = x_{2i}\sin + x_{2i+1}\cos (sin negated when
    ``inverse``). x, out: (B, T, nh, hd); cos, sin: (1 or B, T, hd/2), row ``b * bsel``."""
    n = x.shape[0] * x.shape[1]
    for bt in prange(n):
        _rope_item(x, cos, sin, bsel, inverse, out, bt)


@njit(**JIT_OPTS)
def rope_serial(x, cos, sin, bsel, inverse, out):
    """Serial twin of :func:`rope_parallel`."""
    n = x.shape[0] * x.shape[1]
    for bt in range(n):
        _rope_item(x, cos, sin, bsel, inverse, out, bt)
