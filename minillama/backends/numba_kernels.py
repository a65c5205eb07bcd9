r"""Numba kernels of the ``numba`` backend: RoPE and causal GQA attention, forward and backward.

Importing this module imports Numba but compiles nothing: every kernel is a lazily compiled
``@njit`` dispatcher (one specialisation per dtype and array layout, compiled on its first call
and cached on disk next to this file, or in Numba's user cache directory when that is read-only).

Fast-math: :data:`FASTMATH` allows reassociation, contraction into FMAs, reciprocal
multiplication, approximate functions and ignoring the sign of zero, but NOT ``nnan``/``ninf``:
the online softmax starts every row at a running maximum of :math:`-\infty` and relies on
:math:`e^{-\infty - m} = 0`, so infinities and NaNs must keep their IEEE meaning.

Every parallel kernel has a serial twin (same per-item body, plain ``range``) that the backend
uses when the work is too small to pay for waking the thread pool (decode steps of small models).
The thread count of the parallel kernels is Numba's: ``NUMBA_NUM_THREADS`` or the core count.

Size letters: B batch, T query time, S key time, H query heads, KVH key/value heads,
G = H / KVH, hd head dim.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

#: fast-math flags that keep inf/nan meaningful (no 'nnan', no 'ninf')
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: query positions per tile of the attention kernels (each brings its G heads: BR*G rows)
BR = 16
#: keys per tile: a (hd, BC) slice of K^T and a (BC, hd) slice of V stay in L1 for a whole tile
BC = 64

_opts = dict(cache=True, fastmath=FASTMATH, nogil=True)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
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
            out[b, t, h, 2 * i] = x0 * c - x1 * s
            out[b, t, h, 2 * i + 1] = x0 * s + x1 * c


@njit(parallel=True, **_opts)
def rope_parallel(x, cos, sin, bsel, inverse, out):
    r"""y_{2i} = x_{2i}\cos - x_{2i+1}\sin, y_{2i+1} = x_{2i}\sin + x_{2i+1}\cos (sin negated when
    ``inverse``). x, out: (B, T, nh, hd); cos, sin: (1 or B, T, hd/2), row ``b * bsel``."""
    n = x.shape[0] * x.shape[1]
    for bt in prange(n):
        _rope_item(x, cos, sin, bsel, inverse, out, bt)


@njit(**_opts)
def rope_serial(x, cos, sin, bsel, inverse, out):
    """Serial twin of :func:`rope_parallel`."""
    n = x.shape[0] * x.shape[1]
    for bt in range(n):
        _rope_item(x, cos, sin, bsel, inverse, out, bt)


# ---------------------------------------------------------------------------------------------
# Attention forward: tiled online softmax (FlashAttention-style), one (b, kv head) per work item
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def _attn_fwd_item(q, k, v, starts, scale, out, lse, u):
    B, T, H, hd = q.shape
    S = k.shape[1]
    KVH = k.shape[2]
    G = H // KVH
    b = u // KVH
    kh = u - b * KVH
    st = starts[b]
    dt = q.dtype
    zero = scale - scale
    R = BR * G
    nk = min(st + T, S)  # keys read by any query of this sequence
    # K^T pre-scaled by 1/sqrt(hd): scores of a row are axpy's over contiguous key runs
    kT = np.empty((hd, max(nk, 1)), dtype=dt)
    for c in range(nk):
        for d in range(hd):
            kT[d, c] = k[b, c, kh, d] * scale
    s = np.empty((R, BC), dtype=dt)
    acc = np.empty((R, hd), dtype=dt)
    m = np.empty(R, dtype=dt)
    l = np.empty(R, dtype=dt)
    for t0 in range(0, T, BR):
        t1 = min(t0 + BR, T)
        nr = (t1 - t0) * G
        for r in range(nr):
            m[r] = -np.inf
            l[r] = zero
            for d in range(hd):
                acc[r, d] = zero
        kend = min(st + t1, S)
        for c0 in range(0, kend, BC):
            c1 = min(c0 + BC, kend)
            for r in range(nr):
                t = t0 + r // G
                h = kh * G + (r - (r // G) * G)
                n = min(st + t + 1, c1) - c0  # keys c0..c0+n-1 are visible to this row
                if n <= 0:
                    continue
                srow = s[r]
                for c in range(n):
                    srow[c] = zero
                for d in range(hd):
                    qd = q[b, t, h, d]
                    for c in range(n):
                        srow[c] += qd * kT[d, c0 + c]
                mold = m[r]
                mx = mold
                for c in range(n):
                    mx = max(mx, srow[c])
                corr = math.exp(mold - mx)  # 0 on the first tile (mold = -inf)
                tot = zero
                for c in range(n):
                    e = math.exp(srow[c] - mx)
                    srow[c] = e
                    tot += e
                l[r] = l[r] * corr + tot
                m[r] = mx
                for d in range(hd):
                    acc[r, d] *= corr
                for c in range(n):
                    pc = srow[c]
                    for d in range(hd):
                        acc[r, d] += pc * v[b, c0 + c, kh, d]
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            inv = (scale / scale) / l[r]
            for d in range(hd):
                out[b, t, h, d] = acc[r, d] * inv
            lse[b, h, t] = m[r] + math.log(l[r])


@njit(parallel=True, **_opts)
def attn_fwd_parallel(q, k, v, starts, scale, out, lse):
    r"""Causal GQA attention, streaming over key tiles with a running max m and sum l per row:

    m' = \max(m, \max_j s_j),  l' = l e^{m - m'} + \sum_j e^{s_j - m'},
    o' = o e^{m - m'} + \sum_j e^{s_j - m'} v_j;  finally o / l and lse = m + \log l.

    q, out: (B, T, H, hd); k, v: (B, S, KVH, hd); starts: (B,) int64; lse: (B, H, T).
    Parallel over B*KVH; the G query heads of a KV head share each K/V tile."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_fwd_item(q, k, v, starts, scale, out, lse, u)


@njit(**_opts)
def attn_fwd_serial(q, k, v, starts, scale, out, lse):
    """Serial twin of :func:`attn_fwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_fwd_item(q, k, v, starts, scale, out, lse, u)


# ---------------------------------------------------------------------------------------------
# Attention forward, decode shape: few queries against a long cache (no K transpose)
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def _attn_dec_item(q, k, v, starts, scale, out, lse, u):
    B, T, H, hd = q.shape
    S = k.shape[1]
    KVH = k.shape[2]
    G = H // KVH
    b = u // KVH
    kh = u - b * KVH
    st = starts[b]
    dt = q.dtype
    zero = scale - scale
    ninf = np.full(1, -np.inf, dtype=dt)[0]
    one = scale / scale
    nk = min(st + T, S)
    p = np.empty(max(nk, 1), dtype=dt)
    acc = np.empty(hd, dtype=dt)
    for t in range(T):
        n = min(st + t + 1, S)
        for g in range(G):
            h = kh * G + g
            mx = ninf
            for c in range(n):
                sc = zero
                for d in range(hd):
                    sc += q[b, t, h, d] * k[b, c, kh, d]
                sc *= scale
                p[c] = sc
                mx = max(mx, sc)
            tot = zero
            for c in range(n):
                e = math.exp(p[c] - mx)
                p[c] = e
                tot += e
            for d in range(hd):
                acc[d] = zero
            for c in range(n):
                pc = p[c]
                for d in range(hd):
                    acc[d] += pc * v[b, c, kh, d]
            inv = one / tot
            for d in range(hd):
                out[b, t, h, d] = acc[d] * inv
            lse[b, h, t] = mx + math.log(tot)


@njit(parallel=True, **_opts)
def attn_dec_parallel(q, k, v, starts, scale, out, lse):
    """Decode-shaped attention (small T, long S): per row, scores against contiguous cache rows,
    then softmax and the weighted sum of V; O(S) scratch per thread. Same outputs as
    :func:`attn_fwd_parallel`."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_dec_item(q, k, v, starts, scale, out, lse, u)


@njit(**_opts)
def attn_dec_serial(q, k, v, starts, scale, out, lse):
    """Serial twin of :func:`attn_dec_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_dec_item(q, k, v, starts, scale, out, lse, u)


# ---------------------------------------------------------------------------------------------
# Attention backward: recompute P from lse tile by tile
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u):
    B, T, H, hd = q.shape
    S = k.shape[1]
    KVH = k.shape[2]
    G = H // KVH
    b = u // KVH
    kh = u - b * KVH
    st = starts[b]
    dt = q.dtype
    zero = scale - scale
    R = BR * G
    nk = min(st + T, S)
    kT = np.empty((hd, max(nk, 1)), dtype=dt)
    vT = np.empty((hd, max(nk, 1)), dtype=dt)
    for c in range(nk):
        for d in range(hd):
            kT[d, c] = k[b, c, kh, d] * scale
            vT[d, c] = v[b, c, kh, d]
    # this work item owns dk[b, :, kh], dv[b, :, kh]: zero them (keys nobody reads included)
    for c in range(S):
        for d in range(hd):
            dk[b, c, kh, d] = zero
            dv[b, c, kh, d] = zero
    p = np.empty((R, BC), dtype=dt)
    ds = np.empty((R, BC), dtype=dt)
    dqa = np.empty((R, hd), dtype=dt)
    D = np.empty(R, dtype=dt)
    nrow = np.empty(R, dtype=np.int64)
    dkc = np.empty(hd, dtype=dt)
    dvc = np.empty(hd, dtype=dt)
    for t0 in range(0, T, BR):
        t1 = min(t0 + BR, T)
        nr = (t1 - t0) * G
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            acc = zero
            for d in range(hd):
                acc += dout[b, t, h, d] * out[b, t, h, d]
                dqa[r, d] = zero
            D[r] = acc  # D_t = sum_j P_tj dP_tj = dO_t . O_t
        kend = min(st + t1, S)
        for c0 in range(0, kend, BC):
            c1 = min(c0 + BC, kend)
            for r in range(nr):
                t = t0 + r // G
                h = kh * G + (r - (r // G) * G)
                n = max(min(st + t + 1, c1) - c0, 0)
                nrow[r] = n
                if n == 0:
                    continue
                prow = p[r]
                dsrow = ds[r]
                for c in range(n):
                    prow[c] = zero
                    dsrow[c] = zero
                for d in range(hd):
                    qd = q[b, t, h, d]
                    gd = dout[b, t, h, d]
                    for c in range(n):
                        prow[c] += qd * kT[d, c0 + c]
                        dsrow[c] += gd * vT[d, c0 + c]
                L = lse[b, h, t]
                Dr = D[r]
                for c in range(n):
                    pc = math.exp(prow[c] - L)
                    prow[c] = pc
                    dsrow[c] = pc * (dsrow[c] - Dr)
                for c in range(n):
                    w = dsrow[c]
                    for d in range(hd):
                        dqa[r, d] += w * k[b, c0 + c, kh, d]
            for c in range(c1 - c0):
                for d in range(hd):
                    dkc[d] = zero
                    dvc[d] = zero
                for r in range(nr):
                    if c < nrow[r]:
                        t = t0 + r // G
                        h = kh * G + (r - (r // G) * G)
                        w = ds[r, c]
                        pw = p[r, c]
                        for d in range(hd):
                            dkc[d] += w * q[b, t, h, d]
                            dvc[d] += pw * dout[b, t, h, d]
                for d in range(hd):
                    dk[b, c0 + c, kh, d] += dkc[d] * scale
                    dv[b, c0 + c, kh, d] += dvc[d]
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            for d in range(hd):
                dq[b, t, h, d] = dqa[r, d] * scale


@njit(parallel=True, **_opts)
def attn_bwd_parallel(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    r"""Backward of :func:`attn_fwd_parallel` from the saved lse, tile by tile:

    P_{tj} = e^{s_{tj} - lse_t},  dP = dO V^T,  D_t = dO_t \cdot O_t,  dS = P \odot (dP - D),
    dQ = dS K / \sqrt{hd},  dK = \sum_g dS^T Q / \sqrt{hd},  dV = \sum_g P^T dO.

    One (b, kv head) per work item (it owns its dK/dV rows: no races); dq, dk, dv are written
    in full. Extra memory O(S hd + BR G BC) per thread."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)


@njit(**_opts)
def attn_bwd_serial(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    """Serial twin of :func:`attn_bwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)
