r"""A fused Numba decode step: one compiled call runs a whole KV-cached decode step of the model.

Decoding one token per sequence (B small, T = 1) is a chain of matrix-vector products whose time
is that of streaming every weight once; with one NumPy/BLAS call per op the Python and dispatch
work between the products (dozens of calls per layer) costs as much as the products on a small
model. :func:`decode_step` (several sequences) and :func:`decode_step_one` (one) do all of it in
one call, per layer

1. RMSNorm of the residual, then the products by W_q, W_k, W_v, whose output rows are taken in
   whole RoPE pairs (2i, 2i+1): each pair is rotated as soon as it is computed and the rotated
   k and v go straight into the KV cache at the sequence's position;
2. attention of each sequence over its cache rows 0..p_b (:func:`_attend_span`: scores, softmax
   and the weighted sum of V over a span of rows, each cache row read once for all heads);
3. the product by W_o with the residual add in place;
4. RMSNorm, then the products by W_1 and W_3 with SiLU(a) * b applied per output row;
5. the product by W_2 with the residual add in place,

then the final RMSNorm and the classifier rows. Every product output is one dot product of
a row of W with an activation row (:func:`_dot`), every attention a sum over spans of
:data:`SPAN` cache rows joined in order, so a sequence's logits do not depend on the thread
count nor, in :func:`decode_step`, on the sequences batched with it: that kernel runs each
row's operations in :func:`decode_step_one`'s order and shares only the reads of W (the
threads take runs of consecutive rows of W, by pairs or blocks dotted with the B activation
rows while in L1). The price of that order: a dot product per output and sequence loads W
from L1 for each sequence, where tiles of several rows and sequences shared each load (a step
of 16 sequences of SmolLM2's shape in float32 0.7x as fast as with the tiles,
docs/BENCHMARKS.md).
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
from numba import njit, prange, types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..floats.fastmath import IN_ORDER, fexp
from ..floats.half import kv_read, kv_write
from ..floats.rope import rotate_pair
from ..floats.span_ir import (
    LANES,
    SPAN,
    cache_scores1,
    cache_scores1h,
    cache_scores2,
    cache_scores2h,
    span_values1,
    span_values1h,
    span_values4,
    span_values4h,
    span_values4x2,
    span_values4x2h,
)


@njit(fastmath=IN_ORDER, cache=True, nogil=True)
def _rmsnorm_rows(x, g, eps, out):  # pragma: no cover - compiled
    """out_b = x_b / sqrt(mean(x_b^2) + eps) * g for every row b of x (B, D): the sum of
    squares in float64 by four partial sums over k mod 4, joined as (s_0 + s_1) + (s_2 + s_3)."""
    B, D = x.shape
    D4 = D - D % 4
    for b in range(B):
        s0 = s1 = s2 = s3 = 0.0
        for k in range(0, D4, 4):
            s0 += np.float64(x[b, k]) * x[b, k]
            s1 += np.float64(x[b, k + 1]) * x[b, k + 1]
            s2 += np.float64(x[b, k + 2]) * x[b, k + 2]
            s3 += np.float64(x[b, k + 3]) * x[b, k + 3]
        for k in range(D4, D):
            s0 += np.float64(x[b, k]) * x[b, k]
        ss = (s0 + s1) + (s2 + s3)
        r = 1.0 / np.sqrt(ss / D + eps)
        for k in range(D):
            out[b, k] = x[b, k] * r * g[k]


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
    (float32: :func:`..floats.fastmath.fexp`, which the compiler widens). A float32 q on a
    float32 or half cache with hd a multiple of 16 takes :func:`_attend_span_ir`, the prompt
    rows' sums in their order."""
    KVH, hd = Kc.shape[1], Kc.shape[2]
    H = KVH * G
    if _span_kernels(q, Kc) and hd % LANES == 0:  # the prompt rows' order
        _attend_span_ir(q, Kc, Vc, j0, j1, G, scale, sc, ml, o)
        return
    for j in range(j0, j1):
        for kh in range(KVH):
            kr = Kc[j, kh]
            for h in range(kh * G, (kh + 1) * G):
                qh = q[h * hd:(h + 1) * hd]  # a slice: its loop index needs no wraparound
                s = o.dtype.type(0)
                for d in range(hd):
                    s += qh[d] * kv_read(kr[d])
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
                    oh[d] += w * kv_read(vr[d])


def _span_kernels(q, Kc):
    """Whether the vector kernels of :mod:`..floats.span_ir` read q and the cache Kc: a float32
    q, a float32 or half (uint16) cache."""
    return False


@overload(_span_kernels, inline="always")
def _span_kernels_overload(q, Kc):
    ok = q.dtype == types.float32 and Kc.dtype in (types.float32, types.uint16)
    return lambda q, Kc: ok


def _scores(Kc, pq, ldq, nh, pk, ldk, hd, ps, lds, nk):
    """:func:`..floats.span_ir.cache_scores1` (nh 1) or ``2`` on a float32 cache Kc, the ``h``
    kernels on a half one."""


@overload(_scores, inline="always")
def _scores_overload(Kc, pq, ldq, nh, pk, ldk, hd, ps, lds, nk):
    one, two = (cache_scores1h, cache_scores2h) if Kc.dtype == types.uint16 else \
        (cache_scores1, cache_scores2)

    def impl(Kc, pq, ldq, nh, pk, ldk, hd, ps, lds, nk):  # pragma: no cover - compiled
        if nh == 2:
            two(pq, ldq, pk, ldk, hd, ps, lds, nk)
        else:
            one(pq, ldq, pk, ldk, hd, ps, lds, nk)
    return impl


def _values(Vc, nh, d64, pw, ldw, pv, ldv, L, po, ldo):
    """o += w V for nh (1, 2) heads and 64 d (``d64``) or one head and 16 d: the value kernels of
    :mod:`..floats.span_ir` for a float32 cache Vc, their ``h`` versions for a half one."""


@overload(_values, inline="always")
def _values_overload(Vc, nh, d64, pw, ldw, pv, ldv, L, po, ldo):
    half = Vc.dtype == types.uint16
    one, four, pair = (span_values1h, span_values4h, span_values4x2h) if half else \
        (span_values1, span_values4, span_values4x2)

    def impl(Vc, nh, d64, pw, ldw, pv, ldv, L, po, ldo):  # pragma: no cover - compiled
        if not d64:
            one(pw, ldw, pv, ldv, L, po, ldo)
        elif nh == 2:
            pair(pw, ldw, pv, ldv, L, po, ldo)
        else:
            four(pw, ldw, pv, ldv, L, po, ldo)
    return impl


def silu_mul(a, b):
    """SiLU(a) b = a / (1 + e^{-a}) b in a's dtype (e^x by :func:`..floats.fastmath.fexp`, which
    the compiler widens over a loop of them), the decode steps' and the prompt rows' one
    expression (compiled with :data:`..floats.fastmath.IN_ORDER`)."""
    return a / (1 + np.exp(-a)) * b


@overload(silu_mul, jit_options={"fastmath": IN_ORDER})
def _silu_mul_overload(a, b):
    one = as_dtype(a).type(1)
    return lambda a, b: a / (one + fexp(-a)) * b


@njit(fastmath=IN_ORDER, cache=True, nogil=True)
def _span_softmax(s, L, scale, mlh):  # pragma: no cover - compiled
    """s[:L] scaled, then e^{s_j - m}; mlh = (m, sum_j e^{s_j - m}), the sum by eight partial
    sums over j mod 8 joined as ((t_0 + t_1) + (t_2 + t_3)) + ((t_4 + t_5) + (t_6 + t_7))
    (float64), in that order wherever it is called. Three loops: the maximum, e^x of each
    score (element by element, which the compiler widens to vectors without changing a value),
    the sum."""
    m = s[0] * scale
    for jj in range(L):
        s[jj] *= scale
        m = max(m, s[jj])
    for jj in range(L):
        s[jj] = fexp(s[jj] - m)
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = 0.0
    L8 = L - L % 8
    for jj in range(0, L8, 8):
        t0 += s[jj]
        t1 += s[jj + 1]
        t2 += s[jj + 2]
        t3 += s[jj + 3]
        t4 += s[jj + 4]
        t5 += s[jj + 5]
        t6 += s[jj + 6]
        t7 += s[jj + 7]
    for jj in range(L8, L):
        t0 += s[jj]
    mlh[0] = m
    mlh[1] = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))


@njit(cache=True, nogil=True, inline='always')
def _attend_span_ir(q, Kc, Vc, j0, j1, G, scale, sc, ml, o):  # pragma: no cover - compiled
    """:func:`_attend_span` by the kernels of :mod:`..floats.span_ir` in the order of the prompt
    rows (:func:`..floats.attention_forward.attend_rows`): each score one fused multiply-add
    chain over d (the keys gathered from the cache into vector lanes), the softmax of
    :func:`_span_softmax`, each output one chain over the span's rows. q float32, Kc and Vc
    float32 or half (uint16), hd a multiple of 16."""
    KVH, hd = Kc.shape[1], Kc.shape[2]
    L = j1 - j0
    o[:] = 0
    ldk, ldv, lds = Kc.strides[0], Vc.strides[0], sc.strides[0]
    pq, po = q.ctypes.data, o.ctypes.data
    for kh in range(KVH):
        pk, pv = Kc[j0, kh].ctypes.data, Vc[j0, kh].ctypes.data
        h0 = kh * G
        for c in range(0, L, LANES):
            nk = min(LANES, L - c)
            g = 0
            while g < G:
                nh = 2 if g + 2 <= G else 1
                _scores(Kc, pq + 4 * (h0 + g) * hd, 4 * hd, nh, pk + c * ldk, ldk, hd,
                        sc[h0 + g].ctypes.data + 4 * c, lds, nk)
                g += nh
        for g in range(G):
            _span_softmax(sc[h0 + g], L, scale, ml[h0 + g])
        for d in range(0, hd - hd % (4 * LANES), 4 * LANES):
            g = 0
            while g < G:
                nh = 2 if g + 2 <= G else 1
                _values(Vc, nh, True, sc[h0 + g].ctypes.data, lds, pv + Vc.itemsize * d, ldv, L,
                        po + 4 * ((h0 + g) * hd + d), 4 * hd)
                g += nh
        for d in range(hd - hd % (4 * LANES), hd, LANES):
            for g in range(G):
                _values(Vc, 1, False, sc[h0 + g].ctypes.data, lds, pv + Vc.itemsize * d, ldv, L,
                        po + 4 * ((h0 + g) * hd + d), 4 * hd)


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _rope_store(r, a, c, d0, p, qd, kvd, hd, cos, sin, qkv, Kc, Vc):  # pragma: no cover
    """Rows r, r + 1 of the fused q|k|v product of one token at position p, (a, c): rotated by
    RoPE (q and k rows) as the pair (d0, d0 + 1) of their head, then written to q or to the
    K / V cache."""
    if r < qd + kvd:
        cs = cos[p, d0 // 2]
        sn = sin[p, d0 // 2]
        a, c = rotate_pair(a, c, cs, sn)
    if r < qd:
        qkv[0, r] = a
        qkv[0, r + 1] = c
    elif r < qd + kvd:
        Kc[0, p, (r - qd) // hd, d0] = kv_write(Kc, a)
        Kc[0, p, (r - qd) // hd, d0 + 1] = kv_write(Kc, c)
    else:
        Vc[0, p, (r - qd - kvd) // hd, d0] = kv_write(Vc, a)
        Vc[0, p, (r - qd - kvd) // hd, d0 + 1] = kv_write(Vc, c)


@njit(fastmath=IN_ORDER, cache=True, nogil=True)
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
def _span(N, u, parts):  # pragma: no cover - compiled
    """Rows [lo, hi) of part u of N rows split into ``parts`` runs of even length (RoPE pairs
    stay in one run)."""
    return (N * u // parts) // 2 * 2, (N if u == parts - 1 else (N * (u + 1) // parts) // 2 * 2)


#: bytes of W rows in a block of :func:`decode_step` (each block is dotted with every
#: sequence's activation row while the block and that row are in L1), and the most bytes of
#: activation rows that stay in L1 without blocks
BLOCK_BYTES = 16 * 1024


@njit(cache=True, nogil=True, inline='always')
def _block_rows(K, itemsize, B):  # pragma: no cover - compiled
    """Rows of K values of W per block for B sequences: 2 (a RoPE pair) while the B activation
    rows fit in :data:`BLOCK_BYTES`, else an even number of rows filling that much. Measured
    on SmolLM2's shape in float32: blocks 1.2x faster at B = 8, pairs 1.2x at B = 4."""
    if B * K * itemsize <= BLOCK_BYTES:
        return 2
    return max(2, BLOCK_BYTES // (K * itemsize) // 2 * 2)


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
def decode_step(tok, pos, seq, emb, wout, g_final, g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3,
                kc, vc, cos, sin, eps, n_heads, zero, logits, threads, stop,
                ids):  # pragma: no cover - compiled
    r"""One decode step for B sequences, each feeding one token at its own position; with
    ``ids`` of shape (B, n), n > 0, n greedy steps in one call.

    tok, pos: (B,) int64 (token id and absolute position p_b of each sequence);
    seq: (B,) int64, the row of the caches row b reads and writes (``arange(B)`` for B
    sequences; rows of one sequence at consecutive positions share a cache row, which is how
    drafted tokens are verified: each row's K/V is written before any row attends);
    emb: (V, D) embedding; wout: (V, D) classifier; g_final (D,); per-layer lists (length L)
    g_att, g_ffn (D,), wq (H*hd, D), wk, wv (KVH*hd, D), wo (D, H*hd), w1, w3 (F, D), w2 (D, F);
    kc, vc: lists of the layers' caches (B, S_max, KVH, hd), written at p_b;
    cos, sin: (S, hd/2) RoPE tables; zero: 0 in the compute dtype (the accumulators' type);
    logits: (B, V) output, filled in; threads: the number of Numba threads (parallel parts);
    stop: unused here (the caller applies each sequence's stop rule; the signature is that of
    :func:`decode_step_one`); ids: (B, n) int64.

    Every operation on a row is :func:`decode_step_one`'s, in its order: each product output
    is one :func:`_dot` (the threads take runs of consecutive rows of W, by pairs, or by blocks
    of :data:`BLOCK_BYTES` when the B activation rows do not fit in that much, each pair or
    block dotted with the B activation rows while it is in L1), attention cuts each sequence's
    cache rows into the same spans (all the sequences' spans in one parallel loop) joined per
    sequence. So a row's logits and K/V are the one-sequence kernel's bit for bit on any thread
    count: batching shares the reads of the weights and nothing else.

    Greedy (n > 0): after each step every sequence's next token is the argmax of its logits
    (the first maximum) and is fed at its next position, capped at the cache's last slot; all
    B sequences run the n steps (the caller drops what follows a sequence's end). A row of
    logits holding NaN/inf gets -1 and ends the call after that step. Returns the number of
    steps run (1 for the single step, ``ids`` empty).
    """
    B = tok.shape[0]
    V, D, L, H, qd, kvd, hd, KVH, G, F, S = _sizes(emb, wq, wk, w1, kc, n_heads)
    dt = emb.dtype
    n_steps = max(1, ids.shape[1])
    x = np.empty((B, D), dtype=dt)
    xn = np.empty((B, D), dtype=dt)
    qkv = np.empty((B, qd), dtype=dt)
    att = np.empty((B, qd), dtype=dt)
    h = np.empty((B, F), dtype=dt)
    n_max = 1
    for b in range(B):
        n_max = max(n_max, min(pos[b] + n_steps, S))
    P = _spans(n_max)  # the most spans of a sequence (scratch per (sequence, span))
    scores = np.empty((B * P, H, SPAN), dtype=dt)
    ml = np.empty((B * P, H, 2), dtype=dt)
    parts = np.empty((B * P, qd), dtype=dt)
    scale = dt.type(1.0 / np.sqrt(hd))
    # rows of W per block, each block dotted with every sequence's row while both are in L1
    rb_d = _block_rows(D, emb.itemsize, B)
    rb_q = _block_rows(qd, emb.itemsize, B)
    rb_f = _block_rows(F, emb.itemsize, B)
    ps = pos.copy()  # each sequence's position in the current step
    cur = tok.copy()  # and the token it feeds
    best = np.empty((threads, B), dtype=np.int64)
    finite = np.empty((threads, B), dtype=np.bool_)
    for step in range(n_steps):
        for b in range(B):
            ps[b] = min(pos[b] + step, S - 1)
            x[b, :] = emb[cur[b]]
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
            # q, k, v by RoPE pairs of rows of W_q, W_k, W_v stacked, as decode_step_one
            for u in prange(threads):
                lo, hi = _span(qd + 2 * kvd, u, threads)
                for r0 in range(lo, hi, rb_d):
                    for b in range(B):
                        for r in range(r0, min(r0 + rb_d, hi), 2):
                            s = seq[b]
                            _qkv_pair(xn[b], Wq, Wk, Wv, r, ps[b], hd, cos, sin, qkv[b:b + 1],
                                      Kc[s:s + 1], Vc[s:s + 1], zero)
            # sequence b's cache rows 0..p_b in the spans of SPAN rows decode_step_one takes
            for u in prange(B * P):
                b = u // P
                c = u - b * P
                n = ps[b] + 1
                if c < _spans(n):
                    _attend_span(qkv[b], Kc[seq[b]], Vc[seq[b]], c * SPAN,
                                 min(n, (c + 1) * SPAN), G, scale, scores[u], ml[u], parts[u])
            for b in range(B):
                Pb = _spans(ps[b] + 1)
                _join_spans(ml[b * P:b * P + Pb], parts[b * P:b * P + Pb], att[b])
            for u in prange(threads):
                lo, hi = _span(D, u, threads)
                for i0 in range(lo, hi, rb_q):
                    for b in range(B):
                        for i in range(i0, min(i0 + rb_q, hi)):
                            x[b, i] += _dot(att[b], Wo, i, zero)
            _rmsnorm_rows(x, g_ffn[layer], eps, xn)
            for u in prange(threads):
                lo, hi = _span(F, u, threads)
                for i0 in range(lo, hi, rb_d // 2):
                    for b in range(B):
                        for i in range(i0, min(i0 + rb_d // 2, hi)):
                            a = _dot(xn[b], W1, i, zero)
                            h[b, i] = silu_mul(a, _dot(xn[b], W3, i, zero))
            for u in prange(threads):
                lo, hi = _span(D, u, threads)
                for i0 in range(lo, hi, rb_f):
                    for b in range(B):
                        for i in range(i0, min(i0 + rb_f, hi)):
                            x[b, i] += _dot(h[b], W2, i, zero)
        _rmsnorm_rows(x, g_final, eps, xn)
        # the classifier in one run of rows per thread, each run's argmax while in cache
        for u in prange(threads):
            lo = u * V // threads
            hi = (u + 1) * V // threads
            for v0 in range(lo, hi, rb_d):
                for b in range(B):
                    for v in range(v0, min(v0 + rb_d, hi)):
                        logits[b, v] = _dot(xn[b], wout, v, zero)
            if ids.shape[1] > 0:
                for b in range(B):
                    best[u, b], finite[u, b] = _argmax_finite(logits[b], lo, hi)
        if ids.shape[1] == 0:
            return 1
        bad = False
        for b in range(B):
            t, done = _pick(logits[b], best[:, b], finite[:, b], stop[:0], ids[b], step)
            ok = ids[b, step] >= 0
            cur[b] = t if ok else 0
            bad = bad or not ok
        if bad:
            return step + 1
    return n_steps


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _qkv_pair(x, Wq, Wk, Wv, r, p, hd, cos, sin, qkv, Kc, Vc, zero):  # pragma: no cover
    """Rows r, r + 1 (a RoPE pair) of W_q, W_k, W_v stacked, dotted with x (K,) by
    :func:`_dot`, then rotated and stored by :func:`_rope_store` for position p: the one code of
    both steps, so a row's q, k, v are the same in either."""
    qd, kvd = Wq.shape[0], Wk.shape[0]
    if r < qd:
        W, i = Wq, r
    elif r < qd + kvd:
        W, i = Wk, r - qd
    else:
        W, i = Wv, r - qd - kvd
    _rope_store(r, _dot(x, W, i, zero), _dot(x, W, i + 1, zero), i % hd, p, qd, kvd, hd, cos,
                sin, qkv, Kc, Vc)


@njit(fastmath=True, cache=True, nogil=True, inline='always')
def _dot(x, W, i, zero):  # pragma: no cover - compiled
    """x . W_i for x (K,) and row i of W (N, K): every product output of both steps is one
    such call, so its order of sums is the same whatever the batch and the threads."""
    s = zero
    for k in range(x.shape[0]):
        s += x[k] * W[i, k]
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
                _qkv_pair(xn[0], Wq, Wk, Wv, 2 * i, p, hd, cos, sin, qkv, Kc, Vc, zero)
            # attention over cache rows 0..p in P spans of SPAN consecutive rows (each thread
            # streams its own spans of the cache), then the spans joined in order
            for u in prange(P):
                _attend_span(qkv[0], Kc[0], Vc[0], u * SPAN, min(n, (u + 1) * SPAN), G, scale,
                             scores[u], ml[u], parts[u])
            _join_spans(ml[:P], parts[:P], att[0])
            for i in prange(D):
                x[0, i] += _dot(att[0], Wo, i, zero)
            _rmsnorm_rows(x, g_ffn[layer], eps, xn)
            for i in prange(F):
                a = _dot(xn[0], W1, i, zero)
                h[0, i] = silu_mul(a, _dot(xn[0], W3, i, zero))
            for i in prange(D):
                x[0, i] += _dot(h[0], W2, i, zero)
        _rmsnorm_rows(x, g_final, eps, xn)
        if ids.shape[0] == 0:
            for v in prange(V):
                logits[0, v] = _dot(xn[0], wout, v, zero)
            return 1
        # the classifier in one span of rows per thread, each span's argmax while in cache
        for u in prange(threads):
            lo = u * V // threads
            hi = (u + 1) * V // threads
            for v in range(lo, hi):
                logits[0, v] = _dot(xn[0], wout, v, zero)
            best[u], finite[u] = _argmax_finite(logits[0], lo, hi)
        t, done = _pick(logits[0], best, finite, stop, ids, step)
        if done:
            return step + 1
    return n_steps
