"""Causal GQA attention forward kernels of the ``numba`` backend, all-Numba loops: the tiled
online softmax (FlashAttention-style, one (b, kv head) per work item) for prefill and training
(short T), and the decode shape (few queries against a long cache, split along the keys and
combined). :data:`BR` and :data:`BC` are the tile sizes, shared with the backward.

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

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..decode.float_step import SPAN, _join_spans, _span_softmax, _spans
from .fastmath import JIT_OPTS, fexp, rowmax
from .span_ir import LANES, span_scores1, span_scores2, span_values1, span_values4, span_values4x2

#: query positions per tile of the attention kernels (each brings its G heads: BR*G rows)
BR = 16
#: keys per tile: a (hd, BC) slice of K^T and a (BC, hd) slice of V stay in L1 for a whole tile
BC = 64


# ---------------------------------------------------------------------------------------------
# Attention forward: tiled online softmax (FlashAttention-style), one (b, kv head) per work item
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
def scores(qrow, k, b, kh, c0, n, scale, srow):
    # srow[c] = (q . k_{c0+c}) * scale for c < n; four keys per pass share each load of q
    zero = scale - scale
    hd = qrow.shape[0]
    c = 0
    while c + 4 <= n:
        k0 = k[b, c0 + c, kh]
        k1 = k[b, c0 + c + 1, kh]
        k2 = k[b, c0 + c + 2, kh]
        k3 = k[b, c0 + c + 3, kh]
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        for d in range(hd):
            qd = qrow[d]
            a0 += qd * k0[d]
            a1 += qd * k1[d]
            a2 += qd * k2[d]
            a3 += qd * k3[d]
        srow[c] = a0 * scale
        srow[c + 1] = a1 * scale
        srow[c + 2] = a2 * scale
        srow[c + 3] = a3 * scale
        c += 4
    while c < n:
        k0 = k[b, c0 + c, kh]
        a0 = zero
        for d in range(hd):
            a0 += qrow[d] * k0[d]
        srow[c] = a0 * scale
        c += 1


@njit(**JIT_OPTS)
def axpy_rows(w, x, b, kh, c0, n, acc):
    # acc += sum_{c < n} w[c] x_{c0+c}  (rows of x: (B, S, KVH, hd)), four rows per pass
    hd = acc.shape[0]
    c = 0
    while c + 4 <= n:
        w0 = w[c]
        w1 = w[c + 1]
        w2 = w[c + 2]
        w3 = w[c + 3]
        x0 = x[b, c0 + c, kh]
        x1 = x[b, c0 + c + 1, kh]
        x2 = x[b, c0 + c + 2, kh]
        x3 = x[b, c0 + c + 3, kh]
        for d in range(hd):
            acc[d] += w0 * x0[d] + w1 * x1[d] + w2 * x2[d] + w3 * x3[d]
        c += 4
    while c < n:
        w0 = w[c]
        x0 = x[b, c0 + c, kh]
        for d in range(hd):
            acc[d] += w0 * x0[d]
        c += 1


@njit(**JIT_OPTS)
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
    one = scale / scale
    R = BR * G
    s = np.empty((R, BC), dtype=dt)
    acc = np.empty((R, hd), dtype=dt)
    m = np.empty(R, dtype=dt)
    l = np.empty(R, dtype=dt)
    for t0 in range(0, T, BR):
        t1 = min(t0 + BR, T)
        nr = (t1 - t0) * G  # rows r = (t - t0) * G + g of this tile
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
                n = min(st + t + 1, c1) - c0  # keys c0 .. c0+n-1 are visible to this row
                if n <= 0:
                    continue
                srow = s[r]
                scores(q[b, t, h], k, b, kh, c0, n, scale, srow)
                mold = m[r]
                mx = max(mold, rowmax(srow, n))
                corr = fexp(mold - mx)  # 0 on the first tile (mold = -inf)
                tot = zero
                for c in range(n):
                    e = fexp(srow[c] - mx)
                    srow[c] = e
                    tot += e
                l[r] = l[r] * corr + tot
                m[r] = mx
                arow = acc[r]
                for d in range(hd):
                    arow[d] *= corr
                axpy_rows(srow, v, b, kh, c0, n, arow)
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            inv = one / l[r]
            for d in range(hd):
                out[b, t, h, d] = acc[r, d] * inv
            lse[b, h, t] = m[r] + math.log(l[r])


@njit(parallel=True, **JIT_OPTS)
def attn_fwd_parallel(q, k, v, starts, scale, out, lse):
    r"""Causal GQA attention, streaming over key tiles with a running max m and sum l per row:

    m' = \max(m, \max_j s_j),  l' = l e^{m - m'} + \sum_j e^{s_j - m'},
    o' = o e^{m - m'} + \sum_j e^{s_j - m'} v_j;  finally o / l and lse = m + \log l.

    q, out: (B, T, H, hd); k, v: (B, S, KVH, hd); starts: (B,) int64; lse: (B, H, T);
    scale: 1/\sqrt{hd} in the dtype of q. Parallel over B*KVH work items; the G query heads of
    a KV head are rows of the same tile, so each K/V tile is read once per group. Scratch per
    item: O(BR G (BC + hd)), independent of T and S."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_fwd_item(q, k, v, starts, scale, out, lse, u)


@njit(**JIT_OPTS)
def attn_fwd_serial(q, k, v, starts, scale, out, lse):
    """Serial twin of :func:`attn_fwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_fwd_item(q, k, v, starts, scale, out, lse, u)


# ---------------------------------------------------------------------------------------------
# Attention forward, decode shape: few queries against a long cache, split along the keys
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
def _attn_dec_item(q, k, v, starts, scale, nsplit, pm, pl, pacc, w):
    # work item w = (b, key chunk), all heads: the cache rows k[b, c] / v[b, c] (KVH*hd numbers,
    # contiguous) are streamed once in memory order. Per row r = t*H + h it leaves the
    # unnormalised partial softmax over its chunk: pm (max), pl (sum of e^{s - max}),
    # pacc (sum of e^{s - max} v).
    B, T, H, hd = q.shape
    S = k.shape[1]
    KVH = k.shape[2]
    G = H // KVH
    b = w // nsplit
    sp = w - b * nsplit
    st = starts[b]
    dt = q.dtype
    zero = scale - scale
    nk = min(st + T, S)
    chunk = (nk + nsplit - 1) // nsplit
    cs = sp * chunk
    ce = min(cs + chunk, nk)
    p = np.empty((H, max(chunk, 1)), dtype=dt)
    for t in range(T):
        n = min(ce, st + t + 1) - cs  # keys cs .. cs+n-1 are visible to query t
        for h in range(H):
            r = t * H + h
            for d in range(hd):
                pacc[w, r, d] = zero
            pm[w, r] = -np.inf
            pl[w, r] = zero
        if n <= 0:
            continue
        for c in range(n):
            for kh in range(KVH):
                krow = k[b, cs + c, kh]
                for g in range(G):
                    h = kh * G + g
                    qrow = q[b, t, h]
                    a = zero
                    for d in range(hd):
                        a += qrow[d] * krow[d]
                    p[h, c] = a * scale
        for h in range(H):
            prow = p[h]
            mx = rowmax(prow, n)
            tot = zero
            for c in range(n):
                e = fexp(prow[c] - mx)
                prow[c] = e
                tot += e
            pm[w, t * H + h] = mx
            pl[w, t * H + h] = tot
        for c in range(n):
            for kh in range(KVH):
                vrow = v[b, cs + c, kh]
                for g in range(G):
                    h = kh * G + g
                    pc = p[h, c]
                    arow = pacc[w, t * H + h]
                    for d in range(hd):
                        arow[d] += pc * vrow[d]


@njit(**JIT_OPTS)
def _attn_dec_combine(nsplit, pm, pl, pacc, out, lse):
    # merge the chunks of each row: M = max_i m_i, L = sum_i l_i e^{m_i - M},
    # o = sum_i acc_i e^{m_i - M} / L, lse = M + log L
    B, T, H, hd = out.shape
    zero = pl[0, 0] - pl[0, 0]
    one = zero + 1
    for b in range(B):
        for r in range(T * H):
            t = r // H
            h = r - t * H
            M = pm[b * nsplit, r]
            for sp in range(1, nsplit):
                M = max(M, pm[b * nsplit + sp, r])
            L = zero
            for d in range(hd):
                out[b, t, h, d] = zero
            for sp in range(nsplit):
                w = b * nsplit + sp
                f = fexp(pm[w, r] - M)  # 0 for an empty chunk (pm = -inf)
                L += pl[w, r] * f
                for d in range(hd):
                    out[b, t, h, d] += pacc[w, r, d] * f
            inv = one / L
            for d in range(hd):
                out[b, t, h, d] *= inv
            lse[b, h, t] = M + math.log(L)


@njit(parallel=True, **JIT_OPTS)
def attn_dec_parallel(q, k, v, starts, scale, nsplit, pm, pl, pacc, out, lse):
    r"""Decode-shaped attention (few queries, long KV cache): work items (b, key chunk) in
    parallel, each streaming its cache rows once in memory order for all heads (no transpose),
    a two-pass softmax over its chunk, then the exact merge of the chunks (flash-decoding):

    M = \max_i m_i,  L = \sum_i l_i e^{m_i - M},  o = \sum_i a_i e^{m_i - M} / L.

    pm, pl: (B*nsplit, T*H) and pacc: (B*nsplit, T*H, hd) scratch; O(H S / nsplit) scores per
    item. Same outputs as :func:`attn_fwd_parallel`."""
    for w in prange(k.shape[0] * nsplit):
        _attn_dec_item(q, k, v, starts, scale, nsplit, pm, pl, pacc, w)
    _attn_dec_combine(nsplit, pm, pl, pacc, out, lse)


@njit(**JIT_OPTS)
def attn_dec_serial(q, k, v, starts, scale, nsplit, pm, pl, pacc, out, lse):
    """Serial twin of :func:`attn_dec_parallel`."""
    for w in range(k.shape[0] * nsplit):
        _attn_dec_item(q, k, v, starts, scale, nsplit, pm, pl, pacc, w)
    _attn_dec_combine(nsplit, pm, pl, pacc, out, lse)


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def _keys_by_d(k, starts, T):  # pragma: no cover - compiled
    """kt (B, KVH, hd, n_pad): k[b, j, kh, d] at kt[b, kh, d, j] for the keys rows 0..p read,
    zeros after them up to n_pad, a whole number of spans."""
    B, KVH, hd = k.shape[0], k.shape[2], k.shape[3]
    n_max = 0
    for b in range(B):
        n_max = max(n_max, starts[b] + T)
    n_pad = SPAN * ((n_max + SPAN - 1) // SPAN)  # whole spans: span_scores reads SPAN keys
    kt = np.empty((B, KVH, hd, n_pad), dtype=k.dtype)
    for i in prange(B * KVH):
        b = i // KVH
        kh = i - b * KVH
        for j in range(starts[b] + T):
            for d in range(hd):
                kt[b, kh, d, j] = k[b, j, kh, d]
        for d in range(hd):
            kt[b, kh, d, starts[b] + T:] = 0
    return kt


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _span_scores(qh, kt, j0, L, s):  # pragma: no cover - compiled
    """s[:L] = qh . k_j for the keys j0..j0+L-1 (kt: (hd, n) of one KV head), the keys in
    vector lanes, eight terms of each sum per pass."""
    hd = qh.shape[0]
    s[:L] = 0
    d8 = hd - hd % 8
    for d in range(0, d8, 8):
        k0, k1, k2, k3 = kt[d, j0:j0 + L], kt[d + 1, j0:j0 + L], kt[d + 2, j0:j0 + L], \
            kt[d + 3, j0:j0 + L]
        k4, k5, k6, k7 = kt[d + 4, j0:j0 + L], kt[d + 5, j0:j0 + L], kt[d + 6, j0:j0 + L], \
            kt[d + 7, j0:j0 + L]
        for jj in range(L):
            s[jj] += (qh[d] * k0[jj] + qh[d + 1] * k1[jj] + qh[d + 2] * k2[jj] + qh[d + 3] * k3[jj]
                      + qh[d + 4] * k4[jj] + qh[d + 5] * k5[jj] + qh[d + 6] * k6[jj]
                      + qh[d + 7] * k7[jj])
    for d in range(d8, hd):
        kr = kt[d, j0:j0 + L]
        for jj in range(L):
            s[jj] += qh[d] * kr[jj]


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _span_values(vs, kh, j0, L, sc, o):  # pragma: no cover - compiled
    """o[g] += sum_j sc[g, j] v_j for the G heads g of KV head kh (vs: (S, KVH, hd) the
    sequence's values), four keys per pass."""
    G, hd = sc.shape[0], vs.shape[2]
    L4 = L - L % 4
    for jj in range(0, L4, 4):
        v0, v1, v2, v3 = (vs[j0 + jj, kh], vs[j0 + jj + 1, kh], vs[j0 + jj + 2, kh],
                          vs[j0 + jj + 3, kh])
        for g in range(G):
            w0, w1, w2, w3 = sc[g, jj], sc[g, jj + 1], sc[g, jj + 2], sc[g, jj + 3]
            og = o[g * hd:(g + 1) * hd]
            for d in range(hd):
                og[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
    for jj in range(L4, L):
        vr = vs[j0 + jj, kh]
        for g in range(G):
            w = sc[g, jj]
            og = o[g * hd:(g + 1) * hd]
            for d in range(hd):
                og[d] += w * vr[d]


@njit(cache=True, nogil=True, inline="always")
def _addr(a, i, j, k, m=0):  # pragma: no cover - compiled
    """The byte address of a[i, j, k, m] (a 4-d array)."""
    s = a.strides
    return a.ctypes.data + i * s[0] + j * s[1] + k * s[2] + m * s[3]


@njit(cache=True, nogil=True, inline="always")
def _scores_vec(q, kt, b, t, kh, j0, sc):  # pragma: no cover - compiled
    """sc[g, :SPAN] = q[b, t, kh G + g] . k_j for the keys j0.. (kt: K transposed, padded) and
    the G heads of KV head kh, two heads per :func:`.span_ir.span_scores2` call."""
    G, hd = sc.shape[0], q.shape[3]
    pk, ldk = _addr(kt, b, kh, 0, j0), kt.strides[2]
    g = 0
    while g + 2 <= G:
        span_scores2(_addr(q, b, t, kh * G + g), q.strides[2], pk, ldk, hd, sc[g].ctypes.data,
                     sc.strides[0])
        g += 2
    if g < G:
        span_scores1(_addr(q, b, t, kh * G + g), q.strides[2], pk, ldk, hd, sc[g].ctypes.data,
                     sc.strides[0])


@njit(cache=True, nogil=True, inline="always")
def _values_vec(sc, v, b, j0, kh, L, o):  # pragma: no cover - compiled
    """o[g hd:(g + 1) hd] += sum_{j < L} sc[g, j] v[b, j0 + j, kh] for the G heads g of KV head
    kh by the kernels of :mod:`.span_ir` (o: G hd contiguous float32, hd a multiple of 16)."""
    G, hd = sc.shape[0], v.shape[3]
    pv, ldv, ldw, ldo = _addr(v, b, j0, kh), v.strides[1], sc.strides[0], 4 * hd
    for d in range(0, hd - hd % (4 * LANES), 4 * LANES):
        g = 0
        while g + 2 <= G:
            span_values4x2(sc[g].ctypes.data, ldw, pv + 4 * d, ldv, L,
                           o.ctypes.data + 4 * (g * hd + d), ldo)
            g += 2
        if g < G:
            span_values4(sc[g].ctypes.data, ldw, pv + 4 * d, ldv, L,
                         o.ctypes.data + 4 * (g * hd + d), ldo)
    for d in range(hd - hd % (4 * LANES), hd, LANES):
        for g in range(G):
            span_values1(sc[g].ctypes.data, ldw, pv + 4 * d, ldv, L,
                         o.ctypes.data + 4 * (g * hd + d), ldo)


#: query rows per tile of :func:`attend_rows`: the rows of a tile share each span's keys and
#: values while they are in L1
ROW_TILE = 16


@njit(cache=True, nogil=True, inline="always")
def _balanced(w, N):  # pragma: no cover - compiled
    """Item w of 0..N-1 in the order 0, N-1, 1, N-2, ...: the threads' runs of a parallel
    loop then each hold as many cheap (early, short causal rows) as dear (late) tiles."""
    return w // 2 if w % 2 == 0 else N - 1 - w // 2


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def attend_rows(q, k, v, starts, scale, out):  # pragma: no cover - compiled
    r"""Causal GQA attention of every query row on its own: row t of sequence b (position p =
    starts[b] + t) over the cache rows 0..p in spans of :data:`..decode.float_step.SPAN` rows from
    row 0, each span's (m, \ell, o) joined in order (:func:`..decode.float_step._join_spans`), so
    its output does not depend on the other rows, their count, the batch or the threads. The scores
    of a span are computed with the keys in vector lanes (K transposed once per call,
    :func:`_keys_by_d`): each score the same sums for every row, no horizontal sums; with float32
    and hd a multiple of 16 both products of a span are the vector kernels of :mod:`.span_ir`
    (each output one fused multiply-add chain, the accumulators in registers). The rows go
    by tiles of :data:`ROW_TILE` that share each span's keys and values (each row's sums as
    alone), the tiles spread over the threads by :func:`_balanced`. q: (B, T, H, hd); k, v:
    (B, S, KVH, hd); out: (B, T, H, hd)."""
    B, T, H, hd = q.shape
    KVH = k.shape[2]
    G = H // KVH
    kt = _keys_by_d(k, starts, T)
    # float32 q, k, v in whole vectors: the IR products (which read float32 by address)
    vec = hd % LANES == 0 and q.itemsize == 4 and k.itemsize == 4 and v.itemsize == 4
    nt = (T + ROW_TILE - 1) // ROW_TILE  # tiles per sequence
    for w in prange(B * nt):
        i = _balanced(w, B * nt)
        b = i // nt
        t0 = (i - b * nt) * ROW_TILE
        R = min(T, t0 + ROW_TILE) - t0
        P = _spans(starts[b] + t0 + R)  # the spans of the tile's last row
        sc = np.empty((G, SPAN), dtype=q.dtype)
        ml = np.empty((R, P, H, 2), dtype=q.dtype)
        parts = np.zeros((R, P, H * hd), dtype=q.dtype)
        for u in range(P):
            j0 = u * SPAN
            for kh in range(KVH):  # the G query heads of KV head kh share each key and value
                for r in range(R):
                    n = starts[b] + t0 + r + 1
                    if j0 < n:  # span u is one of row r's
                        L = min(n, j0 + SPAN) - j0
                        o = parts[r, u, kh * G * hd:(kh + 1) * G * hd]
                        if vec:
                            _scores_vec(q, kt, b, t0 + r, kh, j0, sc)
                        for g in range(G):
                            if not vec:
                                _span_scores(q[b, t0 + r, kh * G + g], kt[b, kh], j0, L, sc[g])
                            _span_softmax(sc[g], L, scale, ml[r, u, kh * G + g])
                        if vec:
                            _values_vec(sc, v, b, j0, kh, L, o)
                        else:
                            _span_values(v[b], kh, j0, L, sc, o)
        for r in range(R):
            Pr = _spans(starts[b] + t0 + r + 1)
            _join_spans(ml[r, :Pr], parts[r, :Pr], out[b, t0 + r].reshape(H * hd))
