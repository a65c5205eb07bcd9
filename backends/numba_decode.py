r"""A fused Numba decode step: one compiled call runs a whole KV-cached decode step of the model.

Decoding one token per sequence (B small, T = 1) is a chain of matrix-vector products whose time
is that of streaming every weight once; with one NumPy/BLAS call per op the Python and dispatch
work between the products (dozens of calls per layer) costs as much as the products on a small
model. :func:`decode_step` does all of it in one call, per layer

1. RMSNorm of the residual (one pass) fused into the GEMV by [W_q; W_k; W_v], whose output rows
   are taken in RoPE pairs (2i, 2i+1): each pair is rotated as soon as it is computed and the
   rotated k and v go straight into the KV cache at the sequence's position;
2. attention of each (sequence, query head) over its cache rows 0..p_b (scores, softmax and the
   weighted sum of V in one pass over the cache, head h reading KV head h // G);
3. the GEMV by W_o with the residual add in place;
4. RMSNorm fused into the GEMVs by W_1 and W_3, with SiLU(a) * b applied per output row;
5. the GEMV by W_2 with the residual add in place,

then the final RMSNorm and the classifier rows. Every GEMV spreads its output rows over the
Numba threads (``prange``); W is read once, row by row in memory order, for all B sequences.
The weights are the model's own arrays (no copy), passed as typed lists over the layers (whose
type does not depend on L, so one compilation per dtype serves every depth), so a decode step
is one dispatch with no Python work per op. Equations: those of :mod:`minillama.ops`
(rmsnorm, linear, rope, attention, swiglu), held to them by ``tests/test_numba_decode.py``.

Imported only by the numba backend (importing it imports Numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


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


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_step(tok, pos, emb, wout, g_final, g_att, wq, wk, wv, wo, g_ffn, w1, w2, w3,
                kc, vc, cos, sin, eps, n_heads, zero, logits):  # pragma: no cover - compiled
    r"""One decode step for B sequences, each feeding one token at its own position.

    tok, pos: (B,) int64 (token id and absolute position p_b of each sequence);
    emb: (V, D) embedding; wout: (V, D) classifier; g_final (D,); per-layer lists (length L)
    g_att, g_ffn (D,), wq (H*hd, D), wk, wv (KVH*hd, D), wo (D, H*hd), w1, w3 (F, D), w2 (D, F);
    kc, vc: lists of the layers' caches (B, S_max, KVH, hd), written at p_b;
    cos, sin: (S, hd/2) RoPE tables; zero: 0 in the compute dtype (the accumulators' type);
    logits: (B, V) output, filled in.
    """
    B = tok.shape[0]
    V, D = emb.shape
    L = len(wq)
    H = n_heads
    qd = wq[0].shape[0]
    kvd = wk[0].shape[0]
    hd = qd // H
    KVH = kvd // hd
    G = H // KVH
    F = w1[0].shape[0]
    S = kc[0].shape[1]
    dt = emb.dtype
    x = np.empty((B, D), dtype=dt)
    xn = np.empty((B, D), dtype=dt)
    q = np.empty((B, qd), dtype=dt)
    att = np.empty((B, qd), dtype=dt)
    hb = np.empty((B, F), dtype=dt)
    scores = np.empty((B * H, S), dtype=dt)
    scale = 1.0 / np.sqrt(hd)
    for b in range(B):
        x[b, :] = emb[tok[b]]
    npair = (qd + 2 * kvd) // 2
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
        # q, k, v by row pairs; RoPE on q and k; k and v written into the cache
        for pp in prange(npair):
            r = 2 * pp
            if r < qd:
                W = Wq
                rr = r
            elif r < qd + kvd:
                W = Wk
                rr = r - qd
            else:
                W = Wv
                rr = r - qd - kvd
            i = (rr % hd) // 2
            head = rr // hd
            d0 = rr % hd
            for b in range(B):
                s0 = zero
                s1 = zero
                for k in range(D):
                    xv = xn[b, k]
                    s0 += xv * W[rr, k]
                    s1 += xv * W[rr + 1, k]
                p = pos[b]
                if r < qd + kvd:
                    c = cos[p, i]
                    s = sin[p, i]
                    y0 = s0 * c - s1 * s
                    y1 = s0 * s + s1 * c
                    if r < qd:
                        q[b, rr] = y0
                        q[b, rr + 1] = y1
                    else:
                        Kc[b, p, head, d0] = y0
                        Kc[b, p, head, d0 + 1] = y1
                else:
                    Vc[b, p, head, d0] = s0
                    Vc[b, p, head, d0 + 1] = s1
        # attention of each (sequence, query head) over the cache rows 0..p_b
        for u in prange(B * H):
            b = u // H
            h = u - b * H
            kh = h // G
            n = pos[b] + 1
            q0 = h * hd
            m = -np.inf
            for j in range(n):
                s = 0.0
                for d in range(hd):
                    s += q[b, q0 + d] * Kc[b, j, kh, d]
                s *= scale
                scores[u, j] = s
                if s > m:
                    m = s
            tot = 0.0
            for j in range(n):
                e = np.exp(scores[u, j] - m)
                scores[u, j] = e
                tot += e
            inv = 1.0 / tot
            for d in range(hd):
                att[b, q0 + d] = 0.0
            for j in range(n):
                w = scores[u, j] * inv
                for d in range(hd):
                    att[b, q0 + d] += w * Vc[b, j, kh, d]
        # x += att W_o^T
        for i in prange(D):
            for b in range(B):
                s = zero
                for k in range(qd):
                    s += att[b, k] * Wo[i, k]
                x[b, i] += s
        # SwiGLU: hb = silu(xn W_1^T) * (xn W_3^T)
        _rmsnorm_rows(x, g_ffn[layer], eps, xn)
        for i in prange(F):
            for b in range(B):
                a = zero
                c = zero
                for k in range(D):
                    xv = xn[b, k]
                    a += xv * W1[i, k]
                    c += xv * W3[i, k]
                hb[b, i] = a / (1.0 + np.exp(-a)) * c
        # x += hb W_2^T
        for i in prange(D):
            for b in range(B):
                s = zero
                for k in range(F):
                    s += hb[b, k] * W2[i, k]
                x[b, i] += s
    _rmsnorm_rows(x, g_final, eps, xn)
    for v in prange(V):
        for b in range(B):
            s = zero
            for k in range(D):
                s += xn[b, k] * wout[v, k]
            logits[b, v] = s
