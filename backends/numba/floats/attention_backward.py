"""Causal GQA attention backward kernels of the ``numba`` backend, all-Numba loops (short T):
P is recomputed from the saved log-sum-exp tile by tile, with the forward's tile sizes and score
loops (:mod:`.attention_forward`); parallel over (b, kv head) items, with a serial twin.

Size letters: B batch, T query time, S key time, H query heads, KVH key/value heads,
G = H / KVH, hd head dim.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .attention_forward import BC, BR, axpy_rows, scores
from .fastmath import JIT_OPTS, fexp


# ---------------------------------------------------------------------------------------------
# Attention backward: recompute P from lse tile by tile
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
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
                scores(q[b, t, h], k, b, kh, c0, n, scale, prow)
                scores(dout[b, t, h], v, b, kh, c0, n, scale / scale, dsrow)
                L = lse[b, h, t]
                Dr = D[r]
                for c in range(n):
                    pc = fexp(prow[c] - L)
                    prow[c] = pc
                    dsrow[c] = pc * (dsrow[c] - Dr)
                axpy_rows(dsrow, k, b, kh, c0, n, dqa[r])
            # dK, dV of the tile's keys: key c gets the rows with c < nrow[r], a suffix
            # r >= rs of the tile's rows (nrow grows with r); two rows per pass
            rs = 0
            for c in range(c1 - c0):
                while rs < nr and nrow[rs] <= c:
                    rs += 1
                for d in range(hd):
                    dkc[d] = zero
                    dvc[d] = zero
                r = rs
                while r + 2 <= nr:
                    ta = t0 + r // G
                    ha = kh * G + (r - (r // G) * G)
                    tb = t0 + (r + 1) // G
                    hb = kh * G + (r + 1 - ((r + 1) // G) * G)
                    wa = ds[r, c]
                    wb = ds[r + 1, c]
                    pa = p[r, c]
                    pb = p[r + 1, c]
                    qa = q[b, ta, ha]
                    qb = q[b, tb, hb]
                    oa = dout[b, ta, ha]
                    ob = dout[b, tb, hb]
                    for d in range(hd):
                        dkc[d] += wa * qa[d] + wb * qb[d]
                        dvc[d] += pa * oa[d] + pb * ob[d]
                    r += 2
                if r < nr:
                    ta = t0 + r // G
                    ha = kh * G + (r - (r // G) * G)
                    wa = ds[r, c]
                    pa = p[r, c]
                    qa = q[b, ta, ha]
                    oa = dout[b, ta, ha]
                    for d in range(hd):
                        dkc[d] += wa * qa[d]
                        dvc[d] += pa * oa[d]
                dkrow = dk[b, c0 + c, kh]
                dvrow = dv[b, c0 + c, kh]
                for d in range(hd):
                    dkrow[d] += dkc[d] * scale
                    dvrow[d] += dvc[d]
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            for d in range(hd):
                dq[b, t, h, d] = dqa[r, d] * scale


@njit(parallel=True, **JIT_OPTS)
def attn_bwd_parallel(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    r"""Backward of :func:`attn_fwd_parallel` from the saved lse, tile by tile:

    P_{tj} = e^{s_{tj} - lse_t},  dP = dO V^T,  D_t = dO_t \cdot O_t,  dS = P \odot (dP - D),
    dQ = dS K / \sqrt{hd},  dK = \sum_g dS^T Q / \sqrt{hd},  dV = \sum_g P^T dO.

    One (b, kv head) per work item (it owns its dK/dV rows: no races); dq, dk, dv are written
    in full. Scratch per item O(BR G (BC + hd)), independent of T and S."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)


@njit(**JIT_OPTS)
def attn_bwd_serial(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    """Serial twin of :func:`attn_bwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)
