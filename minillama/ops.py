r"""Reference math: every op of the LLaMA architecture as a forward and a backward, side by side.

This module is the project's math-to-code map. Each equation is one ``*_forward`` function and its
gradient is the ``*_backward`` function right below it. The code is written once against the array
module of its inputs (NumPy or CuPy), so the same lines run on every backend; the Numba and CUDA
backends replace single pairs with kernels that must agree with these.

Conventions
-----------
* ``*_forward(...)`` returns ``(out, ctx)``; ``ctx`` holds only what the backward needs and is
  opaque to callers (a backend may store different things for its own backward).
* ``*_backward(dout, ctx)`` returns the gradients of the forward's differentiable inputs, in order.
  A backward may consume its ``ctx`` (reuse its buffers); call it once.
* Size letters: B batch, T query time, S key time, D model dim, H query heads, KVH key/value
  heads, G = H / KVH query heads per KV head, hd head dim, F FFN hidden size, V vocabulary, N rows.
* Linear weights are stored ``(out, in)`` as in Meta's and llama2.c's checkpoints: y = x W^T.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np


def array_module(x: Any):
    """The array module (``numpy`` or ``cupy``) that owns ``x``; never imports CuPy for NumPy input."""
    if type(x).__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415 - only reached when x already is a CuPy array

        return cupy
    return np


# ---------------------------------------------------------------------------------------------
# Row-parallel elementwise work (NumPy arrays only)
# ---------------------------------------------------------------------------------------------
#: below this many elements an op runs in the calling thread (dispatch costs ~20 us)
PARALLEL_MIN_ELEMENTS = 1 << 16
_pool = None
_pool_lock = threading.Lock()


def num_threads() -> int:
    """Threads for the row-parallel elementwise parts of the NumPy ops: ``MINILLAMA_NUM_THREADS``,
    else ``OMP_NUM_THREADS``, else ``OPENBLAS_NUM_THREADS``, else the CPU count. BLAS calls are
    threaded by the BLAS library itself."""
    for var in ("MINILLAMA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def parallel_rows(fn, n_rows: int, n_elements: int, xp=np) -> None:
    """Call ``fn(lo, hi)`` on contiguous chunks covering rows [0, n_rows), in threads.

    NumPy releases the GIL inside ufuncs and reductions on large arrays, so chunks of an
    elementwise op run truly in parallel. Row-wise ops give bit-identical results however they
    are chunked. CuPy arrays (``xp`` not NumPy) and small ops run ``fn(0, n_rows)`` directly.
    """
    nt = min(num_threads(), n_rows)
    if xp is not np or nt <= 1 or n_elements < PARALLEL_MIN_ELEMENTS:
        fn(0, n_rows)
        return
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < nt - 1:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

            _pool = ThreadPoolExecutor(max_workers=nt - 1, thread_name_prefix="minillama-ops")
        pool = _pool
    step = -(-n_rows // nt)
    bounds = [(lo, min(lo + step, n_rows)) for lo in range(0, n_rows, step)]
    futures = [pool.submit(fn, lo, hi) for lo, hi in bounds[1:]]
    try:
        fn(*bounds[0])
    finally:
        for f in futures:
            f.result()


# ---------------------------------------------------------------------------------------------
# BLAS thread control (OpenBLAS as bundled with NumPy; a no-op anywhere else)
# ---------------------------------------------------------------------------------------------
_blas_api: Any = None


def _openblas_api():
    """(get, set) of the OpenBLAS that NumPy loaded, found by its exported symbols; None if the
    BLAS is not OpenBLAS or cannot be found (then thread control is a no-op)."""
    global _blas_api
    if _blas_api is not None:
        return _blas_api or None
    _blas_api = False
    try:
        import ctypes  # noqa: PLC0415

        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
        for path in paths:
            lib = ctypes.CDLL(path)
            for get_name, set_name in (
                    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                    ("openblas_get_num_threads", "openblas_set_num_threads")):
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    getter, setter = getattr(lib, get_name), getattr(lib, set_name)
                    getter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
                    _blas_api = (getter, setter)
                    return _blas_api
    except (OSError, ValueError, AttributeError):  # no /proc, odd paths: leave BLAS alone
        pass
    return None


class _NoOp:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _blas_for_rows(xp, n_rows: int):
    """single-threaded BLAS while :func:`parallel_rows` spreads ``n_rows`` over threads."""
    if xp is np and n_rows > 1 and num_threads() > 1:
        return single_threaded_blas()
    return _NoOp()


class single_threaded_blas:  # noqa: N801 - used like a function: ``with single_threaded_blas():``
    """Run the block with OpenBLAS on one thread, then restore its thread count.

    Attention is a stack of small GEMMs (one per sequence and KV head); letting OpenBLAS split
    each of them over its threads costs a synchronisation per GEMM, which dominates when the
    cores are busy. The NumPy ops instead give whole sequences to the threads of
    :func:`parallel_rows`, each running single-threaded GEMMs."""

    def __enter__(self):
        api = _openblas_api()
        self._restore = None
        if api is not None:
            n = api[0]()
            if n > 1:
                api[1](1)
                self._restore = n
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            _openblas_api()[1](self._restore)
        return False


# ---------------------------------------------------------------------------------------------
# Token embedding
# ---------------------------------------------------------------------------------------------
def embedding_forward(weight, tokens):
    r"""Token embedding lookup: h_{b,t} = E[x_{b,t}].

    weight: (V, D); tokens: (B, T) integers in [0, V). Returns h: (B, T, D).
    """
    return weight[tokens], (tokens, weight.shape)


def embedding_backward(dout, ctx):
    r"""Scatter-add of the output gradient into the rows that were read:
    \partial L / \partial E_v = \sum_{(b,t): x_{b,t} = v} \partial L / \partial h_{b,t}.

    dout: (B, T, D). Returns dE: (V, D).
    """
    tokens, shape = ctx
    xp = array_module(dout)
    dw = xp.zeros(shape, dtype=dout.dtype)
    flat_tok = tokens.reshape(-1)
    flat_d = dout.reshape(-1, shape[1])
    if xp is np and flat_tok.size >= shape[0]:
        # many repeats: sort the rows by token and sum each run with one reduceat
        order = np.argsort(flat_tok, kind="stable")
        tok_sorted = flat_tok[order]
        starts = np.flatnonzero(np.r_[True, tok_sorted[1:] != tok_sorted[:-1]])
        dw[tok_sorted[starts]] = np.add.reduceat(flat_d[order], starts, axis=0)
    elif xp is np:
        np.add.at(dw, flat_tok, flat_d)
    else:  # CuPy: atomic scatter-add
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(dw, flat_tok, flat_d)
    return dw


# ---------------------------------------------------------------------------------------------
# Linear (no bias)
# ---------------------------------------------------------------------------------------------
#: linear layers split their GEMMs over the threads of :func:`parallel_rows` (single-threaded
#: BLAS each) instead of leaving the threading to BLAS; see :func:`linear_forward`
THREADED_LINEAR = True


def _split_gemm(xp, a, b, out) -> None:
    """out = a @ b with the rows of ``a`` (and ``out``) spread over threads (NumPy), or one GEMM."""
    if THREADED_LINEAR and xp is np and a.shape[0] > 1 and num_threads() > 1:
        def rows(lo, hi):
            xp.matmul(a[lo:hi], b, out=out[lo:hi])

        with single_threaded_blas():
            parallel_rows(rows, a.shape[0], a.shape[0] * b.shape[1] * 8, xp)
    else:
        xp.matmul(a, b, out=out)


def linear_forward(x, w):
    r"""Linear map without bias: y = x W^T.

    x: (..., in); w: (out, in). Returns y: (..., out). The leading axes are flattened so that one
    GEMM of (N, in) x (in, out) runs instead of a stack of small ones; on NumPy its rows are
    split over threads (one synchronisation per GEMM, which matters on a busy machine).
    """
    xp = array_module(x)
    x2 = x.reshape(-1, x.shape[-1])
    y = xp.empty((x2.shape[0], w.shape[0]), dtype=xp.result_type(x, w))
    _split_gemm(xp, x2, w.T, y)
    return y.reshape(*x.shape[:-1], w.shape[0]), (x, w)


def linear_backward(dy, ctx):
    r"""Gradients of y = x W^T: dx = dy W, dW = dy^T x (summed over all leading axes).

    dy: (..., out). Returns (dx: (..., in), dW: (out, in)).
    """
    x, w = ctx
    xp = array_module(dy)
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dt = xp.result_type(dy, x, w)
    dx = xp.empty((dy2.shape[0], w.shape[1]), dtype=dt)
    _split_gemm(xp, dy2, w, dx)
    dw = xp.empty(w.shape, dtype=dt)
    _split_gemm(xp, dy2.T, x2, dw)  # rows of dW = output features
    return dx.reshape(*dy.shape[:-1], w.shape[1]), dw


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------
def rmsnorm_forward(x, g, eps):
    r"""RMSNorm: y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \odot g (mean over the last axis).

    x: (..., D); g: (D,). Returns y: (..., D). Saves r = 1/\sqrt{\mathrm{mean}(x^2)+\epsilon}: (..., 1).
    """
    xp = array_module(x)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    N = x2.shape[0]
    y = xp.empty((N, D), dtype=xp.result_type(x, g))
    rstd = xp.empty((N, 1), dtype=x.dtype)

    def rows(lo, hi):
        xs, r = x2[lo:hi], rstd[lo:hi]
        xp.mean(xs * xs, axis=-1, keepdims=True, out=r)
        r += eps
        xp.sqrt(r, out=r)
        xp.reciprocal(r, out=r)
        ys = y[lo:hi]
        xp.multiply(xs, r, out=ys)
        ys *= g

    parallel_rows(rows, N, x2.size, xp)
    return y.reshape(x.shape), (x, rstd.reshape(*x.shape[:-1], 1), g)


def rmsnorm_backward(dy, ctx):
    r"""Gradients of RMSNorm. With \hat{x} = x r and u = dy \odot g:
    dx = r (u - \hat{x}\, \mathrm{mean}(u \odot \hat{x})), dg = \sum_{rows} dy \odot \hat{x}.

    dy: (..., D). Returns (dx: (..., D), dg: (D,)).
    """
    x, rstd, g = ctx
    xp = array_module(dy)
    D = x.shape[-1]
    x2, dy2, r2 = x.reshape(-1, D), dy.reshape(-1, D), rstd.reshape(-1, 1)
    N = x2.shape[0]
    dx = xp.empty((N, D), dtype=xp.result_type(dy, x))
    partial_dg = {}

    def rows(lo, hi):
        r = r2[lo:hi]
        xhat = x2[lo:hi] * r
        t = dy2[lo:hi] * xhat
        partial_dg[lo] = t.sum(axis=0)
        u = dx[lo:hi]
        xp.multiply(dy2[lo:hi], g, out=u)
        xp.multiply(u, xhat, out=t)
        xhat *= xp.mean(t, axis=-1, keepdims=True)
        u -= xhat
        u *= r

    parallel_rows(rows, N, x2.size, xp)
    parts = [partial_dg[k] for k in sorted(partial_dg)]
    dg = parts[0]
    for part in parts[1:]:
        dg += part
    return dx.reshape(dy.shape), dg


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (RoPE), interleaved pairs (2i, 2i+1) as in Meta's and llama2.c's code
# ---------------------------------------------------------------------------------------------
def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0, dtype=np.float32, xp=np):
    r"""The cos/sin tables of RoPE: \theta_i = \mathrm{base}^{-2i/hd}, angle_{m,i} = m \theta_i.

    Computed in float64 and cast to ``dtype``. Returns (cos, sin), each (max_seq_len, hd/2).
    """
    if head_dim % 2:
        from .errors import MinillamaError  # noqa: PLC0415

        raise MinillamaError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)
    return xp.asarray(np.cos(angles), dtype=dtype), xp.asarray(np.sin(angles), dtype=dtype)


def _rope_broadcast(c, x):
    # (T, hd/2) -> (1, T, 1, hd/2); (B, T, hd/2) -> (B, T, 1, hd/2)
    return c[None, :, None, :] if c.ndim == 2 else c[:, :, None, :]


def _rope_rotate(x, cos, sin, sign: float):
    """y = R(sign * angle) x over the pairs of the last axis, chunked over the batch axis."""
    xp = array_module(x)
    c, s = _rope_broadcast(cos, x), _rope_broadcast(sin, x)
    dt = xp.result_type(x, c)
    if xp is np and x.dtype == dt and dt in (np.float32, np.float64) and x.shape[-1] % 2 == 0:
        # the pair (x_{2i}, x_{2i+1}) is the complex number x_{2i} + i x_{2i+1}, and the rotation
        # is one complex product with e^{i sign angle}: a single SIMD pass
        cdt = np.complex64 if dt == np.float32 else np.complex128
        xc = np.ascontiguousarray(x).view(cdt)
        rot = np.empty(c.shape, dtype=cdt)
        rot.real, rot.imag = c, s if sign > 0 else -s
        y = np.empty(x.shape, dtype=dt)
        yc = y.view(cdt)

        def crows(lo, hi):
            np.multiply(xc[lo:hi], rot if rot.shape[0] == 1 else rot[lo:hi], out=yc[lo:hi])

        parallel_rows(crows, x.shape[0], x.size, xp)
        return y
    y = xp.empty(x.shape, dtype=dt)

    def rows(lo, hi):
        cc = c if c.shape[0] == 1 else c[lo:hi]
        ss = s if s.shape[0] == 1 else s[lo:hi]
        x0, x1 = x[lo:hi, ..., 0::2], x[lo:hi, ..., 1::2]
        y0, y1 = y[lo:hi, ..., 0::2], y[lo:hi, ..., 1::2]
        xp.multiply(x0, cc, out=y0)
        xp.multiply(x1, cc, out=y1)
        if sign > 0:  # (x0 c - x1 s, x0 s + x1 c)
            y0 -= x1 * ss
            y1 += x0 * ss
        else:  # (x0 c + x1 s, -x0 s + x1 c)
            y0 += x1 * ss
            y1 -= x0 * ss

    parallel_rows(rows, x.shape[0], x.size, xp)
    return y


def rope_forward(x, cos, sin):
    r"""Rotate each pair (x_{2i}, x_{2i+1}) of every head by the angle m \theta_i of its position m:

    y_{2i} = x_{2i} \cos(m\theta_i) - x_{2i+1} \sin(m\theta_i),
    y_{2i+1} = x_{2i} \sin(m\theta_i) + x_{2i+1} \cos(m\theta_i).

    x: (B, T, nh, hd); cos, sin: (T, hd/2) or (B, T, hd/2), already gathered at the positions.
    Returns y: (B, T, nh, hd).
    """
    return _rope_rotate(x, cos, sin, 1.0), (cos, sin)


def rope_backward(dy, ctx):
    r"""RoPE is orthogonal, so its gradient is the inverse rotation R(-m\theta_i):

    dx_{2i} = dy_{2i} \cos + dy_{2i+1} \sin, dx_{2i+1} = -dy_{2i} \sin + dy_{2i+1} \cos.

    dy: (B, T, nh, hd). Returns dx: (B, T, nh, hd).
    """
    cos, sin = ctx
    return _rope_rotate(dy, cos, sin, -1.0)


# ---------------------------------------------------------------------------------------------
# Causal scaled dot-product attention with grouped KV heads (MHA / GQA / MQA)
# ---------------------------------------------------------------------------------------------
def causal_mask(xp, T: int, S: int, start_pos):
    r"""Boolean mask M_{b,t,j} = [j \le p_b + t]: query t of sequence b sits at absolute position
    p_b + t and may read keys 0..p_b + t. ``start_pos`` is an int or a (B,) integer array.

    Returns a (1 or B, 1, 1, T, S) array that broadcasts over (B, KVH, G, T, S).
    """
    start = xp.asarray(start_pos).reshape(-1, 1, 1)  # (B or 1, 1, 1)
    t = xp.arange(T).reshape(1, T, 1)
    j = xp.arange(S).reshape(1, 1, S)
    return (j <= start + t)[:, None, None, :, :]


def softmax(x, axis: int = -1):
    r"""Softmax with the row maximum subtracted: p_j = e^{x_j - m} / \sum_k e^{x_k - m},
    m = \max_k x_k. Entries equal to -inf get probability 0. Any shape; reduces ``axis``."""
    xp = array_module(x)
    m = xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(x - m)
    return e / xp.sum(e, axis=axis, keepdims=True)


def _future_mask(xp, T: int, S: int, start_pos):
    """True where key j lies in the future of query t (j > p_b + t), (1 or B, 1, 1, T, S); None
    when no key is in the future (a single query at the newest position, as in decoding)."""
    if np.ndim(start_pos) == 0 and S - 1 <= int(start_pos):
        return None
    return ~causal_mask(xp, T, S, start_pos)


def attention_forward(q, k, v, start_pos=0):
    r"""Causal scaled dot-product attention where query head h reads KV head h // G, G = H / KVH:

    S_{tj} = q_t \cdot k_j / \sqrt{hd}  (set to -\infty where j > p + t),
    P = \mathrm{softmax}_j(S),  o_t = \sum_j P_{tj} v_j.

    q: (B, T, H, hd); k, v: (B, S, KVH, hd) with S >= T (S > T when earlier positions come from a
    KV cache); start_pos: int or (B,) ints, the absolute position of query 0. Returns o: (B, T, H, hd).
    The G query heads of a group are stacked into one (G T, hd) matrix that multiplies their
    shared K/V (no repeated K/V is built): one GEMM per (b, KV head) for S, one for o. On NumPy,
    whole sequences are spread over threads, each running single-threaded GEMMs.
    """
    xp = array_module(q)
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(hd)
    qs = xp.empty((B, KVH, G, T, hd), dtype=q.dtype)  # the queries, pre-scaled by 1/sqrt(hd)
    q5 = q.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4)
    qs4 = qs.reshape(B, KVH, G * T, hd)
    kt = k.transpose(0, 2, 3, 1)  # (B, KVH, hd, S), a view
    vv = v.transpose(0, 2, 1, 3)  # (B, KVH, S, hd), a view
    dt = xp.result_type(q, k, v)
    p = xp.empty((B, KVH, G * T, S), dtype=dt)  # scores, turned into probabilities in place
    o = xp.empty((B, KVH, G * T, hd), dtype=dt)
    future = _future_mask(xp, T, S, start_pos)

    def rows(lo, hi):  # sequences lo..hi-1
        xp.multiply(q5[lo:hi], scale, out=qs[lo:hi])
        pp = p[lo:hi]
        xp.matmul(qs4[lo:hi], kt[lo:hi], out=pp)
        if future is not None:
            fm = future if future.shape[0] == 1 else future[lo:hi]
            xp.copyto(pp.reshape(hi - lo, KVH, G, T, S), -xp.inf, where=fm)
        pp -= xp.max(pp, axis=-1, keepdims=True)
        xp.exp(pp, out=pp)
        pp *= 1.0 / xp.sum(pp, axis=-1, keepdims=True)
        xp.matmul(pp, vv[lo:hi], out=o[lo:hi])

    with _blas_for_rows(xp, B):
        parallel_rows(rows, B, p.size, xp)
    out = o.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return out, (qs4, kt, vv, p, o, scale)


def attention_backward(dout, ctx):
    r"""Gradients of causal GQA attention. With dO the output gradient and
    D_t = \sum_j P_{tj} dP_{tj} = dO_t \cdot o_t:

    dP = dO V^T,  dS = P \odot (dP - D),  dQ = dS K / \sqrt{hd},
    dK = \sum_{g \in group} dS^T Q / \sqrt{hd},  dV = \sum_{g \in group} P^T dO.

    The group sums come for free: the G heads of a group are the rows of one (G T, .) matrix.
    dout: (B, T, H, hd). Returns (dq: (B, T, H, hd), dk, dv: (B, S, KVH, hd)).
    """
    qs, kt, vv, p, o, scale = ctx
    xp = array_module(dout)
    B, KVH, GT, hd = qs.shape
    T, H = dout.shape[1], dout.shape[2]
    S = p.shape[-1]
    G = H // KVH
    dt = xp.result_type(dout, p)
    do5 = dout.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4)
    do = xp.empty((B, KVH, G, T, hd), dtype=dt)
    do4 = do.reshape(B, KVH, GT, hd)
    dv = xp.empty((B, KVH, S, hd), dtype=dt)
    dk = xp.empty((B, KVH, S, hd), dtype=dt)
    dq = xp.empty((B, KVH, GT, hd), dtype=dt)
    ds = xp.empty((B, KVH, GT, S), dtype=dt)

    def rows(lo, hi):  # sequences lo..hi-1
        d_o, d, pp = do4[lo:hi], ds[lo:hi], p[lo:hi]
        do[lo:hi] = do5[lo:hi]
        xp.matmul(xp.swapaxes(pp, -1, -2), d_o, out=dv[lo:hi])
        xp.matmul(d_o, xp.swapaxes(vv[lo:hi], -1, -2), out=d)  # dP, turned into dS in place
        d -= xp.sum(d_o * o[lo:hi], axis=-1, keepdims=True)
        d *= pp
        xp.matmul(d, xp.swapaxes(kt[lo:hi], -1, -2), out=dq[lo:hi])
        dq[lo:hi] *= scale
        xp.matmul(xp.swapaxes(d, -1, -2), qs[lo:hi], out=dk[lo:hi])  # qs carries 1/sqrt(hd)

    with _blas_for_rows(xp, B):
        parallel_rows(rows, B, ds.size, xp)
    dq = dq.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------
# SwiGLU gate
# ---------------------------------------------------------------------------------------------
def sigmoid(a):
    r"""\sigma(a) = 1 / (1 + e^{-a}). For a very negative, e^{-a} overflows to +inf and the result
    is the correct limit 0 (the overflow warning is silenced); accurate in both tails."""
    xp = array_module(a)
    with np.errstate(over="ignore"):
        e = xp.negative(a)
        xp.exp(e, out=e)
    e += 1.0
    return xp.reciprocal(e, out=e)


def swiglu_forward(a, b):
    r"""SwiGLU gate: h = \mathrm{silu}(a) \odot b, \mathrm{silu}(a) = a \sigma(a).

    In the FFN, a = x W_1^T and b = x W_3^T, and the block returns h W_2^T.
    a, b: (..., F). Returns h: (..., F). Saves a, b, \sigma(a) and silu(a).
    """
    xp = array_module(a)
    F = a.shape[-1]
    a2, b2 = a.reshape(-1, F), b.reshape(-1, F)
    N = a2.shape[0]
    dt = xp.result_type(a, b)
    s, silu, h = (xp.empty((N, F), dtype=dt) for _ in range(3))

    def rows(lo, hi):
        aa, ss, sl = a2[lo:hi], s[lo:hi], silu[lo:hi]
        with np.errstate(over="ignore"):  # e^{-a} = inf for a << 0 gives sigma = 0, the limit
            xp.negative(aa, out=ss)
            xp.exp(ss, out=ss)
        ss += 1.0
        xp.reciprocal(ss, out=ss)
        xp.multiply(aa, ss, out=sl)
        xp.multiply(sl, b2[lo:hi], out=h[lo:hi])

    parallel_rows(rows, N, a2.size, xp)
    return h.reshape(a.shape), (a2, b2, s, silu)


def swiglu_backward(dh, ctx):
    r"""Gradients of h = \mathrm{silu}(a) \odot b:
    db = dh \odot \mathrm{silu}(a), da = dh \odot b \odot \sigma(a)(1 + a(1 - \sigma(a))).

    dh: (..., F). Returns (da, db), each (..., F) (db is built in the saved silu buffer).
    """
    a2, b2, s, silu = ctx
    xp = array_module(dh)
    dh2 = dh.reshape(-1, a2.shape[-1])
    N = a2.shape[0]
    da = xp.empty((N, a2.shape[-1]), dtype=xp.result_type(dh, s))

    def rows(lo, hi):
        d, ss, g = da[lo:hi], s[lo:hi], dh2[lo:hi]
        xp.subtract(1.0, ss, out=d)  # 1 - sigma
        d *= a2[lo:hi]
        d += 1.0
        d *= ss
        d *= b2[lo:hi]
        d *= g
        silu[lo:hi] *= g  # db

    parallel_rows(rows, N, a2.size, xp)
    return da.reshape(dh.shape), silu.reshape(dh.shape)


# ---------------------------------------------------------------------------------------------
# Softmax cross-entropy (fused), with an ignore index
# ---------------------------------------------------------------------------------------------
def cross_entropy_forward(logits, targets, ignore_index: int = -1):
    r"""Mean softmax cross-entropy over the rows whose target is not ``ignore_index``:

    \ell_n = \log \sum_v e^{z_{nv}} - z_{n, y_n},  L = \frac{1}{|\mathcal{V}|} \sum_{n \in \mathcal{V}} \ell_n

    (L = 0 when every target is ignored). logits: (N, V); targets: (N,) integers.
    Returns the scalar loss (a 0-d array) and saves the probabilities for the backward.
    """
    xp = array_module(logits)
    valid = targets != ignore_index
    safe_t = xp.where(valid, targets, 0)
    N = logits.shape[0]
    p = xp.empty(logits.shape, dtype=logits.dtype)
    lse = xp.empty(N, dtype=logits.dtype)

    def rows(lo, hi):
        z, pp = logits[lo:hi], p[lo:hi]
        m = xp.max(z, axis=-1, keepdims=True)
        xp.subtract(z, m, out=pp)
        xp.exp(pp, out=pp)
        sumexp = xp.sum(pp, axis=-1, keepdims=True)
        pp *= 1.0 / sumexp
        lse[lo:hi] = (xp.log(sumexp) + m)[:, 0]

    parallel_rows(rows, N, logits.size, xp)
    picked = xp.take_along_axis(logits, safe_t[:, None], axis=-1)[:, 0]
    count = xp.maximum(valid.sum(), 1)
    loss = xp.sum(xp.where(valid, lse - picked, 0.0)) / count
    return loss.astype(logits.dtype), (p, safe_t, valid, count)


def cross_entropy_backward(dloss, ctx):
    r"""Gradient of the mean cross-entropy: \partial L / \partial z_{nv} = (p_{nv} - [v = y_n]) / |\mathcal{V}|
    for kept rows, 0 for ignored rows, times the upstream scalar ``dloss``.

    Returns dlogits: (N, V) (built in the saved probability buffer).
    """
    p, safe_t, valid, count = ctx
    xp = array_module(p)
    N = p.shape[0]
    p[xp.arange(N), safe_t] -= 1.0
    coef = ((xp.asarray(dloss, dtype=p.dtype) / count) * valid).astype(p.dtype)[:, None]

    def rows(lo, hi):
        p[lo:hi] *= coef[lo:hi]

    parallel_rows(rows, N, p.size, xp)
    return p


# =============================================================================================
# The notes' other pieces (what LLaMA chose against): LayerNorm, BatchNorm, absolute sinusoidal
# positions, GELU/ReLU two-matrix FFNs, the post-norm residual, the logit scale, cross-attention
# and the latent array of a Perceiver-style block. Plain bodies, array-module generic.
# =============================================================================================
def _norm_backward(dy, xhat, r, g, axes):
    r"""Shared backward of y = \hat{x} \odot g (+ b), \hat{x} = (x - \mu) r, statistics over
    ``axes``: dx = r (u - \mathrm{mean}(u) - \hat{x}\,\mathrm{mean}(u \odot \hat{x})), u = dy \odot g."""
    u = dy * g
    return r * (u - u.mean(axis=axes, keepdims=True)
                - xhat * (u * xhat).mean(axis=axes, keepdims=True))


def layernorm_forward(x, g, b, eps):
    r"""LayerNorm over the last axis (biased variance):

    \mu = \mathrm{mean}(x), \sigma^2 = \mathrm{mean}((x - \mu)^2), \hat{x} = (x - \mu) / \sqrt{\sigma^2 + \epsilon},
    y = \hat{x} \odot g + b.

    x: (..., D); g, b: (D,). Returns y: (..., D). Saves \hat{x} and r = 1/\sqrt{\sigma^2+\epsilon}: (..., 1).
    """
    xp = array_module(x)
    xc = x - x.mean(axis=-1, keepdims=True)
    r = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * r
    return xhat * g + b, (xhat, r, g)


def layernorm_backward(dy, ctx):
    r"""Gradients of LayerNorm, u = dy \odot g:
    dx = r (u - \mathrm{mean}(u) - \hat{x}\,\mathrm{mean}(u \odot \hat{x})),
    dg = \sum_{rows} dy \odot \hat{x}, db = \sum_{rows} dy.

    dy: (..., D). Returns (dx: (..., D), dg: (D,), db: (D,)).
    """
    xhat, r, g = ctx
    rows = tuple(range(dy.ndim - 1))
    return (_norm_backward(dy, xhat, r, g, -1), (dy * xhat).sum(axis=rows), dy.sum(axis=rows))


def _bn_axes_shape(x):
    """BatchNorm's reduced axes (every axis but 1) and the broadcast shape (1, C, 1, ...)."""
    return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)


def batchnorm_forward(x, g, b, eps, running=None, momentum=0.1):
    r"""BatchNorm, training mode: per channel c, statistics over the batch and every spatial axis,

    \mu_c = \mathrm{mean}_{n,*}(x_{n,c,*}), \sigma_c^2 = \mathrm{mean}_{n,*}((x - \mu_c)^2) (biased),
    y = (x - \mu_c)/\sqrt{\sigma_c^2 + \epsilon} \odot g_c + b_c.

    x: (N, C) or (N, C, *spatial); g, b: (C,). Returns y shaped like x. ``running`` (a dict with
    ``mean`` and ``var``, each (C,)) is updated in place as PyTorch does:
    m \leftarrow (1 - \mathrm{momentum})\, m + \mathrm{momentum}\, \mu,
    v \leftarrow (1 - \mathrm{momentum})\, v + \mathrm{momentum}\, \sigma^2 n/(n-1) (unbiased),
    n = the number of values per channel. Inference uses :func:`batchnorm_inference`.
    """
    xp = array_module(x)
    axes, shape = _bn_axes_shape(x)
    mu = x.mean(axis=axes, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=axes, keepdims=True)
    r = 1.0 / xp.sqrt(var + eps)
    xhat = xc * r
    if running is not None:
        n = x.size // x.shape[1]
        running["mean"] *= 1.0 - momentum
        running["mean"] += momentum * mu.reshape(-1)
        running["var"] *= 1.0 - momentum
        running["var"] += momentum * var.reshape(-1) * (n / max(n - 1, 1))
    return xhat * g.reshape(shape) + b.reshape(shape), (xhat, r, g.reshape(shape), axes)


def batchnorm_backward(dy, ctx):
    r"""Gradients of training-mode BatchNorm: the formula of LayerNorm's backward with the means
    over (N, *spatial) instead of D, because every sample's output depends on the whole batch:
    dx = r (u - \mathrm{mean}(u) - \hat{x}\,\mathrm{mean}(u \odot \hat{x})), u = dy \odot g;
    dg_c = \sum_{n,*} dy \odot \hat{x}, db_c = \sum_{n,*} dy.

    dy shaped like x. Returns (dx, dg: (C,), db: (C,)).
    """
    xhat, r, g, axes = ctx
    return (_norm_backward(dy, xhat, r, g, axes), (dy * xhat).sum(axis=axes),
            dy.sum(axis=axes))


def batchnorm_inference(x, g, b, running_mean, running_var, eps):
    r"""BatchNorm at inference: the running statistics replace the batch's, so each sample is
    normalised on its own: y = (x - m_c) / \sqrt{v_c + \epsilon} \odot g_c + b_c.

    x: (N, C, *spatial); g, b, running_mean, running_var: (C,). Returns y shaped like x.
    """
    xp = array_module(x)
    _, shape = _bn_axes_shape(x)
    scale = g / xp.sqrt(running_var + eps)
    return (x - running_mean.reshape(shape)) * scale.reshape(shape) + b.reshape(shape)


def sinusoidal_positions(max_seq_len: int, dim: int, base: float = 10000.0, dtype=np.float32,
                         xp=np):
    r"""The vanilla transformer's absolute positional encoding (Vaswani et al., 2017), added to
    the token embeddings (h_0 = E[x] + P):

    P_{p, 2i} = \sin(p / \mathrm{base}^{2i/D}),  P_{p, 2i+1} = \cos(p / \mathrm{base}^{2i/D}).

    Computed in float64 and cast. Returns P: (max_seq_len, D). D must be even.
    """
    if dim % 2:
        from .errors import MinillamaError  # noqa: PLC0415

        raise MinillamaError(f"sinusoidal positions need an even model dimension, got {dim}")
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64),
                      base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim))
    table = np.empty((max_seq_len, dim))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return xp.asarray(table, dtype=dtype)


#: \sqrt{2/\pi}, the constant of GELU's tanh form
_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_forward(a):
    r"""GELU in its tanh form (GPT-2, BERT; PyTorch's ``approximate="tanh"``):

    \mathrm{gelu}(a) = \tfrac12 a (1 + \tanh u),  u = \sqrt{2/\pi}(a + 0.044715 a^3).

    a: (..., F). Returns h: (..., F). Saves a and \tanh u.
    """
    xp = array_module(a)
    t = xp.tanh(_GELU_C * (a + 0.044715 * a * a * a))
    return 0.5 * a * (1.0 + t), (a, t)


def gelu_backward(dh, ctx):
    r"""d\,\mathrm{gelu}/da = \tfrac12 (1 + \tanh u) + \tfrac12 a (1 - \tanh^2 u) \sqrt{2/\pi}(1 + 3 \cdot 0.044715 a^2).

    dh: (..., F). Returns da: (..., F).
    """
    a, t = ctx
    return dh * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _GELU_C * (1.0 + 0.134145 * a * a))


def relu_forward(a):
    r"""\mathrm{relu}(a) = \max(a, 0). a: (..., F). Returns h: (..., F); saves the mask a > 0."""
    mask = a > 0
    return a * mask, mask


def relu_backward(dh, ctx):
    r"""da = dh \odot [a > 0] (the subgradient 0 at a = 0). Returns da: (..., F)."""
    return dh * ctx


#: the activations of the two-matrix FFN, by config name
ACTIVATIONS = {"gelu": (gelu_forward, gelu_backward), "relu": (relu_forward, relu_backward)}


def mlp_forward(x, w1, w2, activation: str = "gelu"):
    r"""The classic two-matrix FFN: y = \phi(x W_1^T) W_2^T, \phi = GELU or ReLU.

    x: (..., D); w1: (F, D); w2: (D, F). Returns y: (..., D).
    """
    act_fwd, act_bwd = ACTIVATIONS[activation]
    a, c1 = linear_forward(x, w1)
    h, ca = act_fwd(a)
    y, c2 = linear_forward(h, w2)
    return y, (c1, ca, act_bwd, c2)


def mlp_backward(dy, ctx):
    r"""dh = dy W_2, dW_2 = dy^T h; da = \phi'(a) \odot dh; dx = da W_1, dW_1 = da^T x.

    dy: (..., D). Returns (dx: (..., D), dw1: (F, D), dw2: (D, F)).
    """
    c1, ca, act_bwd, c2 = ctx
    dh, dw2 = linear_backward(dy, c2)
    dx, dw1 = linear_backward(act_bwd(dh, ca), c1)
    return dx, dw1, dw2


def postnorm_residual_forward(x, fx, g, b, eps):
    r"""The post-norm residual (the original transformer's): y = \mathrm{Norm}(x + F(x)), with
    LayerNorm when a bias ``b`` is given and RMSNorm when ``b`` is None. (Pre-norm, LLaMA's, is
    y = x + F(\mathrm{Norm}(x)): the skip path bypasses the norm.)

    x, fx: (..., D) (fx = F(x), computed by the caller); g, b: (D,). Returns y: (..., D).
    """
    s = x + fx
    if b is None:
        y, c = rmsnorm_forward(s, g, eps)
    else:
        y, c = layernorm_forward(s, g, b, eps)
    return y, (b is None, c)


def postnorm_residual_backward(dy, ctx):
    r"""ds = \mathrm{Norm}'(dy); the sum sends ds to both x and F(x): dx = ds, dfx = ds.
    Every gradient passes through the norm (no identity path as in pre-norm).

    Returns (dx, dfx, dg, db) (db is None for RMSNorm).
    """
    rms, c = ctx
    if rms:
        ds, dg = rmsnorm_backward(dy, c)
        db = None
    else:
        ds, dg, db = layernorm_backward(dy, c)
    return ds, ds.copy(), dg, db


def logit_scale_forward(z, scale: float):
    r"""Scaled logits z' = s z. Without it std(z) grows like \sqrt{D}\,\sigma for unit-RMS
    features and weights of std \sigma; s = 1/\sqrt{D} keeps it flat. z: (..., V)."""
    return z * scale, scale


def logit_scale_backward(dz, ctx):
    r"""dz = s\, dz'. Returns dz: (..., V)."""
    return dz * ctx


def cross_attention_forward(q, k, v):
    r"""Scaled dot-product cross-attention, no mask: M queries of one sequence against L keys and
    values of another; query head h reads KV head h // G (G = H / KVH, so MHA, GQA and MQA):

    S_{mj} = q_m \cdot k_j / \sqrt{hd},  P = \mathrm{softmax}_j(S),  o_m = \sum_j P_{mj} v_j.

    q: (B, M, H, hd); k, v: (B, L, KVH, hd). Returns o: (B, M, H, hd). Cost O(B H M L hd).
    """
    xp = array_module(q)
    B, M, H, hd = q.shape
    KVH = k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(hd)
    qg = (q * scale).reshape(B, M, KVH, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * M, hd)
    kk = k.transpose(0, 2, 1, 3)  # (B, KVH, L, hd)
    vv = v.transpose(0, 2, 1, 3)
    p = softmax(qg @ xp.swapaxes(kk, -1, -2))  # (B, KVH, G M, L)
    o = p @ vv  # (B, KVH, G M, hd)
    out = o.reshape(B, KVH, G, M, hd).transpose(0, 3, 1, 2, 4).reshape(B, M, H, hd)
    return out, (qg, kk, vv, p, o, scale)


def cross_attention_backward(dout, ctx):
    r"""Gradients of cross-attention, D_m = dO_m \cdot o_m:
    dV = P^T dO, dS = P \odot (dO V^T - D), dQ = dS K / \sqrt{hd}, dK = dS^T Q / \sqrt{hd}
    (the G heads of a group are rows of one matrix, so dK, dV sum over the group).

    dout: (B, M, H, hd). Returns (dq: (B, M, H, hd), dk, dv: (B, L, KVH, hd)).
    """
    qg, kk, vv, p, o, scale = ctx
    xp = array_module(dout)
    B, M, H, hd = dout.shape
    KVH = kk.shape[1]
    G = H // KVH
    do = dout.reshape(B, M, KVH, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * M, hd)
    dv = xp.swapaxes(p, -1, -2) @ do
    ds = p * (do @ xp.swapaxes(vv, -1, -2) - (do * o).sum(axis=-1, keepdims=True))
    dq = (ds @ kk) * scale
    dk = xp.swapaxes(ds, -1, -2) @ qg  # qg carries 1/sqrt(hd)
    dq = dq.reshape(B, KVH, G, M, hd).transpose(0, 3, 1, 2, 4).reshape(B, M, H, hd)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def latent_expand_forward(z, batch_size: int):
    r"""The learned latent array Z: (M, D), shared by every sequence: z_b = Z for b < B.
    Returns (B, M, D) (a broadcast view; do not write into it)."""
    xp = array_module(z)
    return xp.broadcast_to(z, (batch_size,) + z.shape), None


def latent_expand_backward(dz, ctx):
    r"""dZ = \sum_b dz_b: each sequence's gradient flows into the one shared array. Returns (M, D)."""
    return dz.sum(axis=0)
