r"""The fused decode step of :mod:`.float_step` for a model whose matrices are GGML blocks
(:class:`minillama.core.quant.QuantMatrix`): one compiled call runs a whole KV-cached decode step of
one sequence (and, given an ``ids`` buffer, several greedy steps; :func:`decode_step_one_q`) or of
several sequences each at its own position (:func:`decode_step_rows_q`, the step of continuous
batching: each matrix read once for all of them), every matrix-vector product computed from the
blocks: by default from the activations rounded to 8-bit blocks by the integer kernels of
:mod:`..quant.int8_dots` (each activation vector rounded once, before the products that read it),
with ``MINILLAMA_QUANT_DOTS=float`` (and for the IQ4 types) by the float32 row kernels of
:mod:`..quant.matmul` / :mod:`..quant.unpack`.

The step is that of :func:`.float_step.decode_step_one` (RMSNorm; q, k, v by RoPE pairs of rows,
rotated as computed, k and v into the cache; attention over the cache rows in spans; W_o with
the residual add; RMSNorm; SiLU(W_1 x) * W_3 x; W_2 with the residual add; final RMSNorm; the
classifier rows and, greedy, their argmax), float32 activations. The embedding row of the token
is dequantized from its blocks. Each matrix carries its own GGML type (a Q4_K_M file mixes Q4_K
and Q6_K): ``codes[layer]`` holds the type ids of W_q, W_k, W_v, W_o, W_1, W_2, W_3.

Imported only by the numba backend (importing it imports Numba), which also reaches
:func:`..floats.attention_forward.attend_rows` and :func:`..quant.int8_dots.gemm_products` through
it (a prompt's rows computed alike, :meth:`~.backend_decode.FusedDecode.prompt_rows`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..floats.attention_forward import attend_rows  # noqa: F401  (reached through this module)
from ..quant.block_types import Q2_K, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0
from ..quant.int8_dots import (  # noqa: F401  (gemm_products: reached through this module)
    ROWS,
    gemm_products,
    idot,
    idot_rows,
    int8_enabled,
    quantize_row,
)
from ..quant.int8_lanes import (
    LANES,
    XROWS,
    has_lanes,
    has_lanes4,
    idot_lanes,
    idot_lanes4,
    mv_lanes,
)
from ..quant.matmul import _dequant_row, _dot
from .float_step import (
    SPAN,
    _argmax_finite,
    _attend_span,
    _join_spans,
    _pick,
    _rmsnorm_rows,
    _rope_store,
    _span,
    _spans,
    silu_mul,
)


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _int8(qt):  # pragma: no cover - compiled
    """Whether GGML type qt has an integer kernel (:data:`..quant.int8_dots.INT8_TYPES`; Q2_K to
    Q6_K have consecutive ids; tests/backends/numba/quant/test_int8_dots.py checks the two
    agree)."""
    return (qt == Q8_0 or qt == Q4_0 or qt == Q4_1 or qt == Q5_0 or qt == Q5_1
            or (qt >= Q2_K and qt <= Q6_K))


@njit(fastmath=True, cache=True, nogil=True)
def _mv(qt, W, Wf, x, a8, y, lo, hi, lut, kv, gemm):  # pragma: no cover - compiled
    """y[n] = x_0 . W_n for lo <= n < hi, W_n the dequantized row n of the block matrix W (type qt;
    qt 0: the float32 matrix Wf): from x's 8-bit blocks a8 = (on, xq, xd, xs)
    (:func:`..quant.int8_dots.quantize_row`) when a8[0] and W's type has an integer kernel (with
    ``gemm``, a layer's matrix, by :func:`..quant.int8_lanes.mv_lanes`, each output the integer
    GEMM's value, bit for bit as a prefill's; else, the classifier, whose logits only decode
    steps give, by the faster row kernels), else from the float32 x (1, K).
    A call of its own, so that each loop over rows is compiled for one type (the type test
    leaves the loop)."""
    if qt == 0:
        for n in range(lo, hi):
            s = np.float32(0)
            for k in range(x.shape[1]):
                s += x[0, k] * Wf[n, k]
            y[n] = s
    elif a8[0] and gemm and has_lanes(qt):  # the integer GEMM's value of each output
        mv_lanes(qt, W, a8[1], a8[2], a8[3], y, lo, hi)
    elif a8[0] and _int8(qt):
        for n in range(lo, hi):
            y[n] = idot(qt, W, n, a8[1], a8[2], a8[3])
    else:
        for n in range(lo, hi):
            y[n] = _dot(qt, W, n, x, 0, lut, kv, 16)


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _mv_add(qt, W, v, a8, x, y, lo, hi, lut, kv, none):  # pragma: no cover - compiled
    """x_0[lo:hi] += (v_0 W^T)[lo:hi], y scratch: a product with its residual add."""
    _mv(qt, W, none, v, a8, y, lo, hi, lut, kv, True)
    for i in range(lo, hi):
        x[0, i] += y[i]


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _a8(on, x, xq, xd, xm):  # pragma: no cover - compiled
    """x[0] (K,) rounded to 8-bit blocks in the buffers (when on): (on, xq, xd, xm) of K."""
    K = x.shape[1]
    a = (on, xq[:K], xd[:K // 32], xm[:K // 16])
    if on:
        quantize_row(x[0], a[1], a[2], a[3])
    return a


def decode_step_one_q(*args):
    """:func:`decode_step_one_q_kernel` with the activations of the products rounded to 8-bit
    blocks unless ``MINILLAMA_QUANT_DOTS=float`` (:func:`..quant.int8_dots.int8_enabled`)."""
    return decode_step_one_q_kernel(*args, int8_enabled())


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_step_one_q_kernel(tok, pos, emb, emb_qt, emb_f, wout, out_qt, out_f, codes, g_final,
                             g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3, kc, vc, cos, sin, eps,
                             n_heads, logits, threads, stop, ids, lut, kv,
                             int8):  # pragma: no cover - compiled
    r""":func:`.float_step.decode_step_one` with block-quantized matrices: emb and wout uint8
    (V, row bytes) of GGML types emb_qt and out_qt; wq ... w3 typed lists of uint8 block
    matrices; codes (L, 7) int64 their types; a type 0 for the embedding (classifier) means a
    float32 matrix, emb_f (out_f), instead; kc, vc the float32 caches (1, S, KVH, hd);
    lut, kv the fp16 and IQ4 tables of :mod:`..quant.matmul`. Returns how many entries of ``ids`` it
    wrote (1 for the single step, ``ids`` empty); ``logits`` (1, V) holds the last step's.
    int8: the matrix-vector products of the types with an integer kernel take the activations
    rounded to 8-bit blocks (:mod:`..quant.int8_dots`)."""
    D = g_final.shape[0]
    V = logits.shape[1]
    L = len(wq)
    qd = wq[0].shape[0]
    kvd = wk[0].shape[0]
    H = n_heads
    hd = qd // H
    G = H // (kvd // hd)
    F = w1[0].shape[0]
    n_steps = max(1, ids.shape[0])
    t = tok[0]
    x = np.empty((1, D), dtype=np.float32)
    xn = np.empty((1, D), dtype=np.float32)
    qkv = np.empty((1, qd), dtype=np.float32)
    att = np.empty((1, qd), dtype=np.float32)
    h = np.empty((1, F), dtype=np.float32)
    n_max = pos[0] + n_steps
    scores = np.empty((_spans(n_max), H, SPAN), dtype=np.float32)
    ml = np.empty((_spans(n_max), H, 2), dtype=np.float32)
    parts = np.empty((_spans(n_max), qd), dtype=np.float32)
    best = np.empty(threads, dtype=np.int64)
    finite = np.empty(threads, dtype=np.bool_)
    scale = np.float32(1.0 / np.sqrt(hd))
    K8 = max(D, qd, F) if int8 else 0
    xq = np.empty(K8, dtype=np.int8)
    xd = np.empty(K8 // 32, dtype=np.float32)
    xm = np.empty(K8 // 16, dtype=np.float32)
    y = np.empty(max(qd + 2 * kvd, 2 * F, D), dtype=np.float32)
    none = np.zeros((1, 1), dtype=np.float32)
    for step in range(n_steps):
        p = pos[0] + step
        n = p + 1
        P = _spans(n)  # spans of SPAN cache rows in attention, whatever the thread count
        if emb_qt == 0:
            x[0, :] = emb_f[t]
        else:
            _dequant_row(emb_qt, emb, t, x, 0, lut, kv)
        for layer in range(L):
            Wq = wq[layer]
            Wk = wk[layer]
            Wv = wv[layer]
            Wo = wo[layer]
            W1 = w1[layer]
            W2 = w2[layer]
            W3 = w3[layer]
            cq, ck, cv, co, c1, c2, c3 = (codes[layer, 0], codes[layer, 1], codes[layer, 2],
                                          codes[layer, 3], codes[layer, 4], codes[layer, 5],
                                          codes[layer, 6])
            Kc = kc[layer]
            Vc = vc[layer]
            _rmsnorm_rows(x, g_att[layer], eps, xn)
            a8 = _a8(int8, xn, xq, xd, xm)
            for u in prange(threads):
                lo, hi = _span(qd + 2 * kvd, u, threads)
                _mv(cq, Wq, none, xn, a8, y, lo, min(hi, qd), lut, kv, True)
                _mv(ck, Wk, none, xn, a8, y[qd:], max(lo, qd) - qd, min(hi, qd + kvd) - qd,
                    lut, kv, True)
                _mv(cv, Wv, none, xn, a8, y[qd + kvd:], max(lo, qd + kvd) - qd - kvd,
                    hi - qd - kvd, lut, kv, True)
                for r in range(lo, hi, 2):
                    d0 = (r if r < qd else (r - qd if r < qd + kvd else r - qd - kvd)) % hd
                    _rope_store(r, y[r], y[r + 1], d0, p, qd, kvd, hd, cos, sin, qkv, Kc, Vc)
            for u in prange(P):
                _attend_span(qkv[0], Kc[0], Vc[0], u * SPAN, min(n, (u + 1) * SPAN), G, scale,
                             scores[u], ml[u], parts[u])
            _join_spans(ml[:P], parts[:P], att[0])
            a8 = _a8(int8, att, xq, xd, xm)
            for u in prange(threads):
                lo, hi = _span(D, u, threads)
                _mv_add(co, Wo, att, a8, x, y, lo, hi, lut, kv, none)
            _rmsnorm_rows(x, g_ffn[layer], eps, xn)
            a8 = _a8(int8, xn, xq, xd, xm)
            for u in prange(threads):
                lo, hi = _span(F, u, threads)
                _mv(c1, W1, none, xn, a8, y, lo, hi, lut, kv, True)
                _mv(c3, W3, none, xn, a8, y[F:], lo, hi, lut, kv, True)
                for i in range(lo, hi):
                    a = y[i]
                    h[0, i] = silu_mul(a, y[F + i])
            a8 = _a8(int8, h, xq, xd, xm)
            for u in prange(threads):
                lo, hi = _span(D, u, threads)
                _mv_add(c2, W2, h, a8, x, y, lo, hi, lut, kv, none)
        _rmsnorm_rows(x, g_final, eps, xn)
        a8 = _a8(int8, xn, xq, xd, xm)
        if ids.shape[0] == 0:
            for u in prange(threads):
                lo, hi = _span(V, u, threads)
                _mv(out_qt, wout, out_f, xn, a8, logits[0], lo, hi, lut, kv, False)
            return 1
        for u in prange(threads):
            lo, hi = _span(V, u, threads)
            _mv(out_qt, wout, out_f, xn, a8, logits[0], lo, hi, lut, kv, False)
            best[u], finite[u] = _argmax_finite(logits[0], lo, hi)
        t, done = _pick(logits[0], best, finite, stop, ids, step)
        if done:
            return step + 1
    return n_steps


@njit(fastmath=True, cache=True, nogil=True)
def _mm(qt, W, Wf, x, a8, y, c0, lo, hi, lut, kv, gemm):  # pragma: no cover - compiled
    """y[b, c0 + n] = x_b . W_n for lo <= n < hi and every row b of x (B, K): :func:`_mv` for
    several rows, each row n of W read from memory once and then dotted with the B rows (it stays in
    L1 between them). a8 = (on, xq, xd, xs) holds x's 8-bit blocks per row (:func:`_a8_rows`); with
    them and ``gemm`` (a layer's matrix) 16 rows of W at a time for each row of x
    (:func:`..quant.int8_lanes.idot_lanes`, 4 rows of x per decoding of W: each output the
    integer GEMM's value, as :func:`_mv` and a prefill give it); else :data:`ROWS` rows of x per
    decoding of W's row (:func:`..quant.int8_dots.idot_rows`, the floats of
    :func:`..quant.int8_dots.idot`, :func:`_mv`'s)."""
    B = x.shape[0]
    if qt == 0:
        for n in range(lo, hi):
            for b in range(B):
                s = np.float32(0)
                for k in range(x.shape[1]):
                    s += x[b, k] * Wf[n, k]
                y[b, c0 + n] = s
    elif a8[0] and gemm and has_lanes(qt):  # 16 rows of W at a time, the GEMM's values
        xq, xd, xs = a8[1], a8[2], a8[3]
        for n0 in range(lo, hi, LANES):
            nr = min(LANES, hi - n0)
            b = 0
            while b + XROWS <= B and has_lanes4(qt):  # W's 16 rows decoded once for XROWS
                idot_lanes4(qt, W, n0, nr, xq, xd, xs, b, y, c0)
                b += XROWS
            for bb in range(b, B):
                idot_lanes(qt, W, n0, nr, xq[bb], xd[bb], xs[bb], y[bb, c0:])
    elif a8[0] and _int8(qt):
        xq, xd, xs = a8[1], a8[2], a8[3]
        by_rows = qt == Q8_0 or qt == Q4_0 or qt == Q4_1 or qt == Q5_0 or qt == Q5_1
        for n in range(lo, hi):
            b = 0
            if by_rows:  # ROWS activation rows per pass over the row of W
                while b + ROWS <= B:
                    idot_rows(qt, W, n, xq, xd, xs, b, y, c0 + n)
                    b += ROWS
            for bb in range(b, B):
                y[bb, c0 + n] = idot(qt, W, n, xq[bb], xd[bb], xs[bb])
    else:
        for n in range(lo, hi):
            for b in range(B):
                y[b, c0 + n] = _dot(qt, W, n, x, b, lut, kv, 16)


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _a8_rows(on, x, xq, xd, xm):  # pragma: no cover - compiled
    """Every row of x (B, K) rounded to 8-bit blocks in the buffers (when on): (on, xq, xd, xm)
    with the first K (K/32, K/16) columns of each row."""
    K = x.shape[1]
    a = (on, xq[:, :K], xd[:, :K // 32], xm[:, :K // 16])
    if on:
        for b in range(x.shape[0]):
            quantize_row(x[b], a[1][b], a[2][b], a[3][b])
    return a


def decode_step_rows_q(*args):
    """:func:`decode_step_rows_q_kernel` with the activations of the products rounded to 8-bit
    blocks unless ``MINILLAMA_QUANT_DOTS=float`` (:func:`..quant.int8_dots.int8_enabled`)."""
    return decode_step_rows_q_kernel(*args, int8_enabled())


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_step_rows_q_kernel(tok, pos, seq, emb, emb_qt, emb_f, wout, out_qt, out_f, codes,
                              g_final, g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3, kc, vc, cos,
                              sin, eps, n_heads, logits, threads, lut, kv,
                              int8):  # pragma: no cover - compiled
    r"""One decode step of B sequences on block-quantized matrices, sequence b feeding token
    tok[b] at its own position pos[b]: the step of :func:`decode_step_one_q_kernel` for every
    row (the same arguments, but kc, vc the caches (B', S, KVH, hd), seq (B,) the cache row of
    each row of the step (:func:`.float_step.decode_step`), and logits (B, V)), each
    matrix streamed once per step for all B rows (:func:`_mm`: the threads take runs of
    consecutive rows of W, each row dotted with the B activation rows while in L1). Attention
    cuts each sequence's cache rows 0..p_b into the spans of :func:`decode_step_one_q_kernel`
    (all the sequences' spans in one parallel loop), joined per sequence by
    :func:`.float_step._join_spans`. Every operation on a row is the one-sequence kernel's, in the
    same order, so on any thread count each row's logits and K/V are that kernel's bit for
    bit: batching shares the reads of the weights and nothing else."""
    B = tok.shape[0]
    D = g_final.shape[0]
    V = logits.shape[1]
    L = len(wq)
    qd = wq[0].shape[0]
    kvd = wk[0].shape[0]
    H = n_heads
    hd = qd // H
    G = H // (kvd // hd)
    F = w1[0].shape[0]
    x = np.empty((B, D), dtype=np.float32)
    xn = np.empty((B, D), dtype=np.float32)
    qkv = np.empty((B, qd), dtype=np.float32)
    att = np.empty((B, qd), dtype=np.float32)
    h = np.empty((B, F), dtype=np.float32)
    n_max = 1
    for b in range(B):
        n_max = max(n_max, pos[b] + 1)
    P = _spans(n_max)  # the most spans of a sequence in attention (scratch per (sequence, span))
    scores = np.empty((B * P, H, SPAN), dtype=np.float32)
    ml = np.empty((B * P, H, 2), dtype=np.float32)
    parts = np.empty((B * P, qd), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(hd))
    K8 = max(D, qd, F) if int8 else 32
    xq = np.empty((B, K8), dtype=np.int8)
    xd = np.empty((B, K8 // 32), dtype=np.float32)
    xm = np.empty((B, K8 // 16), dtype=np.float32)
    y = np.empty((B, max(qd + 2 * kvd, 2 * F, D)), dtype=np.float32)
    none = np.zeros((1, 1), dtype=np.float32)
    for b in range(B):
        if emb_qt == 0:
            x[b, :] = emb_f[tok[b]]
        else:
            _dequant_row(emb_qt, emb, tok[b], x, b, lut, kv)
    for layer in range(L):
        cq, ck, cv, co, c1, c2, c3 = (codes[layer, 0], codes[layer, 1], codes[layer, 2],
                                      codes[layer, 3], codes[layer, 4], codes[layer, 5],
                                      codes[layer, 6])
        Kc = kc[layer]
        Vc = vc[layer]
        _rmsnorm_rows(x, g_att[layer], eps, xn)
        a8 = _a8_rows(int8, xn, xq, xd, xm)
        for u in prange(threads):
            lo, hi = _span(qd + 2 * kvd, u, threads)
            _mm(cq, wq[layer], none, xn, a8, y, 0, lo, min(hi, qd), lut, kv, True)
            _mm(ck, wk[layer], none, xn, a8, y, qd, max(lo, qd) - qd, min(hi, qd + kvd) - qd,
                lut, kv, True)
            _mm(cv, wv[layer], none, xn, a8, y, qd + kvd, max(lo, qd + kvd) - qd - kvd,
                hi - qd - kvd, lut, kv, True)
            for b in range(B):
                s = seq[b]
                for r in range(lo, hi, 2):
                    d0 = (r if r < qd else (r - qd if r < qd + kvd else r - qd - kvd)) % hd
                    _rope_store(r, y[b, r], y[b, r + 1], d0, pos[b], qd, kvd, hd, cos, sin,
                                qkv[b:b + 1], Kc[s:s + 1], Vc[s:s + 1])
        # sequence b's cache rows 0..p_b in the spans of SPAN rows the one-sequence kernel takes
        for u in prange(B * P):
            b = u // P
            c = u - b * P
            n = pos[b] + 1
            if c < _spans(n):
                _attend_span(qkv[b], Kc[seq[b]], Vc[seq[b]], c * SPAN, min(n, (c + 1) * SPAN),
                             G, scale, scores[u], ml[u], parts[u])
        for b in range(B):
            Pb = _spans(pos[b] + 1)
            _join_spans(ml[b * P:b * P + Pb], parts[b * P:b * P + Pb], att[b])
        a8 = _a8_rows(int8, att, xq, xd, xm)
        for u in prange(threads):
            lo, hi = _span(D, u, threads)
            _mm(co, wo[layer], none, att, a8, y, 0, lo, hi, lut, kv, True)
            for b in range(B):
                for i in range(lo, hi):
                    x[b, i] += y[b, i]
        _rmsnorm_rows(x, g_ffn[layer], eps, xn)
        a8 = _a8_rows(int8, xn, xq, xd, xm)
        for u in prange(threads):
            lo, hi = _span(F, u, threads)
            _mm(c1, w1[layer], none, xn, a8, y, 0, lo, hi, lut, kv, True)
            _mm(c3, w3[layer], none, xn, a8, y, F, lo, hi, lut, kv, True)
            for b in range(B):
                for i in range(lo, hi):
                    a = y[b, i]
                    h[b, i] = silu_mul(a, y[b, F + i])
        a8 = _a8_rows(int8, h, xq, xd, xm)
        for u in prange(threads):
            lo, hi = _span(D, u, threads)
            _mm(c2, w2[layer], none, h, a8, y, 0, lo, hi, lut, kv, True)
            for b in range(B):
                for i in range(lo, hi):
                    x[b, i] += y[b, i]
    _rmsnorm_rows(x, g_final, eps, xn)
    a8 = _a8_rows(int8, xn, xq, xd, xm)
    for u in prange(threads):
        lo, hi = _span(V, u, threads)
        _mm(out_qt, wout, out_f, xn, a8, logits, 0, lo, hi, lut, kv, False)


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def rmsnorm_step_rows(x, g, eps, out):  # pragma: no cover - compiled
    """The decode step's RMSNorm (:func:`.float_step._rmsnorm_rows`) on every row of x (N, D),
    the rows over the threads."""
    for n in prange(x.shape[0]):
        _rmsnorm_rows(x[n:n + 1], g, eps, out[n:n + 1])


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def swiglu_step_rows(a, b, h):  # pragma: no cover - compiled
    """The decode step's SiLU(a) * b (:func:`.float_step.silu_mul`) on every row, the rows over
    the threads."""
    for n in prange(a.shape[0]):
        for i in range(a.shape[1]):
            h[n, i] = silu_mul(a[n, i], b[n, i])
