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
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .blas import gemm

#: fast-math flags that keep inf/nan meaningful (no 'nnan', no 'ninf')
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: query positions per tile of the attention kernels (each brings its G heads: BR*G rows)
BR = 16
#: keys per tile: a (hd, BC) slice of K^T and a (BC, hd) slice of V stay in L1 for a whole tile
BC = 64

# error_model="numpy": IEEE division (x/0 = inf, no Python exception check in the loops)
_opts = dict(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")


# ---------------------------------------------------------------------------------------------
# e^x for the softmax loops
# ---------------------------------------------------------------------------------------------
@intrinsic
def _pow2_biased(typingctx, k):
    """2^{k - 127} as a float32 for an int32 biased exponent 1 <= k <= 254: the bits k << 23
    (shift and reinterpretation in 32 bits, so a vectorised loop stays in 8-wide int32 lanes;
    Numba's own integer arithmetic would widen to int64)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        bits = builder.shl(args[0], ir.Constant(ir.IntType(32), 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


@intrinsic
def _unbias_float32(typingctx, k):
    """k - 127 as a float32 for an int32 k, subtracted in 32-bit integers (exact; done in
    floats, fast-math reassociation could fold it into the reduction r = x - n ln 2 and lose
    its precision; Numba's own integer arithmetic would widen to int64)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        n = builder.sub(args[0], ir.Constant(ir.IntType(32), 127))
        return builder.sitofp(n, ir.FloatType())

    return sig, codegen


def fexp(x):
    r"""e^x. float64: ``math.exp``. float32: a branch-free version the loop vectoriser can widen
    (libm's expf is a scalar call): e^x = 2^n e^r with n = \lfloor x \log_2 e + 1/2 \rfloor and
    r = x - n \ln 2 (ln 2 split in two for an exact product), e^r by a degree-7 polynomial on
    |r| <= ln2/2 (Cephes' coefficients), 2^n assembled in the exponent bits. Relative error
    < 3 ulp (3.6e-7) for -87 <= x <= 88; 0 below (including -inf), NaN for NaN; the callers pass
    x <= 0 (up to rounding) or NaN."""
    return math.exp(x)


@overload(fexp, jit_options={"fastmath": FASTMATH})
def _fexp_overload(x):
    if x == types.float32:
        def impl(x):
            lo = np.float32(-87.0)
            xc = min(max(x, lo), np.float32(88.0))
            # k = n + 127 with n = floor(x log2(e) + 1/2): the argument is > 0 after the
            # clamp, so truncation is the floor (float -> int conversions vectorise)
            k = np.int32(xc * np.float32(1.4426950408889634) + np.float32(127.5))
            n = _unbias_float32(k)
            r = xc - n * np.float32(0.693359375)
            r = r - n * np.float32(-2.12194440e-4)
            y = np.float32(1.9875691500e-4)
            y = y * r + np.float32(1.3981999507e-3)
            y = y * r + np.float32(8.3334519073e-3)
            y = y * r + np.float32(4.1665795894e-2)
            y = y * r + np.float32(1.6666665459e-1)
            y = y * r + np.float32(5.0000001201e-1)
            y = y * r * r + r + np.float32(1.0)
            e = y * _pow2_biased(k)  # 2^n from its exponent bits
            e = e if x >= lo else np.float32(0.0)  # underflow, -inf
            return e if x == x else x  # NaN stays NaN
        return impl
    return lambda x: math.exp(x)


@njit(**_opts)
def _rowmax(z, n):
    # max of z[0:n], n >= 1; eight running maxima so the loop vectorises (a plain max
    # reduction does not without 'nnan'). NaN inputs are skipped here but still poison the
    # softmax sums that follow, as in the reference.
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = z[0]
    j = 0
    while j + 8 <= n:
        x0 = z[j]
        x1 = z[j + 1]
        x2 = z[j + 2]
        x3 = z[j + 3]
        x4 = z[j + 4]
        x5 = z[j + 5]
        x6 = z[j + 6]
        x7 = z[j + 7]
        m0 = x0 if x0 > m0 else m0
        m1 = x1 if x1 > m1 else m1
        m2 = x2 if x2 > m2 else m2
        m3 = x3 if x3 > m3 else m3
        m4 = x4 if x4 > m4 else m4
        m5 = x5 if x5 > m5 else m5
        m6 = x6 if x6 > m6 else m6
        m7 = x7 if x7 > m7 else m7
        j += 8
    while j < n:
        x0 = z[j]
        m0 = x0 if x0 > m0 else m0
        j += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    return m4 if m4 > m0 else m0


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
def _scores(qrow, k, b, kh, c0, n, scale, srow):
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


@njit(**_opts)
def _axpy_rows(w, x, b, kh, c0, n, acc):
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
                _scores(q[b, t, h], k, b, kh, c0, n, scale, srow)
                mold = m[r]
                mx = max(mold, _rowmax(srow, n))
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
                _axpy_rows(srow, v, b, kh, c0, n, arow)
        for r in range(nr):
            t = t0 + r // G
            h = kh * G + (r - (r // G) * G)
            inv = one / l[r]
            for d in range(hd):
                out[b, t, h, d] = acc[r, d] * inv
            lse[b, h, t] = m[r] + math.log(l[r])


@njit(parallel=True, **_opts)
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


@njit(**_opts)
def attn_fwd_serial(q, k, v, starts, scale, out, lse):
    """Serial twin of :func:`attn_fwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_fwd_item(q, k, v, starts, scale, out, lse, u)


# ---------------------------------------------------------------------------------------------
# Attention forward, decode shape: few queries against a long cache, split along the keys
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
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
            mx = _rowmax(prow, n)
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


@njit(**_opts)
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


@njit(parallel=True, **_opts)
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


@njit(**_opts)
def attn_dec_serial(q, k, v, starts, scale, nsplit, pm, pl, pacc, out, lse):
    """Serial twin of :func:`attn_dec_parallel`."""
    for w in range(k.shape[0] * nsplit):
        _attn_dec_item(q, k, v, starts, scale, nsplit, pm, pl, pacc, w)
    _attn_dec_combine(nsplit, pm, pl, pacc, out, lse)


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
                _scores(q[b, t, h], k, b, kh, c0, n, scale, prow)
                _scores(dout[b, t, h], v, b, kh, c0, n, scale / scale, dsrow)
                L = lse[b, h, t]
                Dr = D[r]
                for c in range(n):
                    pc = fexp(prow[c] - L)
                    prow[c] = pc
                    dsrow[c] = pc * (dsrow[c] - Dr)
                _axpy_rows(dsrow, k, b, kh, c0, n, dqa[r])
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


@njit(parallel=True, **_opts)
def attn_bwd_parallel(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    r"""Backward of :func:`attn_fwd_parallel` from the saved lse, tile by tile:

    P_{tj} = e^{s_{tj} - lse_t},  dP = dO V^T,  D_t = dO_t \cdot O_t,  dS = P \odot (dP - D),
    dQ = dS K / \sqrt{hd},  dK = \sum_g dS^T Q / \sqrt{hd},  dV = \sum_g P^T dO.

    One (b, kv head) per work item (it owns its dK/dV rows: no races); dq, dk, dv are written
    in full. Scratch per item O(BR G (BC + hd)), independent of T and S."""
    for u in prange(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)


@njit(**_opts)
def attn_bwd_serial(q, k, v, out, dout, lse, starts, scale, dq, dk, dv):
    """Serial twin of :func:`attn_bwd_parallel`."""
    for u in range(k.shape[0] * k.shape[2]):
        _attn_bwd_item(q, k, v, out, dout, lse, starts, scale, dq, dk, dv, u)


# ---------------------------------------------------------------------------------------------
# BLAS-tiled attention (the backend's path for T >= 16 when NumPy's OpenBLAS is found): the
# score tiles S = Q_i K_j^T, dP = dO_i V_j^T and the products with V, K, Q are OpenBLAS GEMMs
# called from the kernel (:mod:`.blas`); the two tile kernels below do the elementwise
# softmax work between them, in place. Row r of a tile is query time t0 + r of one head, column
# c is key c0 + c; st is the sequence's start position.
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
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
        mx = max(mold, _rowmax(srow, n))
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


@njit(**_opts)
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


@njit(parallel=True, **_opts)
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


@njit(parallel=True, **_opts)
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


# ---------------------------------------------------------------------------------------------
# Softmax cross-entropy, fused: two passes over each row of logits instead of NumPy's five
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def xent_fwd(logits, targets, valid, lse, row_loss):
    r"""Per row n: m = \max_v z_{nv}, lse_n = m + \log \sum_v e^{z_{nv} - m},
    \ell_n = lse_n - z_{n y_n} (0 for ignored rows). Two reads of the row, nothing written
    but lse and \ell: the backward recomputes the probabilities.

    logits: (N, V); targets: (N,) int64 (0 where ignored); valid: (N,) bool; lse, row_loss: (N,).
    One thread: the op sits between BLAS calls and is bound by memory."""
    N, V = logits.shape
    for n in range(N):
        z = logits[n]
        mx = _rowmax(z, V)
        tot = z[0] - z[0]
        for j in range(V):
            tot += fexp(z[j] - mx)
        lse[n] = mx + math.log(tot)
        if valid[n]:
            row_loss[n] = lse[n] - z[targets[n]]
        else:
            row_loss[n] = tot - tot


@njit(**_opts)
def xent_bwd(logits, lse, targets, valid, scale, dz):
    r"""dz_{nv} = (e^{z_{nv} - lse_n} - [v = y_n]) \cdot scale for kept rows, 0 for ignored rows
    (scale = dL / |kept|). logits, dz: (N, V); one pass."""
    N, V = logits.shape
    zero = scale - scale
    for n in range(N):
        z = logits[n]
        d = dz[n]
        if valid[n]:
            L = lse[n]
            for j in range(V):
                d[j] = fexp(z[j] - L) * scale
            d[targets[n]] -= scale
        else:
            for j in range(V):
                d[j] = zero


@njit(**_opts)
def xent_grad_rows(z, targets, valid, scale, row_loss):
    r"""The loss head's block kernel, in place: per row n, \ell_n = \mathrm{lse}(z_n) - z_{n y_n}
    into ``row_loss`` and z_n \leftarrow (e^{z_n - \mathrm{lse}(z_n)} - e_{y_n}) \cdot scale;
    ignored rows: \ell_n = 0 and a zero row. Three passes over each row (max, exponentials and
    their sum, scaling), the row in L1/L2 meanwhile.

    z: (R, V); targets: (R,) int64 (0 where ignored); valid: (R,) bool; row_loss: (R,).
    One thread (the backend runs blocks of rows on its threads)."""
    R, V = z.shape
    zero = scale - scale
    for n in range(R):
        zr = z[n]
        if not valid[n]:
            for j in range(V):
                zr[j] = zero
            row_loss[n] = zero
            continue
        picked = zr[targets[n]]
        mx = _rowmax(zr, V)
        tot = zero
        for j in range(V):
            e = fexp(zr[j] - mx)
            zr[j] = e
            tot += e
        row_loss[n] = mx + math.log(tot) - picked
        c = scale / tot
        for j in range(V):
            zr[j] *= c
        zr[targets[n]] -= scale


# ---------------------------------------------------------------------------------------------
# RMSNorm and SwiGLU, forward and backward: one pass per row over rows lo..hi-1 (the backend
# runs row blocks on its threads; each kernel releases the GIL)
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def rmsnorm_fwd_rows(x, g, eps, inv_d, y, rstd, lo, hi):
    r"""y_n = x_n r_n \odot g, r_n = 1/\sqrt{\mathrm{mean}(x_n^2) + \epsilon} for rows lo..hi-1.
    x, y: (N, D); g: (D,); rstd: (N,) gets r_n; eps and inv_d = 1/D in the dtype of x."""
    D = x.shape[1]
    zero = g[0] - g[0]
    one = inv_d * D
    for n in range(lo, hi):
        xr = x[n]
        ss = zero
        for j in range(D):
            ss += xr[j] * xr[j]
        r = one / np.sqrt(ss * inv_d + eps)
        rstd[n] = r
        yr = y[n]
        for j in range(D):
            yr[j] = xr[j] * r * g[j]


@njit(**_opts)
def rmsnorm_bwd_rows(dy, x, rstd, g, inv_d, dx, dg, lo, hi):
    r"""dx_n = r_n (u_n - \hat{x}_n \mathrm{mean}(u_n \odot \hat{x}_n)), u_n = dy_n \odot g,
    \hat{x}_n = x_n r_n, for rows lo..hi-1; dg += \sum_n dy_n \odot \hat{x}_n (this block's part).
    dy, x, dx: (N, D); rstd: (N,); g, dg: (D,); inv_d = 1/D in the dtype of x."""
    D = x.shape[1]
    zero = g[0] - g[0]
    for n in range(lo, hi):
        xr, dr, r = x[n], dy[n], rstd[n]
        s = zero
        for j in range(D):
            xh = xr[j] * r
            s += dr[j] * g[j] * xh
            dg[j] += dr[j] * xh
        c = s * inv_d * r
        out = dx[n]
        for j in range(D):
            out[j] = r * (dr[j] * g[j] - xr[j] * c)


@njit(**_opts)
def swiglu_fwd_rows(a, b, one, h, sig, lo, hi):
    r"""h = \mathrm{silu}(a) \odot b = a \sigma(a) b elementwise, rows lo..hi-1 of (N, F);
    \sigma(a) is kept in ``sig`` for the backward; ``one`` is 1 in the dtype of a."""
    F = a.shape[1]
    for n in range(lo, hi):
        ar, br, hr, sr = a[n], b[n], h[n], sig[n]
        for j in range(F):
            s = one / (one + fexp(-ar[j]))
            sr[j] = s
            hr[j] = ar[j] * s * br[j]


@njit(**_opts)
def swiglu_bwd_rows(dh, a, b, sig, one, da, db, lo, hi):
    r"""db = dh \odot a\sigma(a), da = dh \odot b \odot \sigma(a)(1 + a(1 - \sigma(a))), with
    \sigma(a) saved by the forward; rows lo..hi-1 of (N, F); ``one`` is 1 in the dtype of a."""
    F = a.shape[1]
    for n in range(lo, hi):
        ar, br, gr, sr, dar, dbr = a[n], b[n], dh[n], sig[n], da[n], db[n]
        for j in range(F):
            x = ar[j]
            s = sr[j]
            g = gr[j]
            dbr[j] = g * x * s
            dar[j] = g * br[j] * s * (one + x * (one - s))


# the same kernels over the Numba threads: rows split into ``parts`` contiguous blocks
@njit(inline="always")
def _block(N, parts, t):
    step = (N + parts - 1) // parts
    return min(N, t * step), min(N, (t + 1) * step)


@njit(parallel=True, **_opts)
def rmsnorm_fwd_par(x, g, eps, inv_d, y, rstd, parts):
    """:func:`rmsnorm_fwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(x.shape[0], parts, t)
        rmsnorm_fwd_rows(x, g, eps, inv_d, y, rstd, lo, hi)


@njit(parallel=True, **_opts)
def rmsnorm_bwd_par(dy, x, rstd, g, inv_d, dx, dgp):
    """:func:`rmsnorm_bwd_rows` on all N rows, in dgp.shape[0] blocks over the threads; block t
    adds its part of dg into dgp[t] (zeros on entry)."""
    parts = dgp.shape[0]
    for t in prange(parts):
        lo, hi = _block(x.shape[0], parts, t)
        rmsnorm_bwd_rows(dy, x, rstd, g, inv_d, dx, dgp[t], lo, hi)


@njit(parallel=True, **_opts)
def swiglu_fwd_par(a, b, one, h, sig, parts):
    """:func:`swiglu_fwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(a.shape[0], parts, t)
        swiglu_fwd_rows(a, b, one, h, sig, lo, hi)


@njit(parallel=True, **_opts)
def swiglu_bwd_par(dh, a, b, sig, one, da, db, parts):
    """:func:`swiglu_bwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(a.shape[0], parts, t)
        swiglu_bwd_rows(dh, a, b, sig, one, da, db, lo, hi)


@njit(parallel=True, **_opts)
def lce_fwd_blas(fn, ilp64, x, w, targets, valid, scale, one, dz, dx, row_loss, R, parts):
    r"""The loss head's forward over the Numba threads, rows in blocks of R: per block
    z = x W^T into its rows of dz (BLAS), z \leftarrow (\mathrm{softmax}(z) - e_y) \cdot scale
    in place with the row losses (:func:`xent_grad_rows`), then its rows of dx = z W (BLAS).
    x: (N, D); w: (V, D); dz: (N, V); dx: (N, D); all C-contiguous."""
    N, V = dz.shape
    D = x.shape[1]
    isz = x.itemsize
    zero = scale - scale
    px, pw, pz, pdx = x.ctypes.data, w.ctypes.data, dz.ctypes.data, dx.ctypes.data
    for t in prange(parts):
        lo, hi = _block(N, parts, t)
        for r0 in range(lo, hi, R):
            r1 = min(hi, r0 + R)
            gemm(fn, ilp64, False, True, r1 - r0, V, D, one, px + r0 * D * isz, D, pw, D, zero,
                 pz + r0 * V * isz, V)
            xent_grad_rows(dz[r0:r1], targets[r0:r1], valid[r0:r1], scale, row_loss[r0:r1])
            gemm(fn, ilp64, False, False, r1 - r0, D, V, one, pz + r0 * V * isz, V, pw, D, zero,
                 pdx + r0 * D * isz, D)
