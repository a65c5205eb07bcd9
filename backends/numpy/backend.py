r"""The default ``numpy`` backend: the reference ops made fast on a CPU, still plain NumPy.

Each function below overrides the op of the same name in :mod:`minillama.core.ops` (same signature,
same equation; its own ``ctx``) and is held to it by
``tests/backends/numpy/test_backend.py``. What makes them faster, none of which changes the
math:

* rows split over Python threads (:func:`.threads.parallel_rows`; NumPy releases the GIL),
  with OpenBLAS on one thread meanwhile (:func:`.threads.single_threaded_blas`), for the
  row-wise ops, the linear GEMMs (:func:`.threads.split_gemm`) and attention (whole
  sequences per thread);
* in-place work in preallocated buffers instead of temporaries; attention multiplies the G query
  heads of a group as one (G T, hd) matrix against their shared K/V, with Q pre-scaled;
* RoPE as one complex product per pair, (x_{2i} + i x_{2i+1}) e^{i m \theta_i};
* the embedding gradient by sorting the tokens and summing each run with one ``reduceat``;
* glibc malloc tuned to keep freed activation buffers (:func:`tune_malloc`);
* a block-quantized weight (:class:`~minillama.core.quant.QuantMatrix`) dequantized by tiles of
  :data:`QUANT_TILE_ROWS` rows into one reused buffer, one GEMM per tile: never a whole float
  copy of W.

``NumpyBackend`` derives from the reference backend; Numba derives from it in turn.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix, dequantize_rows

from ..reference import (
    ReferenceBackend,
    composed_linear_cross_entropy_backward,
    composed_linear_cross_entropy_forward,
)
from ..tuner import ThreadTuner
from .lora import LoRAOps
from .threads import blas_for_rows, num_threads, parallel_rows, split_gemm, team

_MALLOC_TUNED: bool | None = None


def tune_malloc() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc only).

    A training step allocates and frees the same few-MB activation buffers every time. With
    glibc's defaults those blocks are mmap'd or trimmed back to the OS on free, so every step
    pays page faults on first touch (a third of a small model's step time). Raising the trim
    threshold to 1 GiB and fixing the mmap threshold at its 32 MiB maximum lets malloc reuse them,
    at the price of a resident size that stays at its peak. Done once per process, on first use
    of a CPU backend; ``MINILLAMA_MALLOC_TUNE=0`` turns it off. Returns whether it was applied.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED is not None:
        return _MALLOC_TUNED
    _MALLOC_TUNED = False
    if os.environ.get("MINILLAMA_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import platform

        if platform.libc_ver()[0] != "glibc":
            return False
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and ok
        _MALLOC_TUNED = bool(ok)
    except (OSError, AttributeError):  # pragma: no cover - not glibc after all
        pass
    return _MALLOC_TUNED


# ---------------------------------------------------------------------------------------------
# Token embedding (the forward is the reference gather)
# ---------------------------------------------------------------------------------------------
def embedding_backward(dout, ctx):
    r"""dE_v = \sum_{(b,t): x_{b,t} = v} dh_{b,t}. When the tokens outnumber the vocabulary the
    rows are sorted by token and each run summed with one ``reduceat``; else ``np.add.at``."""
    tokens, shape = ctx
    flat_tok = tokens.reshape(-1)
    if shape is None or flat_tok.size < shape[0]:  # a quantized table (frozen), or few tokens
        return ops.embedding_backward(dout, ctx)
    flat_d = dout.reshape(-1, shape[1])
    dw = np.zeros(shape, dtype=dout.dtype)
    order = np.argsort(flat_tok, kind="stable")
    tok_sorted = flat_tok[order]
    starts = np.flatnonzero(np.r_[True, tok_sorted[1:] != tok_sorted[:-1]])
    dw[tok_sorted[starts]] = np.add.reduceat(flat_d[order], starts, axis=0)
    return dw


# ---------------------------------------------------------------------------------------------
# Linear: one (N, in) x (in, out) GEMM, its rows split over threads
# ---------------------------------------------------------------------------------------------
def linear_forward(x, w, gemm=split_gemm):
    r"""y = x W^T. x: (..., in); w: (out, in). Returns (y (..., out), ctx). ``gemm(a, b, out)``
    computes out = a b (the backends pass their own)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = np.empty((x2.shape[0], w.shape[0]), dtype=np.result_type(x, w))
    gemm(x2, w.T, y)
    return y.reshape(*x.shape[:-1], w.shape[0]), (x, w)


def linear_backward(dy, ctx, gemm=split_gemm):
    r"""dx = dy W, dW = dy^T x. Returns (dx (..., in), dW (out, in))."""
    x, w = ctx
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dt = np.result_type(dy, x, w)
    dx = np.empty((dy2.shape[0], w.shape[1]), dtype=dt)
    gemm(dy2, w, dx)
    dw = np.empty(w.shape, dtype=dt)
    gemm(dy2.T, x2, dw)  # rows of dW = output features
    return dx.reshape(*dy.shape[:-1], w.shape[1]), dw


# ---------------------------------------------------------------------------------------------
# Linear with a block-quantized (frozen) weight: W dequantized tile by tile
# ---------------------------------------------------------------------------------------------
#: rows of a quantized W dequantized at a time (the float tile is QUANT_TILE_ROWS x K)
QUANT_TILE_ROWS = 256


def _quant_tiles(w, dtype, lo: int = 0, hi: int | None = None):
    """(n0, n1, deq(W)[n0:n1]) for the row tiles of rows lo..hi of ``w``, each written into the
    same buffer."""
    N, K = w.shape
    hi = N if hi is None else hi
    buf = np.empty((min(hi - lo, QUANT_TILE_ROWS), K), dtype=dtype)
    for n0 in range(lo, hi, QUANT_TILE_ROWS):
        n1 = min(hi, n0 + QUANT_TILE_ROWS)
        yield n0, n1, dequantize_rows(w.qtype, w.data[n0:n1], K, out=buf[:n1 - n0])


def quant_linear_forward(x, w):
    r"""y = x \mathrm{deq}(W)^T, W a :class:`QuantMatrix` (N, K): per tile of rows n0..n1,
    y^T[n0:n1] = deq(W[n0:n1]) x^T (contiguous output rows). The rows of W are spread over the
    threads, each dequantizing its tiles into its own buffer. x: (..., K). Returns
    (y (..., N), ctx)."""
    N, K = w.shape
    x2 = x.reshape(-1, K)
    dt = np.result_type(x.dtype, np.float32)
    yt = np.empty((N, x2.shape[0]), dtype=dt)

    def rows(lo, hi):
        for n0, n1, t in _quant_tiles(w, dt, lo, hi):
            np.matmul(t, x2.T, out=yt[n0:n1])

    with blas_for_rows(N):
        parallel_rows(rows, N, N * K)
    return np.ascontiguousarray(yt.T).reshape(*x.shape[:-1], N), (x, w)


def quant_linear_backward(dy, ctx, gemm=split_gemm):
    r"""dx = dy \mathrm{deq}(W) = \sum_{tiles} dy[:, n0:n1] deq(W[n0:n1]); W is frozen (dW is
    None). dy: (..., N). Returns (dx (..., K), None)."""
    x, w = ctx
    N, K = w.shape
    dy2 = dy.reshape(-1, N)
    dt = np.result_type(dy.dtype, np.float32)
    dx = np.zeros((dy2.shape[0], K), dtype=dt)
    part = np.empty_like(dx)
    for n0, n1, t in _quant_tiles(w, dt):
        gemm(dy2[:, n0:n1], t, part)
        dx += part
    return dx.reshape(*dy.shape[:-1], K), None


# ---------------------------------------------------------------------------------------------
# RMSNorm, row blocks on threads
# ---------------------------------------------------------------------------------------------
def rmsnorm_forward(x, g, eps):
    r"""y = x r \odot g, r = 1/\sqrt{\mathrm{mean}(x^2) + \epsilon}. x: (..., D); g: (D,)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    N = x2.shape[0]
    y = np.empty((N, D), dtype=np.result_type(x, g))
    rstd = np.empty((N, 1), dtype=x.dtype)

    def rows(lo, hi):
        xs, r = x2[lo:hi], rstd[lo:hi]
        np.mean(xs * xs, axis=-1, keepdims=True, out=r)
        r += eps
        np.sqrt(r, out=r)
        np.reciprocal(r, out=r)
        ys = y[lo:hi]
        np.multiply(xs, r, out=ys)
        ys *= g

    parallel_rows(rows, N, x2.size)
    return y.reshape(x.shape), (x, rstd.reshape(*x.shape[:-1], 1), g)


def rmsnorm_backward(dy, ctx):
    r"""dx = r (u - \hat{x}\, \mathrm{mean}(u \odot \hat{x})), u = dy \odot g;
    dg = \sum_{rows} dy \odot \hat{x} (summed per thread block, then over blocks)."""
    x, rstd, g = ctx
    D = x.shape[-1]
    x2, dy2, r2 = x.reshape(-1, D), dy.reshape(-1, D), rstd.reshape(-1, 1)
    N = x2.shape[0]
    dx = np.empty((N, D), dtype=np.result_type(dy, x))
    partial_dg = {}

    def rows(lo, hi):
        r = r2[lo:hi]
        xhat = x2[lo:hi] * r
        t = dy2[lo:hi] * xhat
        partial_dg[lo] = t.sum(axis=0)
        u = dx[lo:hi]
        np.multiply(dy2[lo:hi], g, out=u)
        np.multiply(u, xhat, out=t)
        xhat *= np.mean(t, axis=-1, keepdims=True)
        u -= xhat
        u *= r

    parallel_rows(rows, N, x2.size)
    parts = [partial_dg[k] for k in sorted(partial_dg)]
    dg = parts[0]
    for part in parts[1:]:
        dg += part
    return dx.reshape(dy.shape), dg


# ---------------------------------------------------------------------------------------------
# RoPE as one complex product per pair
# ---------------------------------------------------------------------------------------------
def _rope_complex(x, cos, sin, sign: float):
    """y = R(sign * angle) x, the pair (x_{2i}, x_{2i+1}) read as the complex number
    x_{2i} + i x_{2i+1} times e^{i sign angle}: one SIMD pass, batch rows on threads. None when
    the dtypes do not allow the complex view (the caller then runs the reference)."""
    c = cos[None, :, None, :] if cos.ndim == 2 else cos[:, :, None, :]
    s = sin[None, :, None, :] if sin.ndim == 2 else sin[:, :, None, :]
    dt = np.result_type(x, c)
    if x.dtype != dt or dt not in (np.float32, np.float64) or x.shape[-1] % 2:
        return None
    cdt = np.complex64 if dt == np.float32 else np.complex128
    xc = np.ascontiguousarray(x).view(cdt)
    rot = np.empty(c.shape, dtype=cdt)
    rot.real, rot.imag = c, s if sign > 0 else -s
    y = np.empty(x.shape, dtype=dt)
    yc = y.view(cdt)

    def rows(lo, hi):
        np.multiply(xc[lo:hi], rot if rot.shape[0] == 1 else rot[lo:hi], out=yc[lo:hi])

    parallel_rows(rows, x.shape[0], x.size)
    return y


def rope_forward(x, cos, sin):
    r"""y_{2i} + i y_{2i+1} = (x_{2i} + i x_{2i+1}) e^{i m \theta_i}. x: (B, T, nh, hd)."""
    y = _rope_complex(x, cos, sin, 1.0)
    return (y, (cos, sin)) if y is not None else ops.rope_forward(x, cos, sin)


def rope_backward(dy, ctx):
    r"""dx_{2i} + i dx_{2i+1} = (dy_{2i} + i dy_{2i+1}) e^{-i m \theta_i}. dy: (B, T, nh, hd)."""
    cos, sin = ctx
    dx = _rope_complex(dy, cos, sin, -1.0)
    return dx if dx is not None else ops.rope_backward(dy, ctx)


# ---------------------------------------------------------------------------------------------
# Attention: whole sequences on threads, single-threaded GEMMs per (b, KV head)
# ---------------------------------------------------------------------------------------------
def _future_mask(T: int, S: int, start_pos):
    """True where key j lies in the future of query t (j > p_b + t), (1 or B, 1, 1, T, S); None
    when no key is in the future (a single query at the newest position, as in decoding)."""
    if np.ndim(start_pos) == 0 and S - 1 <= int(start_pos):
        return None
    return ~ops.causal_mask(np, T, S, start_pos)


def attention_forward(q, k, v, start_pos=0, segments=None):
    r"""S = Q K^T / \sqrt{hd} + M, P = \mathrm{softmax}(S), O = P V with GQA (see
    :func:`minillama.core.ops.attention_forward`). The G query heads of a group are stacked into one
    (G T, hd) matrix that multiplies their shared K/V: one GEMM per (b, KV head) for S, one for
    O; whole sequences are spread over threads. q: (B, T, H, hd); k, v: (B, S, KVH, hd);
    segments: None or (B, T) example ids of packed rows (M also hides other examples' keys)."""
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(hd)
    qs = np.empty((B, KVH, G, T, hd), dtype=q.dtype)  # the queries, pre-scaled by 1/sqrt(hd)
    q5 = q.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4)
    qs4 = qs.reshape(B, KVH, G * T, hd)
    kt = k.transpose(0, 2, 3, 1)  # (B, KVH, hd, S), a view
    vv = v.transpose(0, 2, 1, 3)  # (B, KVH, S, hd), a view
    dt = np.result_type(q, k, v)
    p = np.empty((B, KVH, G * T, S), dtype=dt)  # scores, turned into probabilities in place
    o = np.empty((B, KVH, G * T, hd), dtype=dt)
    future = (_future_mask(T, S, start_pos) if segments is None
              else ~ops.causal_mask(np, T, S, start_pos, segments=np.asarray(segments)))

    def rows(lo, hi):  # sequences lo..hi-1
        np.multiply(q5[lo:hi], scale, out=qs[lo:hi])
        pp = p[lo:hi]
        np.matmul(qs4[lo:hi], kt[lo:hi], out=pp)
        if future is not None:
            fm = future if future.shape[0] == 1 else future[lo:hi]
            np.copyto(pp.reshape(hi - lo, KVH, G, T, S), -np.inf, where=fm)
        pp -= np.max(pp, axis=-1, keepdims=True)
        np.exp(pp, out=pp)
        pp *= 1.0 / np.sum(pp, axis=-1, keepdims=True)
        np.matmul(pp, vv[lo:hi], out=o[lo:hi])

    with blas_for_rows(B):
        parallel_rows(rows, B, p.size)
    out = o.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return out, (qs4, kt, vv, p, o, scale)


def attention_backward(dout, ctx):
    r"""dP = dO V^T, dS = P \odot (dP - D), D_t = dO_t \cdot o_t, dQ = dS K / \sqrt{hd},
    dK = \sum_g dS^T Q / \sqrt{hd}, dV = \sum_g P^T dO; the group sums come free as the rows of
    one (G T, .) matrix. dout: (B, T, H, hd). Returns (dq, dk, dv)."""
    qs, kt, vv, p, o, scale = ctx
    B, KVH, GT, hd = qs.shape
    T, H = dout.shape[1], dout.shape[2]
    S = p.shape[-1]
    G = H // KVH
    dt = np.result_type(dout, p)
    do5 = dout.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4)
    do = np.empty((B, KVH, G, T, hd), dtype=dt)
    do4 = do.reshape(B, KVH, GT, hd)
    dv = np.empty((B, KVH, S, hd), dtype=dt)
    dk = np.empty((B, KVH, S, hd), dtype=dt)
    dq = np.empty((B, KVH, GT, hd), dtype=dt)
    ds = np.empty((B, KVH, GT, S), dtype=dt)

    def rows(lo, hi):  # sequences lo..hi-1
        d_o, d, pp = do4[lo:hi], ds[lo:hi], p[lo:hi]
        do[lo:hi] = do5[lo:hi]
        np.matmul(np.swapaxes(pp, -1, -2), d_o, out=dv[lo:hi])
        np.matmul(d_o, np.swapaxes(vv[lo:hi], -1, -2), out=d)  # dP, turned into dS in place
        d -= np.sum(d_o * o[lo:hi], axis=-1, keepdims=True)
        d *= pp
        np.matmul(d, np.swapaxes(kt[lo:hi], -1, -2), out=dq[lo:hi])
        dq[lo:hi] *= scale
        np.matmul(np.swapaxes(d, -1, -2), qs[lo:hi], out=dk[lo:hi])  # qs carries 1/sqrt(hd)

    with blas_for_rows(B):
        parallel_rows(rows, B, ds.size)
    dq = dq.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------
# SwiGLU, row blocks on threads, in place
# ---------------------------------------------------------------------------------------------
def swiglu_forward(a, b):
    r"""h = \mathrm{silu}(a) \odot b, \mathrm{silu}(a) = a \sigma(a). a, b: (..., F)."""
    F = a.shape[-1]
    a2, b2 = a.reshape(-1, F), b.reshape(-1, F)
    N = a2.shape[0]
    dt = np.result_type(a, b)
    s, silu, h = (np.empty((N, F), dtype=dt) for _ in range(3))

    def rows(lo, hi):
        aa, ss, sl = a2[lo:hi], s[lo:hi], silu[lo:hi]
        with np.errstate(over="ignore"):  # e^{-a} = inf for a << 0 gives sigma = 0, the limit
            np.negative(aa, out=ss)
            np.exp(ss, out=ss)
        ss += 1.0
        np.reciprocal(ss, out=ss)
        np.multiply(aa, ss, out=sl)
        np.multiply(sl, b2[lo:hi], out=h[lo:hi])

    parallel_rows(rows, N, a2.size)
    return h.reshape(a.shape), (a2, b2, s, silu)


def swiglu_backward(dh, ctx):
    r"""db = dh \odot \mathrm{silu}(a), da = dh \odot b \odot \sigma(a)(1 + a(1 - \sigma(a)));
    db is built in the saved silu buffer (call once per forward)."""
    a2, b2, s, silu = ctx
    dh2 = dh.reshape(-1, a2.shape[-1])
    N = a2.shape[0]
    da = np.empty((N, a2.shape[-1]), dtype=np.result_type(dh, s))

    def rows(lo, hi):
        d, ss, g = da[lo:hi], s[lo:hi], dh2[lo:hi]
        np.subtract(1.0, ss, out=d)  # 1 - sigma
        d *= a2[lo:hi]
        d += 1.0
        d *= ss
        d *= b2[lo:hi]
        d *= g
        silu[lo:hi] *= g  # db

    parallel_rows(rows, N, a2.size)
    return da.reshape(dh.shape), silu.reshape(dh.shape)


# ---------------------------------------------------------------------------------------------
# Softmax cross-entropy, row blocks on threads, in place
# ---------------------------------------------------------------------------------------------
def cross_entropy_forward(logits, targets, ignore_index: int = -1):
    r"""\ell_n = \log \sum_v e^{z_{nv}} - z_{n, y_n}, L = mean over the kept rows.
    logits: (N, V); targets: (N,). Saves the probabilities (N, V) for the backward."""
    valid = targets != ignore_index
    safe_t = np.where(valid, targets, 0)
    N = logits.shape[0]
    p = np.empty(logits.shape, dtype=logits.dtype)
    lse = np.empty(N, dtype=logits.dtype)

    def rows(lo, hi):
        z, pp = logits[lo:hi], p[lo:hi]
        m = np.max(z, axis=-1, keepdims=True)
        np.subtract(z, m, out=pp)
        np.exp(pp, out=pp)
        sumexp = np.sum(pp, axis=-1, keepdims=True)
        pp *= 1.0 / sumexp
        lse[lo:hi] = (np.log(sumexp) + m)[:, 0]

    parallel_rows(rows, N, logits.size)
    picked = np.take_along_axis(logits, safe_t[:, None], axis=-1)[:, 0]
    count = np.maximum(valid.sum(), 1)
    loss = np.sum(np.where(valid, lse - picked, 0.0)) / count
    return loss.astype(logits.dtype), (p, safe_t, valid, count)


def cross_entropy_backward(dloss, ctx):
    r"""dz_{nv} = (p_{nv} - [v = y_n]) dloss / |\mathcal{V}| for kept rows, 0 for ignored rows;
    built in the saved probability buffer (call once per forward)."""
    p, safe_t, valid, count = ctx
    N = p.shape[0]
    p[np.arange(N), safe_t] -= 1.0
    coef = ((np.asarray(dloss, dtype=p.dtype) / count) * valid).astype(p.dtype)[:, None]

    def rows(lo, hi):
        p[lo:hi] *= coef[lo:hi]

    parallel_rows(rows, N, p.size)
    return p


# ---------------------------------------------------------------------------------------------
# The loss head (output projection + cross-entropy) as one op, in blocks of rows
# ---------------------------------------------------------------------------------------------
#: numbers per block of logits (R rows x V) of the loss head: the softmax pass that turns a
#: block into its gradient in place follows its GEMM while the block is still in L3. Measured on
#: s15 (N 2048, V 32000, 2 threads): blocks of 32-128 rows make the GEMMs slower (each re-reads
#: the V x D head) than they save; from ~512 rows on the head costs its three GEMMs alone
LCE_BLOCK_ELEMENTS = 1 << 24


def xent_grad_rows(z, targets, valid, scale, row_loss) -> None:
    r"""In place, per row n of a block of logits: \ell_n = \mathrm{lse}(z_n) - z_{n, y_n} into
    ``row_loss`` and z_n \leftarrow (\mathrm{softmax}(z_n) - e_{y_n}) \cdot scale (kept rows;
    ignored rows get \ell_n = 0 and a zero row). z: (R, V); targets (safe ids), valid: (R,)."""
    R = z.shape[0]
    idx = np.arange(R)
    picked = z[idx, targets]
    m = np.max(z, axis=1, keepdims=True)
    z -= m
    np.exp(z, out=z)
    tot = np.sum(z, axis=1)
    row_loss[:] = np.where(valid, np.log(tot) + m[:, 0] - picked, 0.0)
    z *= np.where(valid, scale / tot, 0.0).astype(z.dtype)[:, None]
    z[idx, targets] -= np.where(valid, scale, 0.0).astype(z.dtype)


class _LCECtx:
    """What the fused loss head's backward needs: x, W, the logits gradient \bar{z} (N, V)
    (built by the forward; handed back to the backend's spare slot after the backward), dx."""

    __slots__ = ("x", "w", "dz", "dx")

    def __init__(self, x, w, dz, dx):
        self.x, self.w, self.dz, self.dx = x, w, dz, dx


class NumpyBackend(LoRAOps, ReferenceBackend):
    """NumPy on the CPU: the reference ops with the fast overrides of this module (threads,
    single-threaded BLAS, in-place buffers) and glibc malloc tuned once per process. Numba
    subclasses this and overrides only the op pairs it accelerates further."""

    name = "numpy"

    def __init__(self) -> None:
        super().__init__()
        tune_malloc()
        self._step_tuners: dict[int, ThreadTuner] = {}

    def _team(self, threads: int):
        """The pools of this backend's ops on ``threads`` threads, for a ``with`` block."""
        return team(threads)

    def threads(self, n: int):
        """The pools of this backend's ops on ``n`` threads in the ``with`` block."""
        return self._team(n)

    def decode_threads(self, B: int):
        """One cached decode step of B sequences on the thread count measured faster for B
        (every thread, or one when other processes take the cores:
        :mod:`minillama.backends.tuner`)."""
        tuner = self._step_tuners.get(B)
        if tuner is None:
            tuner = self._step_tuners[B] = ThreadTuner(self._most_threads())
        return tuner.step(self._team)

    def _most_threads(self) -> int:
        """The full thread count a decode step may run on (the row threads')."""
        return num_threads()

    #: out = a b for the linear layers' GEMMs (2-D a, b, out); the numba backend overrides it
    _gemm = staticmethod(split_gemm)

    def linear_forward(self, x, w):
        r"""y = x W^T (:func:`linear_forward`, its GEMM by :attr:`_gemm`); a quantized W by
        tiles (:func:`quant_linear_forward`)."""
        if isinstance(w, QuantMatrix):
            return quant_linear_forward(x, w)
        return linear_forward(x, w, self._gemm)

    def linear_backward(self, dy, ctx):
        r"""dx = dy W, dW = dy^T x (:func:`linear_backward`, its GEMMs by :attr:`_gemm`); a
        quantized W by tiles, no dW (:func:`quant_linear_backward`)."""
        if isinstance(ctx[1], QuantMatrix):
            return quant_linear_backward(dy, ctx, self._gemm)
        return linear_backward(dy, ctx, self._gemm)

    # the loss head ------------------------------------------------------------------------
    _xent_grad_rows = staticmethod(xent_grad_rows)
    _lce_spare = None

    def linear_cross_entropy_forward(self, x, w, targets, ignore_index: int = -1):
        r"""z = x W^T and L = \frac{1}{|\mathcal{V}|} \sum_{n \in \mathcal{V}} (\mathrm{lse}(z_n)
        - z_{n, y_n}) (see :func:`minillama.core.ops.linear_cross_entropy_forward`) in blocks of
        rows, the blocks spread over threads: each block's logits are computed by one GEMM
        into its rows of an (N, V) buffer, turned in place into the gradient of the mean loss
        \bar{z} = (\mathrm{softmax}(z) - e_y) / |\mathcal{V}| while in cache, and its dx rows
        \bar{z} W follow at once; the backward adds dW = \bar{z}^T x and scales both by dloss.
        The logits and their gradient share that one buffer, reused from call to call.
        x: (N, D); w: (V, D); targets: (N,). Returns (0-d loss, ctx)."""
        if isinstance(w, QuantMatrix):  # a frozen head: this backend's linear, then the loss
            return composed_linear_cross_entropy_forward(self, x, w, targets, ignore_index)
        dt = np.result_type(x, w)
        if (dt not in (np.float32, np.float64) or x.dtype != dt or w.dtype != dt or x.ndim != 2
                or w.ndim != 2 or x.shape[1] != w.shape[1] or 0 in x.shape or w.shape[0] == 0):
            return super().linear_cross_entropy_forward(x, w, targets, ignore_index)
        N, V = x.shape[0], w.shape[0]
        targets = np.asarray(targets).reshape(-1)
        if targets.shape[0] != N:
            raise MinillamaError(f"cross-entropy: {targets.shape[0]} targets for {N} rows")
        valid = targets != ignore_index
        safe_t = np.where(valid, targets, 0).astype(np.int64)
        if safe_t.min() < 0 or safe_t.max() >= V:
            raise MinillamaError(f"cross-entropy targets must lie in [0, {V}) or equal the "
                                 f"ignore index {ignore_index}")
        count = max(int(valid.sum()), 1)
        scale = dt.type(1.0 / count)
        dz, self._lce_spare = self._lce_spare, None
        if dz is None or dz.shape != (N, V) or dz.dtype != dt:
            dz = np.empty((N, V), dtype=dt)
        dx = np.empty(x.shape, dtype=dt)
        row_loss = np.empty(N, dtype=dt)
        self._lce_blocks(x, w, safe_t, valid, scale, dz, dx, row_loss,
                         max(1, LCE_BLOCK_ELEMENTS // V))
        loss = np.asarray(row_loss.sum(dtype=np.float64) / count, dtype=dt)
        return loss, _LCECtx(x, w, dz, dx)

    def _lce_blocks(self, x, w, targets, valid, scale, dz, dx, row_loss, R):
        """The loss head's forward work, rows in blocks of ``R`` on the threads of
        :func:`.threads.parallel_rows`: per block z = x W^T into dz, the gradient of the
        mean loss in place (:func:`xent_grad_rows`), its dx rows z W."""
        N, V = dz.shape
        wt, kernel = w.T, self._xent_grad_rows

        def rows(lo, hi):
            for r0 in range(lo, hi, R):
                r1 = min(hi, r0 + R)
                zb = dz[r0:r1]
                np.matmul(x[r0:r1], wt, out=zb)
                kernel(zb, targets[r0:r1], valid[r0:r1], scale, row_loss[r0:r1])
                np.matmul(zb, w, out=dx[r0:r1])

        with blas_for_rows(N):
            parallel_rows(rows, N, N * V)

    def linear_cross_entropy_backward(self, dloss, ctx):
        r"""dx = \bar{z} W (from the forward) and dW = \bar{z}^T x (one GEMM over the rows), both
        times dloss. Returns (dx (N, D), dW (V, D)). Once per forward."""
        if not isinstance(ctx, _LCECtx):  # the forward fell back to the composed ops
            if isinstance(ctx[0][1], QuantMatrix):
                return composed_linear_cross_entropy_backward(self, dloss, ctx)
            return super().linear_cross_entropy_backward(dloss, ctx)
        if ctx.dz is None:
            raise MinillamaError("linear_cross_entropy_backward: called twice for one forward")
        dz, dx = ctx.dz, ctx.dx
        ctx.dz = ctx.dx = None
        dw = np.empty(ctx.w.shape, dtype=dz.dtype)
        self._gemm(dz.T, ctx.x, dw)
        d = float(np.asarray(dloss))
        if d != 1.0:
            dx *= d
            dw *= d
        self._lce_spare = dz  # the next forward of this shape reuses the buffer
        return dx, dw

    def linear_cross_entropy_backward_input(self, dloss, ctx):
        r"""dx = \bar{z} W alone, times dloss, for a frozen head (the tied embedding of a LoRA
        step): the forward already formed it, and the (V, D) GEMM dW = \bar{z}^T x, as large as
        each of the forward's two, is skipped. Returns dx (N, D). Once per forward."""
        if not isinstance(ctx, _LCECtx) or ctx.dz is None:  # composed ops, or a second call
            return self.linear_cross_entropy_backward(dloss, ctx)[0]
        dz, dx = ctx.dz, ctx.dx
        ctx.dz = ctx.dx = None
        d = float(np.asarray(dloss))
        if d != 1.0:
            dx *= d
        self._lce_spare = dz
        return dx

    embedding_backward = staticmethod(embedding_backward)
    rmsnorm_forward = staticmethod(rmsnorm_forward)
    rmsnorm_backward = staticmethod(rmsnorm_backward)
    rope_forward = staticmethod(rope_forward)
    rope_backward = staticmethod(rope_backward)
    attention_forward = staticmethod(attention_forward)
    attention_backward = staticmethod(attention_backward)
    #: attention over packed rows (a segment mask): this pair, for the numba backend too
    attention_forward_packed = staticmethod(attention_forward)
    attention_backward_packed = staticmethod(attention_backward)
    swiglu_forward = staticmethod(swiglu_forward)
    swiglu_backward = staticmethod(swiglu_backward)
    cross_entropy_forward = staticmethod(cross_entropy_forward)
    cross_entropy_backward = staticmethod(cross_entropy_backward)
