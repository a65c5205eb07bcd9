"""BLAS-tiled causal GQA attention of the ``numba`` backend, forward and backward (its path for
T >= 16 when NumPy's OpenBLAS is found): OpenBLAS GEMMs called from the kernel (:mod:`.blas`)
for the tile products, Numba loops for the softmax work between them.

Size letters: B batch, T query time, S key time, H query heads, KVH key/value heads,
G = H / KVH, hd head dim.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .blas import gemm
from .fastmath import JIT_OPTS, fexp, rowmax


# ---------------------------------------------------------------------------------------------
# BLAS-tiled attention (the backend's path for T >= 16 when NumPy's OpenBLAS is found): the
# score tiles S = Q_i K_j^T, dP = dO_i V_j^T and the products with V, K, Q are OpenBLAS GEMMs
# called from the kernel (:mod:`.blas`); the two tile kernels below do the elementwise
# softmax work between them, in place. Row r of a tile is query time t0 + r of one head, column
# c is key c0 + c; st is the sequence's start position.
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
def _tile_fwd(s, R, C, m, l, o, st, t0, c0, scale):
    # s[:R, :C] (s C-contiguous, so that each row is a contiguous vector): scores of the tile,
    # becomes P = e^{x - m'}; m, l: (>= R,); o: (R, hd)
    hd = o.shape[1]
    zero = scale - scale
    for r in range(R):
        srow = s[r]
        n = min(st + t0 + r + 1 - c0, C)  # visible keys of this row in the tile
        if n <= 0:
            for c in range(C):
                srow[c] = zero
            continue
        for c in range(n):
            srow[c] *= scale
        mold = m[r]
        mx = max(mold, rowmax(srow, n))
        corr = fexp(mold - mx)  # 0 on the row's first tile (mold = -inf)
        tot = zero
        for c in range(n):
            e = fexp(srow[c] - mx)
            srow[c] = e
            tot += e
        for c in range(n, C):
            srow[c] = zero
        l[r] = l[r] * corr + tot
        m[r] = mx
        orow = o[r]
        for d in range(hd):
            orow[d] *= corr


@njit(**JIT_OPTS)
def _tile_bwd(s, dp, R, C, lse, D, st, t0, c0, scale):
    # s[:R, :C] scores, becomes P; dp[:R, :C] dO V^T, becomes dS / sqrt(hd) (both C-contiguous
    # buffers); lse, D: (>= R,)
    zero = scale - scale
    for r in range(R):
        srow = s[r]
        dprow = dp[r]
        n = max(min(st + t0 + r + 1 - c0, C), 0)
        L = lse[r]
        Dr = D[r]
        for c in range(n):
            pc = fexp(srow[c] * scale - L)
            srow[c] = pc
            dprow[c] = pc * (dprow[c] - Dr) * scale
        for c in range(n, C):
            srow[c] = zero
            dprow[c] = zero


@njit(inline="always")
def _attn_dims(q, k):
    # B, T, H, hd, S, KVH, G and the row strides (in numbers) of q (B, T, H, hd) and k (B, S,
    # KVH, hd), both C-contiguous
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    return B, T, H, hd, S, KVH, H // KVH, H * hd, KVH * hd


@njit(parallel=True, **JIT_OPTS)
def attn_fwd_blas(fn, ilp64, q, k, v, starts, scale, one, BQ, BK, out, lse):
    r"""Causal GQA attention, forward, tile by tile with an online softmax:

    S = Q_i K_j^T (BLAS),  x = S / \sqrt{hd} (masked: key j > p_b + t),
    m' = \max(m, \max_j x_j),  P = e^{x - m'},  l' = l e^{m - m'} + \sum_j P_j,
    O \leftarrow O e^{m - m'} + P V_j (BLAS);  finally O / l and lse = m + \log l.

    q, out: (B, T, H, hd); k, v: (B, S, KVH, hd), all C-contiguous; starts: (B,) positions of
    each sequence's first query; lse: (B, H, T). Query tiles of ``BQ`` rows, key tiles of ``BK``
    keys; causal tiles past a tile's last query are skipped. One (sequence, KV head) per
    ``prange`` item; the products are OpenBLAS GEMMs (address ``fn``, see :mod:`.blas`)
    on that item's thread, read from and written to q, k, v, out in place (leading dimensions
    H hd and KVH hd), so nothing is transposed or copied."""
    B, T, H, hd, S, KVH, G, ldq, ldk = _attn_dims(q, k)
    isz = q.itemsize
    zero = scale - scale
    pq, pk, pv, po = q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data
    for u in prange(B * KVH):
        b = u // KVH
        kvh = u - b * KVH
        sbuf = np.empty((BQ, BK), dtype=q.dtype)
        m = np.empty(BQ, dtype=q.dtype)
        l = np.empty(BQ, dtype=q.dtype)
        for h in range(kvh * G, kvh * G + G):
            for t0 in range(0, T, BQ):
                t1 = min(T, t0 + BQ)
                R = t1 - t0
                o = out[b, t0:t1, h]  # (R, hd)
                for r in range(R):
                    m[r] = -np.inf
                    l[r] = zero
                    for d in range(hd):
                        o[r, d] = zero
                qa = pq + ((b * T + t0) * H + h) * hd * isz
                oa = po + ((b * T + t0) * H + h) * hd * isz
                kend = min(S, starts[b] + t1)
                for c0 in range(0, kend, BK):
                    C = min(kend, c0 + BK) - c0
                    kva = ((b * S + c0) * KVH + kvh) * hd * isz
                    gemm(fn, ilp64, False, True, R, C, hd, one, qa, ldq, pk + kva, ldk, zero,
                         sbuf.ctypes.data, BK)
                    _tile_fwd(sbuf, R, C, m, l, o, starts[b], t0, c0, scale)
                    gemm(fn, ilp64, False, False, R, hd, C, one, sbuf.ctypes.data, BK, pv + kva,
                         ldk, one, oa, ldq)
                for r in range(R):
                    inv = one / l[r]
                    for d in range(hd):
                        o[r, d] *= inv
                    lse[b, h, t0 + r] = m[r] + np.log(l[r])


@njit(parallel=True, **JIT_OPTS)
def attn_bwd_blas(fn, ilp64, q, k, v, out, dout, lse, starts, scale, one, BQ, BK, dq, dk, dv):
    r"""Gradients of :func:`attn_fwd_blas`, recomputing P tile by tile from the saved lse:

    D_t = dO_t \cdot O_t,  P = e^{S/\sqrt{hd} - lse},  dS = P \odot (dO V_j^T - D),
    dV_j += P^T dO,  dK_j += dS^T Q / \sqrt{hd},  dQ += dS K_j / \sqrt{hd}  (products by BLAS).

    Shapes as in the forward; dq: (B, T, H, hd), dk, dv: (B, S, KVH, hd), C-contiguous, written
    completely. One (sequence, KV head) per ``prange`` item, which owns its rows of dk and dv
    (its G query heads are summed there in turn, so no two threads write the same rows)."""
    B, T, H, hd, S, KVH, G, ldq, ldk = _attn_dims(q, k)
    isz = q.itemsize
    zero = scale - scale
    pq, pk, pv, pdo = q.ctypes.data, k.ctypes.data, v.ctypes.data, dout.ctypes.data
    pdq, pdk, pdv = dq.ctypes.data, dk.ctypes.data, dv.ctypes.data
    for u in prange(B * KVH):
        b = u // KVH
        kvh = u - b * KVH
        dk[b, :, kvh, :] = zero
        dv[b, :, kvh, :] = zero
        sbuf = np.empty((BQ, BK), dtype=q.dtype)
        pbuf = np.empty((BQ, BK), dtype=q.dtype)
        L = np.empty(BQ, dtype=q.dtype)
        Dt = np.empty(BQ, dtype=q.dtype)
        for h in range(kvh * G, kvh * G + G):
            for t0 in range(0, T, BQ):
                t1 = min(T, t0 + BQ)
                R = t1 - t0
                for r in range(R):
                    acc = zero
                    for d in range(hd):
                        acc += dout[b, t0 + r, h, d] * out[b, t0 + r, h, d]
                        dq[b, t0 + r, h, d] = zero
                    Dt[r] = acc
                    L[r] = lse[b, h, t0 + r]
                row = ((b * T + t0) * H + h) * hd * isz
                kend = min(S, starts[b] + t1)
                for c0 in range(0, kend, BK):
                    C = min(kend, c0 + BK) - c0
                    kva = ((b * S + c0) * KVH + kvh) * hd * isz
                    ps, pp = sbuf.ctypes.data, pbuf.ctypes.data
                    gemm(fn, ilp64, False, True, R, C, hd, one, pq + row, ldq, pk + kva, ldk,
                         zero, ps, BK)
                    gemm(fn, ilp64, False, True, R, C, hd, one, pdo + row, ldq, pv + kva, ldk,
                         zero, pp, BK)
                    _tile_bwd(sbuf, pbuf, R, C, L, Dt, starts[b], t0, c0, scale)
                    gemm(fn, ilp64, True, False, C, hd, R, one, ps, BK, pdo + row, ldq, one,
                         pdv + kva, ldk)
                    gemm(fn, ilp64, True, False, C, hd, R, one, pp, BK, pq + row, ldq, one,
                         pdk + kva, ldk)
                    gemm(fn, ilp64, False, False, R, hd, C, one, pp, BK, pk + kva, ldk, one,
                         pdq + row, ldq)
