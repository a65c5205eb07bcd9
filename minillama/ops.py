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
from typing import Any

import numpy as np


def array_module(x: Any):
    """The array module (``numpy`` or ``cupy``) that owns ``x``; never imports CuPy for NumPy input."""
    if type(x).__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415 - only reached when x already is a CuPy array

        return cupy
    return np


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
    if xp is np:
        np.add.at(dw, flat_tok, flat_d)
    else:  # CuPy: atomic scatter-add
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(dw, flat_tok, flat_d)
    return dw


# ---------------------------------------------------------------------------------------------
# Linear (no bias)
# ---------------------------------------------------------------------------------------------
def linear_forward(x, w):
    r"""Linear map without bias: y = x W^T.

    x: (..., in); w: (out, in). Returns y: (..., out). The leading axes are flattened so that one
    GEMM of (N, in) x (in, out) runs instead of a stack of small ones.
    """
    y = x.reshape(-1, x.shape[-1]) @ w.T
    return y.reshape(*x.shape[:-1], w.shape[0]), (x, w)


def linear_backward(dy, ctx):
    r"""Gradients of y = x W^T: dx = dy W, dW = dy^T x (summed over all leading axes).

    dy: (..., out). Returns (dx: (..., in), dW: (out, in)).
    """
    x, w = ctx
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ w).reshape(*dy.shape[:-1], w.shape[1])
    dw = dy2.T @ x.reshape(-1, x.shape[-1])
    return dx, dw


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------
def rmsnorm_forward(x, g, eps):
    r"""RMSNorm: y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \odot g (mean over the last axis).

    x: (..., D); g: (D,). Returns y: (..., D). Saves r = 1/\sqrt{\mathrm{mean}(x^2)+\epsilon}: (..., 1).
    """
    xp = array_module(x)
    rstd = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * rstd
    y *= g
    return y, (x, rstd, g)


def rmsnorm_backward(dy, ctx):
    r"""Gradients of RMSNorm. With \hat{x} = x r and u = dy \odot g:
    dx = r (u - \hat{x}\, \mathrm{mean}(u \odot \hat{x})), dg = \sum_{rows} dy \odot \hat{x}.

    dy: (..., D). Returns (dx: (..., D), dg: (D,)).
    """
    x, rstd, g = ctx
    xp = array_module(dy)
    xhat = x * rstd
    t = dy * xhat
    dg = t.reshape(-1, x.shape[-1]).sum(axis=0)
    u = dy * g
    xp.multiply(u, xhat, out=t)
    xhat *= xp.mean(t, axis=-1, keepdims=True)
    u -= xhat
    u *= rstd
    return u, dg


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


def rope_forward(x, cos, sin):
    r"""Rotate each pair (x_{2i}, x_{2i+1}) of every head by the angle m \theta_i of its position m:

    y_{2i} = x_{2i} \cos(m\theta_i) - x_{2i+1} \sin(m\theta_i),
    y_{2i+1} = x_{2i} \sin(m\theta_i) + x_{2i+1} \cos(m\theta_i).

    x: (B, T, nh, hd); cos, sin: (T, hd/2) or (B, T, hd/2), already gathered at the positions.
    Returns y: (B, T, nh, hd).
    """
    xp = array_module(x)
    c, s = _rope_broadcast(cos, x), _rope_broadcast(sin, x)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = xp.empty(x.shape, dtype=x.dtype)
    y0, y1 = y[..., 0::2], y[..., 1::2]
    xp.multiply(x0, c, out=y0)
    y0 -= x1 * s
    xp.multiply(x0, s, out=y1)
    y1 += x1 * c
    return y, (cos, sin)


def rope_backward(dy, ctx):
    r"""RoPE is orthogonal, so its gradient is the inverse rotation R(-m\theta_i):

    dx_{2i} = dy_{2i} \cos + dy_{2i+1} \sin, dx_{2i+1} = -dy_{2i} \sin + dy_{2i+1} \cos.

    dy: (B, T, nh, hd). Returns dx: (B, T, nh, hd).
    """
    cos, sin = ctx
    xp = array_module(dy)
    c, s = _rope_broadcast(cos, dy), _rope_broadcast(sin, dy)
    d0, d1 = dy[..., 0::2], dy[..., 1::2]
    dx = xp.empty(dy.shape, dtype=dy.dtype)
    dx0, dx1 = dx[..., 0::2], dx[..., 1::2]
    xp.multiply(d0, c, out=dx0)
    dx0 += d1 * s
    xp.multiply(d1, c, out=dx1)
    dx1 -= d0 * s
    return dx


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
    shared K/V (no repeated K/V is built): one GEMM per (b, KV head) for S, one for o.
    """
    xp = array_module(q)
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(hd)
    qs = xp.empty((B, KVH, G, T, hd), dtype=q.dtype)  # the queries, pre-scaled by 1/sqrt(hd)
    xp.multiply(q.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4), scale, out=qs)
    qs = qs.reshape(B, KVH, G * T, hd)
    kt = k.transpose(0, 2, 3, 1)  # (B, KVH, hd, S), a view
    vv = v.transpose(0, 2, 1, 3)  # (B, KVH, S, hd), a view
    p = qs @ kt  # scores (B, KVH, G T, S), turned into probabilities in place below
    future = _future_mask(xp, T, S, start_pos)
    if future is not None:
        xp.copyto(p.reshape(B, KVH, G, T, S), -xp.inf, where=future)
    p -= xp.max(p, axis=-1, keepdims=True)
    xp.exp(p, out=p)
    p *= 1.0 / xp.sum(p, axis=-1, keepdims=True)
    o = p @ vv  # (B, KVH, G T, hd)
    out = o.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return out, (qs, kt, vv, p, o, scale)


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
    G = H // KVH
    do = xp.ascontiguousarray(dout.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4))
    do = do.reshape(B, KVH, GT, hd)
    dv = xp.swapaxes(p, -1, -2) @ do  # (B, KVH, S, hd)
    ds = do @ xp.swapaxes(vv, -1, -2)  # dP (B, KVH, G T, S), turned into dS in place
    ds -= xp.sum(do * o, axis=-1, keepdims=True)
    ds *= p
    dq = ds @ xp.swapaxes(kt, -1, -2)  # (B, KVH, G T, hd)
    dq *= scale
    dk = xp.swapaxes(ds, -1, -2) @ qs  # qs carries the 1/sqrt(hd)
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
    s = sigmoid(a)
    silu = a * s
    return silu * b, (a, b, s, silu)


def swiglu_backward(dh, ctx):
    r"""Gradients of h = \mathrm{silu}(a) \odot b:
    db = dh \odot \mathrm{silu}(a), da = dh \odot b \odot \sigma(a)(1 + a(1 - \sigma(a))).

    dh: (..., F). Returns (da, db), each (..., F) (built in the saved buffers).
    """
    a, b, s, silu = ctx
    xp = array_module(dh)
    da = xp.subtract(1.0, s)  # 1 - sigma
    da *= a
    da += 1.0
    da *= s
    da *= b
    da *= dh
    silu *= dh  # db
    return da, silu


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
    m = xp.max(logits, axis=-1, keepdims=True)
    p = logits - m
    xp.exp(p, out=p)
    sumexp = xp.sum(p, axis=-1, keepdims=True)
    p *= 1.0 / sumexp
    lse = (xp.log(sumexp) + m)[:, 0]
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
    rows = xp.arange(p.shape[0])
    p[rows, safe_t] -= 1.0
    p *= (xp.asarray(dloss, dtype=p.dtype) / count).astype(p.dtype) * valid[:, None]
    return p
