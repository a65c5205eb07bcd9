"""Row-wise kernels of the ``numba`` backend: the fused softmax cross-entropy (forward, backward
and the gradient rows of the loss head, with its BLAS-tiled forward), RMSNorm and SwiGLU
forward and backward, each one pass per row, serial over a row block or parallel over blocks."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .blas import gemm
from .fastmath import JIT_OPTS, fexp, rowmax


# ---------------------------------------------------------------------------------------------
# Softmax cross-entropy, fused: two passes over each row of logits instead of NumPy's five
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
def xent_fwd(logits, targets, valid, lse, row_loss):
    r"""Per row n: m = \max_v z_{nv}, lse_n = m + \log \sum_v e^{z_{nv} - m},
    \ell_n = lse_n - z_{n y_n} (0 for ignored rows). Two reads of the row, nothing written
    but lse and \ell: the backward recomputes the probabilities.

    logits: (N, V); targets: (N,) int64 (0 where ignored); valid: (N,) bool; lse, row_loss: (N,).
    One thread: the op sits between BLAS calls and is bound by memory."""
    N, V = logits.shape
    for n in range(N):
        z = logits[n]
        mx = rowmax(z, V)
        tot = z[0] - z[0]
        for j in range(V):
            tot += fexp(z[j] - mx)
        lse[n] = mx + math.log(tot)
        if valid[n]:
            row_loss[n] = lse[n] - z[targets[n]]
        else:
            row_loss[n] = tot - tot


@njit(**JIT_OPTS)
def xent_bwd(logits, lse, targets, valid, scale, dz):
    r"""dz_{nv} = (e^{z_{nv} - lse_n} - [v = y_n]) \cdot scale for kept rows, 0 for ignored rows
    (scale = dL / |kept|). The target's entry p_y - 1 is taken as -\sum_{v \ne y} p_v: no
    digits lost to cancellation as p_y \to 1. logits, dz: (N, V); one pass."""
    N, V = logits.shape
    zero = scale - scale
    for n in range(N):
        z = logits[n]
        d = dz[n]
        if valid[n]:
            L = lse[n]
            y = targets[n]
            rest = zero
            for j in range(V):
                d[j] = fexp(z[j] - L) * scale
                if j != y:
                    rest += d[j]
            d[y] = -rest
        else:
            for j in range(V):
                d[j] = zero


@njit(**JIT_OPTS)
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
        mx = rowmax(zr, V)
        tot = zero
        for j in range(V):
            e = fexp(zr[j] - mx)
            zr[j] = e
            tot += e
        row_loss[n] = mx + math.log(tot) - picked
        c = scale / tot
        y = targets[n]
        rest = zero
        for j in range(V):
            zr[j] *= c
            if j != y:
                rest += zr[j]
        zr[y] = -rest  # p_y - 1 = -sum of the others: no cancellation as p_y -> 1


# ---------------------------------------------------------------------------------------------
# RMSNorm and SwiGLU, forward and backward: one pass per row over rows lo..hi-1 (the backend
# runs row blocks on its threads; each kernel releases the GIL)
# ---------------------------------------------------------------------------------------------
@njit(**JIT_OPTS)
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


@njit(**JIT_OPTS)
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


@njit(**JIT_OPTS)
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


@njit(**JIT_OPTS)
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


@njit(parallel=True, **JIT_OPTS)
def rmsnorm_fwd_par(x, g, eps, inv_d, y, rstd, parts):
    """:func:`rmsnorm_fwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(x.shape[0], parts, t)
        rmsnorm_fwd_rows(x, g, eps, inv_d, y, rstd, lo, hi)


@njit(parallel=True, **JIT_OPTS)
def rmsnorm_bwd_par(dy, x, rstd, g, inv_d, dx, dgp):
    """:func:`rmsnorm_bwd_rows` on all N rows, in dgp.shape[0] blocks over the threads; block t
    adds its part of dg into dgp[t] (zeros on entry)."""
    parts = dgp.shape[0]
    for t in prange(parts):
        lo, hi = _block(x.shape[0], parts, t)
        rmsnorm_bwd_rows(dy, x, rstd, g, inv_d, dx, dgp[t], lo, hi)


@njit(parallel=True, **JIT_OPTS)
def swiglu_fwd_par(a, b, one, h, sig, parts):
    """:func:`swiglu_fwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(a.shape[0], parts, t)
        swiglu_fwd_rows(a, b, one, h, sig, lo, hi)


@njit(parallel=True, **JIT_OPTS)
def swiglu_bwd_par(dh, a, b, sig, one, da, db, parts):
    """:func:`swiglu_bwd_rows` on all N rows, in ``parts`` blocks over the threads."""
    for t in prange(parts):
        lo, hi = _block(a.shape[0], parts, t)
        swiglu_bwd_rows(dh, a, b, sig, one, da, db, lo, hi)


@njit(parallel=True, **JIT_OPTS)
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
