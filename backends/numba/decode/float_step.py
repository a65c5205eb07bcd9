r"""A fused Numba decode step: one compiled call runs a whole KV-cached decode step of the model.

Decoding one token per sequence (B small, T = 1) is a chain of matrix-vector products whose time
is that of streaming every weight once; with one NumPy/BLAS call per op the Python and dispatch
work between the products (dozens of calls per layer) costs as much as the products on a small
model. :func:`decode_step` (several sequences) and :func:`decode_step_one` (one) do all of it in
one call, per layer

1. RMSNorm of the residual, then the products by W_q, W_k, W_v, whose output rows are taken in
   whole RoPE pairs (2i, 2i+1): each pair is rotated as soon as it is computed and the rotated
   k and v go straight into the KV cache at the sequence's position;
2. attention of each sequence over its cache rows 0..p_b (:func:`_attend`: scores, softmax and
   the weighted sum of V, each cache row read once for all heads of a chunk of KV heads);
3. the product by W_o with the residual add in place;
4. RMSNorm, then the products by W_1 and W_3 with SiLU(a) * b applied per output row;
5. the product by W_2 with the residual add in place,

then the final RMSNorm and the classifier rows. Every product spreads its output rows over the
Numba threads (``prange``) and reads W once, in memory order, for all B sequences. In
:func:`decode_step` one W row at a time feeds groups of 8 sequences (:func:`_row`: eight running
sums) when their x rows fit in L1 (:data:`ROW_X_BYTES`), else tiles of 4 W rows x 2 sequences
(:func:`_tile`), and always by tiles for a model small enough to stay in cache
(:data:`CACHED_WEIGHT_BYTES`: compute-bound); :func:`decode_step_one` takes one row at a
time for its one sequence (bound by streaming W).
The weights are the model's own arrays (no copy), passed as typed lists over the layers (whose
type does not depend on L, so one compilation per dtype serves every depth), so a decode step
is one dispatch with no Python work per op. Given an ``ids`` buffer of n columns, both kernels
run n greedy steps in that one call (the argmax of each step's logits is the next token, found
per thread on its span of the classifier rows by :func:`_argmax_finite`), so greedy generation
returns to Python once per n tokens. Equations: those of :mod:`minillama.core.ops`
(rmsnorm, linear, rope, attention, swiglu), held to them by
``tests/backends/numba/decode/test_float_step.py``.

Imported only by the numba backend (importing it imports Numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..floats.fastmath import fexp

#: output rows of W per tile of :func:`_tile` and per parallel iteration of :func:`decode_step`
#: (even: a tile holds whole RoPE pairs)
TILE = 4
#: cache rows per span of the decode steps' attention (:func:`_attend_span`): the spans of a
#: sequence at position p are rows [0, SPAN), [SPAN, 2 SPAN), ... whatever the thread count, so
#: the order of its sums, and its logits, do not depend on how many threads share the spans
SPAN = 64

#: :func:`decode_step` takes a product with K inputs row by row (:func:`_row`) when the B rows
#: of x it multiplies, B * K * itemsize bytes, fit in this much of L1, with at least 4 sequences;
#: otherwise by tiles (:func:`_tile`). Measured on s15/s110 shapes at B = 8: rows 1.2-1.75x
#: faster for K <= 768 (x 24 KiB), tiles 1.1-1.3x faster for K = 2048 (x 64 KiB, read from L2).
ROW_X_BYTES = 24 * 1024

#: a model whose weights take at most this many bytes stays in the CPU caches from one decode
#: step to the next, so its products are bound by the multiply-adds rather than by streaming W,
#: and :func:`decode_step` takes them by tiles (:func:`_tile`: fewer loads per multiply-add)
#: whatever the batch. Measured on the shipped model (6.4 MB of float32 weights, 2 MiB L2,
#: 32 MiB L3) at B = 16: tiles 1.25-1.4x faster than rows on every product.
CACHED_WEIGHT_BYTES = 16 * 1024 * 1024


@njit(fastmath=True, cache=True, nogil=True)
def _rmsnorm_rows(x, g, eps, out):  # pragma: no cover - compiled
    """out_b = x_b / sqrt(mean(x_b^2) + eps) * g for every row b of x (B, D)."""
    B, D = x.shape
    for b in range(B):
        ss = 0.0
        for k in range(D):
            ss += np.float64(x[b, k]) * x[b, k]
        r = 1.0 / np.sqrt(ss / D + eps)
        for k in range(D):
            out[b, k] = x[b, k] * r * g[k]


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _tile(x, W, i0, nr, y, c0, zero):  # pragma: no cover - compiled
    """y[b, c0 + r] = x_b . W_{i0 + r} for r < nr <= TILE rows of W and every row b of x (B, K).

    With several sequences the rows are taken four of W by two of x at a time: eight running
    sums, each loaded W and x vector feeding two and four of them, so the loop is bound by the
    multiply-adds rather than by the loads. One sequence (or what is left) takes one dot product
    at a time, W row after W row in memory order (the product is then memory-bound)."""
    B, K = x.shape
    b = 0
    if nr == TILE:
        w0 = W[i0]
        w1 = W[i0 + 1]
        w2 = W[i0 + 2]
        w3 = W[i0 + 3]
        while b + 1 < B:
            x0 = x[b]
            x1 = x[b + 1]
            s00 = zero
            s01 = zero
            s02 = zero
            s03 = zero
            s10 = zero
            s11 = zero
            s12 = zero
            s13 = zero
            for k in range(K):
                u = x0[k]
                v = x1[k]
                s00 += u * w0[k]
                s01 += u * w1[k]
                s02 += u * w2[k]
                s03 += u * w3[k]
                s10 += v * w0[k]
                s11 += v * w1[k]
                s12 += v * w2[k]
                s13 += v * w3[k]
            y[b, c0] = s00
            y[b, c0 + 1] = s01
            y[b, c0 + 2] = s02
            y[b, c0 + 3] = s03
            y[b + 1, c0] = s10
            y[b + 1, c0 + 1] = s11
            y[b + 1, c0 + 2] = s12
            y[b + 1, c0 + 3] = s13
            b += 2
    for bb in range(b, B):
        xb = x[bb]
        for r in range(nr):
            w = W[i0 + r]
            s = zero
            for k in range(K):
                s += xb[k] * w[k]
            y[bb, c0 + r] = s


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _row(x, W, i, y, c, zero):  # pragma: no cover - compiled
    """y[b, c] = x_b . W_i for every row b of x (B, K): row i of W (K,) is read once from memory
    for all B sequences.

    The sequences go by groups of eight (then four, then one at a time): each loaded element of
    W feeds eight running sums, one per sequence, whose x rows stay in L1. W is read strictly in
    memory order, one row after the other, so the hardware prefetcher streams it while the
    multiply-adds run (measured 1.3-1.75x faster at B = 8 than tiles of 4 W rows x 2 sequences,
    whose bursts of four rows at once it did not hide)."""
    B, K = x.shape
    w = W[i]
    b = 0
    while b + 8 <= B:
        x0 = x[b]
        x1 = x[b + 1]
        x2 = x[b + 2]
        x3 = x[b + 3]
        x4 = x[b + 4]
        x5 = x[b + 5]
        x6 = x[b + 6]
        x7 = x[b + 7]
        s0 = zero
        s1 = zero
        s2 = zero
        s3 = zero
        s4 = zero
        s5 = zero
        s6 = zero
        s7 = zero
        for k in range(K):
            v = w[k]
            s0 += v * x0[k]
            s1 += v * x1[k]
            s2 += v * x2[k]
            s3 += v * x3[k]
            s4 += v * x4[k]
            s5 += v * x5[k]
            s6 += v * x6[k]
            s7 += v * x7[k]
        y[b, c] = s0
        y[b + 1, c] = s1
        y[b + 2, c] = s2
        y[b + 3, c] = s3
        y[b + 4, c] = s4
        y[b + 5, c] = s5
        y[b + 6, c] = s6
        y[b + 7, c] = s7
        b += 8
    if b + 4 <= B:
        x0 = x[b]
        x1 = x[b + 1]
        x2 = x[b + 2]
        x3 = x[b + 3]
        s0 = zero
        s1 = zero
        s2 = zero
        s3 = zero
        for k in range(K):
            v = w[k]
            s0 += v * x0[k]
            s1 += v * x1[k]
            s2 += v * x2[k]
            s3 += v * x3[k]
        y[b, c] = s0
        y[b + 1, c] = s1
        y[b + 2, c] = s2
        y[b + 3, c] = s3
        b += 4
    for bb in range(b, B):
        xb = x[bb]
        s = zero
        for k in range(K):
            s += xb[k] * w[k]
        y[bb, c] = s


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _rows(x, W, i0, nr, y, c0, tiled, zero):  # pragma: no cover - compiled
    """y[b, c0 + r] = x_b . W_{i0 + r} for r < nr <= TILE rows of W and every row b of x (B, K),
    by :func:`_tile` when ``tiled``, else row after row by :func:`_row`."""
    if tiled:
        _tile(x, W, i0, nr, y, c0, zero)
    else:
        for r in range(nr):
            _row(x, W, i0 + r, y, c0 + r, zero)


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _attend(qkv, Kc, Vc, b, k0, k1, G, n, scale, sc, att):  # pragma: no cover - compiled
    """att_h = softmax(q_h K_{0..n-1}^T * scale) V_{0..n-1} for the query heads h of KV heads
    k0..k1-1 of sequence b (h = kh * G + g; q_h is qkv[b, h*hd : (h+1)*hd]). The cache is read
    row by row in memory order (row j holds the KV heads side by side), each K and V row once
    for all G heads of its group. sc: (B*H, >= n) scores scratch, rows b*H + h used."""
    hd = Kc.shape[3]
    H = att.shape[1] // hd
    h0 = k0 * G
    h1 = k1 * G
    for j in range(n):
        for kh in range(k0, k1):
            kr = Kc[b, j, kh]
            for h in range(kh * G, (kh + 1) * G):
                qv = qkv[b, h * hd:(h + 1) * hd]
                s = att.dtype.type(0)
                for d in range(hd):
                    s += qv[d] * kr[d]
                sc[b * H + h, j] = s * scale
    for h in range(h0, h1):
        row = sc[b * H + h]
        m = att.dtype.type(-np.inf)  # in the scores' dtype: float32 e^x widens (fexp)
        for j in range(n):
            m = max(m, row[j])
        tot = 0.0
        for j in range(n):
            e = fexp(row[j] - m)
            row[j] = e
            tot += e
        inv = 1.0 / tot
        for j in range(n):
            row[j] *= inv
        att[b, h * hd:(h + 1) * hd] = 0
    for j in range(n):
        for kh in range(k0, k1):
            vr = Vc[b, j, kh]
            for h in range(kh * G, (kh + 1) * G):
                w = sc[b * H + h, j]
                o = att[b, h * hd:(h + 1) * hd]
                for d in range(hd):
                    o[d] += w * vr[d]


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _attend_span(q, Kc, Vc, j0, j1, G, scale, sc, ml, o):  # pragma: no cover - compiled
    """The part of one sequence's attention that cache rows j0..j1-1 give (a span of the
    positions; the spans are joined by :func:`_join_spans`), for every query head h:
    s_j = q_h . k_j * scale, m_h = max_j s_j, l_h = sum_j e^{s_j - m_h},
    o_h = sum_j e^{s_j - m_h} v_j. q: (H*hd,); Kc, Vc: (S_max, KVH, hd) the sequence's cache;
    sc: (H, >= j1 - j0) scores scratch; ml: (H, 2) gets m_h, l_h; o: (H*hd,) gets o_h.
    The rows are read in memory order, each once for all heads; each head's part of q and o is
    a slice (an index computed as h hd + d would need a wraparound test per element, which
    keeps the loops over hd from widening); the maximum and e^x stay in the cache's dtype
    (float32: :func:`..floats.fastmath.fexp`, which the compiler widens)."""
    KVH, hd = Kc.shape[1], Kc.shape[2]
    H = KVH * G
    for j in range(j0, j1):
        for kh in range(KVH):
            kr = Kc[j, kh]
            for h in range(kh * G, (kh + 1) * G):
                qh = q[h * hd:(h + 1) * hd]  # a slice: its loop index needs no wraparound
                s = o.dtype.type(0)
                for d in range(hd):
                    s += qh[d] * kr[d]
                sc[h, j - j0] = s * scale
    o[:] = 0
    for h in range(H):
        srow = sc[h]
        m = o.dtype.type(-np.inf)
        for j in range(j1 - j0):
            m = max(m, srow[j])
        tot = 0.0
        for j in range(j1 - j0):
            e = fexp(srow[j] - m)
            srow[j] = e
            tot += e
        ml[h, 0] = m
        ml[h, 1] = tot
    for j in range(j0, j1):
        for kh in range(KVH):
            vr = Vc[j, kh]
            for h in range(kh * G, (kh + 1) * G):
                w = sc[h, j - j0]
                oh = o[h * hd:(h + 1) * hd]
                for d in range(hd):
                    oh[d] += w * vr[d]


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _rope_store(r, a, c, d0, p, qd, kvd, hd, cos, sin, qkv, Kc, Vc):  # pragma: no cover
    """Rows r, r + 1 of the fused q|k|v product of one token at position p, (a, c): rotated by
    RoPE (q and k rows) as the pair (d0, d0 + 1) of their head, then written to q or to the
    K / V cache."""
    if r < qd + kvd:
        cs = cos[p, d0 // 2]
        sn = sin[p, d0 // 2]
        a, c = a * cs - c * sn, a * sn + c * cs
    if r < qd:
        qkv[0, r] = a
        qkv[0, r + 1] = c
    elif r < qd + kvd:
        Kc[0, p, (r - qd) // hd, d0] = a
        Kc[0, p, (r - qd) // hd, d0 + 1] = c
    else:
        Vc[0, p, (r - qd - kvd) // hd, d0] = a
        Vc[0, p, (r - qd - kvd) // hd, d0 + 1] = c


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _join_spans(ml, o, out):  # pragma: no cover - compiled
    """out_h = sum_u e^{m_uh - M_h} o_uh / sum_u e^{m_uh - M_h} l_uh, M_h = max_u m_uh: the
    softmax-weighted sum over all positions from the P spans' (m, l, o) of
    :func:`_attend_span`. ml: (P, H, 2); o: (P, H*hd); out: (H*hd,)."""
    P, H = ml.shape[0], ml.shape[1]
    hd = o.shape[1] // H
    for h in range(H):
        M = -np.inf
        for u in range(P):
            M = max(M, ml[u, h, 0])
        tot = 0.0
        for u in range(P):
            if ml[u, h, 1] > 0:
                tot += np.exp(ml[u, h, 0] - M) * ml[u, h, 1]
        for d in range(hd):
            out[h * hd + d] = 0
        for u in range(P):
            if ml[u, h, 1] > 0:
                w = np.exp(ml[u, h, 0] - M) / tot
                for d in range(hd):
                    out[h * hd + d] += w * o[u, h * hd + d]


@njit(cache=True, nogil=True, inline='always')
def _spans(n):  # pragma: no cover - compiled
    """How many spans of :data:`SPAN` rows cover n cache rows."""
    return max(1, (n + SPAN - 1) // SPAN)


@njit(cache=True, nogil=True, inline='always')
def _sizes(emb, wq, wk, w1, kc, n_heads):  # pragma: no cover - compiled
    """V, D, L, H, q width H*hd, kv width KVH*hd, hd, KVH, G = H/KVH, F and the cache length S
    of a decode step's arguments."""
    V, D = emb.shape
    qd = wq[0].shape[0]
    kvd = wk[0].shape[0]
    hd = qd // n_heads
    return (V, D, len(wq), n_heads, qd, kvd, hd, kvd // hd, n_heads // (kvd // hd),
            w1[0].shape[0], kc[0].shape[1])


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_step(tok, pos, emb, wout, g_final, g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3,
                kc, vc, cos, sin, eps, n_heads, zero, logits, threads, stop,
                ids):  # pragma: no cover - compiled
    r"""One decode step for B sequences, each feeding one token at its own position; with
    ``ids`` of shape (B, n), n > 0, n greedy steps in one call.

    tok, pos: (B,) int64 (token id and absolute position p_b of each sequence);
    emb: (V, D) embedding; wout: (V, D) classifier; g_final (D,); per-layer lists (length L)
    g_att, g_ffn (D,), wq (H*hd, D), wk, wv (KVH*hd, D), wo (D, H*hd), w1, w3 (F, D), w2 (D, F);
    kc, vc: lists of the layers' caches (B, S_max, KVH, hd), written at p_b;
    cos, sin: (S, hd/2) RoPE tables; zero: 0 in the compute dtype (the accumulators' type);
    logits: (B, V) output, filled in; threads: the number of Numba threads (parallel parts);
    stop: unused here (the caller applies each sequence's stop rule; the signature is that of
    :func:`decode_step_one`); ids: (B, n) int64.

    Greedy (n > 0): after each step every sequence's next token is the argmax of its logits
    (the first maximum) and is fed at its next position, capped at the cache's last slot; all
    B sequences run the n steps (the caller drops what follows a sequence's end). A row of
    logits holding NaN/inf gets -1 and ends the call after that step. Returns the number of
    steps run (1 for the single step, ``ids`` empty).
    """
    B = tok.shape[0]
    V, D, L, H, qd, kvd, hd, KVH, G, F, S = _sizes(emb, wq, wk, w1, kc, n_heads)
    dt = emb.dtype
    x = np.empty((B, D), dtype=dt)
    xn = np.empty((B, D), dtype=dt)
    qkv = np.empty((B, qd + 2 * kvd), dtype=dt)
    att = np.empty((B, qd), dtype=dt)
    yd = np.empty((B, D), dtype=dt)
    h1 = np.empty((B, F), dtype=dt)
    h3 = np.empty((B, F), dtype=dt)
    scores = np.empty((B * H, S), dtype=dt)
    scale = dt.type(1.0 / np.sqrt(hd))
    nq = (qd + TILE - 1) // TILE  # tiles of W_q, then of W_k and of W_v
    nkv = (kvd + TILE - 1) // TILE
    nd = (D + TILE - 1) // TILE
    nf = (F + TILE - 1) // TILE
    C = min(KVH, max(1, 4 // B))  # KV-head chunks per sequence in attention
    # by tiles or row by row, for the products with K = D, H*hd and F inputs
    isz = x.itemsize
    cached = (L * (2 * qd + 2 * kvd + 3 * F) + V) * D * isz <= CACHED_WEIGHT_BYTES
    tile_d = B < 4 or cached or B * D * isz > ROW_X_BYTES
    tile_q = B < 4 or cached or B * qd * isz > ROW_X_BYTES
    tile_f = B < 4 or cached or B * F * isz > ROW_X_BYTES
    n_steps = max(1, ids.shape[1])
    ps = pos.copy()  # each sequence's position in the current step
    cur = tok.copy()  # and the token it feeds
    best = np.empty((threads, B), dtype=np.int64)
    finite = np.empty((threads, B), dtype=np.bool_)
    for step in range(n_steps):
        for b in range(B):
            ps[b] = min(pos[b] + step, S - 1)
            x[b, :] = emb[cur[b]]
        for layer in range(L):
            Wo = wo[layer]
            W1 = w1[layer]
            W2 = w2[layer]
            W3 = w3[layer]
            Kc = kc[layer]
            Vc = vc[layer]
            _rmsnorm_rows(x, g_att[layer], eps, xn)
            # q, k, v by tiles of rows (whole RoPE pairs); RoPE on q and k; k, v into the cache
            for t in prange(nq + 2 * nkv):
                if t < nq:
                    W = wq[layer]
                    i0 = t * TILE
                    rows = qd
                    c0 = i0
                elif t < nq + nkv:
                    W = wk[layer]
                    i0 = (t - nq) * TILE
                    rows = kvd
                    c0 = qd + i0
                else:
                    W = wv[layer]
                    i0 = (t - nq - nkv) * TILE
                    rows = kvd
                    c0 = qd + kvd + i0
                nr = min(TILE, rows - i0)
                _rows(xn, W, i0, nr, qkv, c0, tile_d, zero)
                for b in range(B):
                    p = ps[b]
                    for r in range(0, nr, 2):
                        rr = i0 + r
                        head = rr // hd
                        d0 = rr - head * hd
                        y0 = qkv[b, c0 + r]
                        y1 = qkv[b, c0 + r + 1]
                        if t < nq + nkv:  # rotate the pair by the angle of position p
                            c = cos[p, d0 // 2]
                            s = sin[p, d0 // 2]
                            y0, y1 = y0 * c - y1 * s, y0 * s + y1 * c
                            if t < nq:  # q stays in qkv, rotated in place
                                qkv[b, c0 + r] = y0
                                qkv[b, c0 + r + 1] = y1
                            else:
                                Kc[b, p, head, d0] = y0
                                Kc[b, p, head, d0 + 1] = y1
                        else:
                            Vc[b, p, head, d0] = y0
                            Vc[b, p, head, d0 + 1] = y1
            # attention of each sequence over its cache rows 0..p_b, the KV heads cut into C chunks
            # (several chunks per sequence when there are few sequences, so both threads work)
            for u in prange(B * C):
                b = u // C
                c = u - b * C
                _attend(qkv, Kc, Vc, b, c * KVH // C, (c + 1) * KVH // C, G, ps[b] + 1, scale,
                        scores, att)
            # x += att W_o^T
            for t in prange(nd):
                i0 = t * TILE
                nr = min(TILE, D - i0)
                _rows(att, Wo, i0, nr, yd, i0, tile_q, zero)
                for b in range(B):
                    for r in range(nr):
                        x[b, i0 + r] += yd[b, i0 + r]
            # SwiGLU: h1 = silu(xn W_1^T) * (xn W_3^T)
            _rmsnorm_rows(x, g_ffn[layer], eps, xn)
            for t in prange(nf):
                i0 = t * TILE
                nr = min(TILE, F - i0)
                _rows(xn, W1, i0, nr, h1, i0, tile_d, zero)
                _rows(xn, W3, i0, nr, h3, i0, tile_d, zero)
                for b in range(B):
                    for r in range(nr):
                        a = h1[b, i0 + r]
                        h1[b, i0 + r] = a / (1.0 + np.exp(-a)) * h3[b, i0 + r]
            # x += h1 W_2^T
            for t in prange(nd):
                i0 = t * TILE
                nr = min(TILE, D - i0)
                _rows(h1, W2, i0, nr, yd, i0, tile_f, zero)
                for b in range(B):
                    for r in range(nr):
                        x[b, i0 + r] += yd[b, i0 + r]
        _rmsnorm_rows(x, g_final, eps, xn)
        if ids.shape[1] == 0:
            for t in prange((V + TILE - 1) // TILE):
                i0 = t * TILE
                _rows(xn, wout, i0, min(TILE, V - i0), logits, i0, tile_d, zero)
            return 1
        # the classifier in one span of tiles per thread, then each span's argmax per sequence
        # while its logits are in cache
        nt = (V + TILE - 1) // TILE
        for u in prange(threads):
            for t in range(u * nt // threads, (u + 1) * nt // threads):
                i0 = t * TILE
                _rows(xn, wout, i0, min(TILE, V - i0), logits, i0, tile_d, zero)
            lo = min(V, u * nt // threads * TILE)
            hi = min(V, (u + 1) * nt // threads * TILE)
            for b in range(B):
                best[u, b] = -1
                finite[u, b] = True
                if hi > lo:
                    best[u, b], finite[u, b] = _argmax_finite(logits[b], lo, hi)
        bad = False
        for b in range(B):
            t = -1
            ok = True
            for u in range(threads):
                if not finite[u, b]:
                    ok = False
                elif best[u, b] >= 0 and (t < 0 or logits[b, best[u, b]] > logits[b, t]):
                    t = best[u, b]
            ids[b, step] = t if ok else -1
            cur[b] = t if ok else 0
            bad = bad or not ok
        if bad:
            return step + 1
    return n_steps


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _dot(x, W, i, zero):  # pragma: no cover - compiled
    """x_0 . W_i for the single row of x (1, K) and row i of W (N, K)."""
    s = zero
    for k in range(x.shape[1]):
        s += x[0, k] * W[i, k]
    return s


@njit(cache=True, nogil=True)
def _argmax_finite(z, lo, hi):  # pragma: no cover - compiled
    """(i, ok): the first i in lo..hi-1 with z_i = max z[lo:hi], and whether every z_i there
    is finite. z: (V,) contiguous float32/float64. Finiteness is read from the bits (exponent
    all ones: inf or NaN), which the fastmath code this is inlined into cannot assume away."""
    ok = True
    if z.itemsize == 4:
        b32 = z.view(np.uint32)
        m32 = np.uint32(0x7F800000)
        for v in range(lo, hi):
            if b32[v] & m32 == m32:
                ok = False
    else:
        b64 = z.view(np.uint64)
        m64 = np.uint64(0x7FF0000000000000)
        for v in range(lo, hi):
            if b64[v] & m64 == m64:
                ok = False
    best = lo
    if ok:
        for v in range(lo, hi):
            if z[v] > z[best]:
                best = v
    return best, ok


@njit(cache=True, nogil=True, inline='always')
def _pick(z, best, finite, stop, ids, step):  # pragma: no cover - compiled
    """The greedy token of a step from each thread's (best[u], finite[u]) over its run of z:
    the first maximum, written to ids[step] (-1 when some logit is not finite). Returns
    (t, whether decoding ends here: a non-finite logit or t in ``stop``)."""
    t = best[0]
    for u in range(best.shape[0]):
        if not finite[u]:
            ids[step] = -1
            return t, True
        if z[best[u]] > z[t]:
            t = best[u]
    ids[step] = t
    for s in stop:
        if t == s:
            return t, True
    return t, False


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_step_one(tok, pos, emb, wout, g_final, g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3,
                    kc, vc, cos, sin, eps, n_heads, zero, logits, threads, stop,
                    ids):  # pragma: no cover - compiled
    r""":func:`decode_step` for one sequence (B = 1), the same arguments and the same step;
    with ``ids`` of length n > 0, n greedy steps in one call.

    stop: (n_stop,) int64 stop ids; ids: (n,) int64. Greedy: after each step the next token is
    t = argmax_v z_v of its logits (the first maximum) and is fed at the next position, so one
    call decodes up to n tokens into ``ids`` with no Python work between them; it ends early
    after a token in ``stop`` (written) or at logits holding NaN/inf (-1 written). Returns how
    many entries of ``ids`` it wrote (1 for the single step, ``ids`` empty); ``logits`` holds
    the last step's.

    With one sequence every product is a plain matrix-vector product bound by streaming W:
    here each parallel loop walks one matrix (W_q, W_k, W_v stacked) one output row (or RoPE
    pair) per iteration, so each thread reads one run of consecutive rows, which keeps the
    hardware prefetchers streaming (measured faster at B = 1 than the tiles of
    :func:`decode_step`, which pay off from two sequences on)."""
    V, D, L, H, qd, kvd, hd, KVH, G, F, S = _sizes(emb, wq, wk, w1, kc, n_heads)
    dt = emb.dtype
    n_steps = max(1, ids.shape[0])
    t = tok[0]
    x = np.empty((1, D), dtype=dt)
    xn = np.empty((1, D), dtype=dt)
    qkv = np.empty((1, qd), dtype=dt)
    att = np.empty((1, qd), dtype=dt)
    h = np.empty((1, F), dtype=dt)
    n_max = pos[0] + n_steps  # cache rows attended to at the last step
    scores = np.empty((_spans(n_max), H, SPAN), dtype=dt)
    ml = np.empty((_spans(n_max), H, 2), dtype=dt)
    parts = np.empty((_spans(n_max), qd), dtype=dt)
    best = np.empty(threads, dtype=np.int64)
    finite = np.empty(threads, dtype=np.bool_)
    scale = dt.type(1.0 / np.sqrt(hd))
    for step in range(n_steps):
        p = pos[0] + step
        n = p + 1  # cache rows attended to
        P = _spans(n)  # spans of SPAN cache rows in attention
        x[0, :] = emb[t]
        for layer in range(L):
            Wq = wq[layer]
            Wk = wk[layer]
            Wv = wv[layer]
            Wo = wo[layer]
            W1 = w1[layer]
            W2 = w2[layer]
            W3 = w3[layer]
            Kc = kc[layer]
            Vc = vc[layer]
            _rmsnorm_rows(x, g_att[layer], eps, xn)
            # q, k, v by RoPE pairs of rows of W_q, W_k, W_v stacked: q and k rotated as computed,
            # k and v into the cache
            for i in prange((qd + 2 * kvd) // 2):
                r = 2 * i
                if r < qd:
                    a = _dot(xn, Wq, r, zero)
                    c = _dot(xn, Wq, r + 1, zero)
                    d0 = r % hd
                elif r < qd + kvd:
                    a = _dot(xn, Wk, r - qd, zero)
                    c = _dot(xn, Wk, r - qd + 1, zero)
                    d0 = (r - qd) % hd
                else:
                    a = _dot(xn, Wv, r - qd - kvd, zero)
                    c = _dot(xn, Wv, r - qd - kvd + 1, zero)
                    d0 = (r - qd - kvd) % hd
                _rope_store(r, a, c, d0, p, qd, kvd, hd, cos, sin, qkv, Kc, Vc)
            # attention over cache rows 0..p in P spans of SPAN consecutive rows (each thread
            # streams its own spans of the cache), then the spans joined in order
            for u in prange(P):
                _attend_span(qkv[0], Kc[0], Vc[0], u * SPAN, min(n, (u + 1) * SPAN), G, scale,
                             scores[u], ml[u], parts[u])
            _join_spans(ml[:P], parts[:P], att[0])
            for i in prange(D):
                x[0, i] += _dot(att, Wo, i, zero)
            _rmsnorm_rows(x, g_ffn[layer], eps, xn)
            for i in prange(F):
                a = _dot(xn, W1, i, zero)
                h[0, i] = a / (1.0 + np.exp(-a)) * _dot(xn, W3, i, zero)
            for i in prange(D):
                x[0, i] += _dot(h, W2, i, zero)
        _rmsnorm_rows(x, g_final, eps, xn)
        if ids.shape[0] == 0:
            for v in prange(V):
                logits[0, v] = _dot(xn, wout, v, zero)
            return 1
        # the classifier in one span of rows per thread, each span's argmax while in cache
        for u in prange(threads):
            lo = u * V // threads
            hi = (u + 1) * V // threads
            for v in range(lo, hi):
                logits[0, v] = _dot(xn, wout, v, zero)
            best[u], finite[u] = _argmax_finite(logits[0], lo, hi)
        t, done = _pick(logits[0], best, finite, stop, ids, step)
        if done:
            return step + 1
    return n_steps
