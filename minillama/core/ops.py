r"""Reference math: every op of the LLaMA architecture as a forward and a backward, side by side.

This module is the project's math-to-code map (``docs/MATH.md``). Each equation is one
``*_forward`` function and its gradient is the ``*_backward`` function right below it; each body
is the docstring's equation in a few array expressions, written once against the array module of
its inputs (NumPy or CuPy). Nothing here is tuned for speed: no threads, no BLAS or allocator
settings, no row splitting, no in-place buffer reuse. That makes it the oracle: exact in float64,
and every faster implementation (the ``numpy`` backend's threaded CPU path, Numba, CUDA) overrides
single pairs and is held to these functions by parity tests. ``--backend reference`` runs the
model on exactly this code. The notes' other pieces, which LLaMA chose against (LayerNorm,
BatchNorm, sinusoidal positions, two-matrix FFNs, post-norm, ...), are in
:mod:`minillama.core.notes_ops`, written the same way.

Conventions
-----------
* ``*_forward(...)`` returns ``(out, ctx)``; ``ctx`` holds only what the backward needs and is
  opaque to callers (a backend may store different things for its own backward).
* ``*_backward(dout, ctx)`` returns the gradients of the forward's differentiable inputs, in order.
* Symbols are those of the notation table of docs/MATH.md (one meaning each). Size letters: B
  batch, T query positions, S key positions, D model width, H query heads, KVH key/value heads,
  G = H / KVH query heads per KV head, hd head width, F FFN hidden size, V vocabulary, N rows.
* Vectors are rows. Linear weights are stored ``(out, in)`` as in Meta's and llama2.c's
  checkpoints: y = x W^T.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minillama.core.quant import QuantMatrix, dequantize, dequantize_rows
from minillama.core.rope_scaling import rope_frequencies, rope_tables  # noqa: F401 (re-exported)


def array_module(x: Any):
    """The array module (``numpy`` or ``cupy``) that owns ``x``; never imports CuPy for NumPy
    input."""
    if type(x).__module__.startswith("cupy"):
        import cupy  # only reached when x already is a CuPy array

        return cupy
    return np


# ---------------------------------------------------------------------------------------------
# Token embedding
# ---------------------------------------------------------------------------------------------
def embedding_forward(weight, tokens):
    r"""Token embedding lookup: h_{b,t} = E_{\mathrm{tok}_{b,t}}.

    weight: (V, D), or a :class:`~minillama.core.quant.QuantMatrix` (V, D) of which only the rows
    read are dequantized (a frozen table: no gradient); tokens: (B, T) integers in [0, V).
    Returns h: (B, T, D).
    """
    if isinstance(weight, QuantMatrix):
        rows = dequantize_rows(weight.qtype, weight.data[tokens.reshape(-1)], weight.shape[1])
        return rows.reshape(*tokens.shape, weight.shape[1]), (tokens, None)
    return weight[tokens], (tokens, weight.shape)


def embedding_backward(dout, ctx):
    r"""Scatter-add of the output gradient into the rows that were read:
    \bar{E}_\nu = \sum_{(b,t): \mathrm{tok}_{b,t} = \nu} \bar{h}_{b,t}.

    dout: (B, T, D). Returns dE: (V, D), or None for a quantized (frozen) table.
    """
    tokens, shape = ctx
    if shape is None:
        return None
    xp = array_module(dout)
    dw = xp.zeros(shape, dtype=dout.dtype)
    xp.add.at(dw, tokens.reshape(-1), dout.reshape(-1, shape[1]))  # repeated tokens add up
    return dw


# ---------------------------------------------------------------------------------------------
# Linear (no bias)
# ---------------------------------------------------------------------------------------------
def linear_forward(x, w):
    r"""Linear map without bias: y = x W^T; for a block-quantized W (a
    :class:`~minillama.core.quant.QuantMatrix`), y = x\, \mathrm{deq}(W)^T.

    x: (..., in); w: (out, in). Returns y: (..., out).
    """
    if isinstance(w, QuantMatrix):
        return x @ dequantize(w).T, (x, w)
    return x @ w.T, (x, w)


def linear_backward(dy, ctx):
    r"""Gradients of y = x W^T: dx = dy W, dW = dy^T x (summed over all leading axes). A
    quantized W is frozen: dx = dy\, \mathrm{deq}(W) and dW is None.

    dy: (..., out). Returns (dx: (..., in), dW: (out, in) or None).
    """
    x, w = ctx
    if isinstance(w, QuantMatrix):
        return dy @ dequantize(w), None
    dx = dy @ w
    dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, N) (N, in)
    return dx, dw


def lora_forward(x, w, a, b, scale: float, drop=None):
    r"""Linear map with a LoRA adapter (Hu et al., 2021), W frozen:
    y = x W^T + s_{lora}\, (\tilde{x} W_\downarrow^T) W_\uparrow^T, \tilde{x} = x \odot
    \mathrm{drop}
    (an optional dropout mask, already divided by the keep probability; \tilde{x} = x without it).

    x: (..., in); w: (out, in); a = W_\downarrow: (rank, in); b = W_\uparrow: (out, rank);
    s_{lora} = ``scale`` (\alpha / rank, or \alpha / \sqrt{rank} for rsLoRA); drop: None or
    (..., in). Returns y: (..., out).
    """
    x2 = x.reshape(-1, x.shape[-1])  # (N, in): one 2-D product each, not one per leading index
    xa = x2 if drop is None else x2 * drop.reshape(x2.shape)
    u = xa @ a.T  # (N, r)
    y, _ = linear_forward(x2, w)  # the frozen base term (W may be any matrix linear_forward takes)
    y += scale * (u @ b.T)
    return y.reshape(*x.shape[:-1], w.shape[0]), (x.shape, w, a, b, scale, drop, xa, u)


def lora_backward(dy, ctx):
    r"""Gradients of the LoRA linear for the input and the adapter only (\bar{W} is never formed):
    \bar{x}_\downarrow = s_{lora}\, \bar{y} W_\uparrow, \bar{W}_\uparrow = s_{lora}\, \bar{y}^T
    x_\downarrow,
    \bar{W}_\downarrow = \bar{x}_\downarrow^T \tilde{x}, \bar{x} = \bar{y} W + \mathrm{drop} \odot
    (\bar{x}_\downarrow W_\downarrow)
    (sums over all leading axes; x_\downarrow = \tilde{x} W_\downarrow^T, the code's ``u``).

    dy: (..., out). Returns (dx: (..., in), da: (rank, in), db: (out, rank)).
    """
    shape, w, a, b, scale, drop, xa, u = ctx
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    du = scale * (dy2 @ b)  # (N, r)
    db = scale * (dy2.T @ u)
    da = du.T @ xa
    dxa = du @ a
    dx = dy2 @ (dequantize(w) if isinstance(w, QuantMatrix) else w)  # the base term: only dy W
    dx += dxa if drop is None else dxa * drop.reshape(dxa.shape)
    return dx.reshape(shape), da, db


def bias_forward(y, b):
    r"""Bias of a linear layer (Qwen2's q/k/v, HF ``attention_bias``, ``mlp_bias``):
    y'_n = y_n + \beta for every row n (\beta the code's ``b``).

    y: (..., out); b: (out,). Returns (y' (..., out), ctx).
    """
    return y + b, None


def bias_backward(dy, ctx):
    r"""Gradient of y' = y + \beta: \bar{\beta} = \sum_{rows} \bar{y} (\bar{y} itself flows on to
    y).

    dy: (..., out). Returns db: (out,).
    """
    return dy.reshape(-1, dy.shape[-1]).sum(axis=0)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------
def rmsnorm_forward(x, g, eps):
    r"""RMSNorm: y = x r \odot g, r = 1 / \sqrt{\mathrm{mean}(x^2) + \epsilon} (mean over the
    last axis).

    x: (..., D); g: (D,). Returns y: (..., D). Saves r: (..., 1).
    """
    xp = array_module(x)
    r = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)  # (..., 1)
    return x * r * g, (x, r, g)


def rmsnorm_backward(dy, ctx):
    r"""Gradients of RMSNorm. With \hat{x} = x r and \bar{\hat{x}} = \bar{y} \odot g (the code's
    ``u``):
    \bar{x} = r (\bar{\hat{x}} - \hat{x}\, \mathrm{mean}(\bar{\hat{x}} \odot \hat{x})), \bar{g} =
    \sum_{rows} \bar{y} \odot \hat{x}.

    dy: (..., D). Returns (dx: (..., D), dg: (D,)).
    """
    x, r, g = ctx
    xp = array_module(dy)
    xhat, u = x * r, dy * g
    dx = r * (u - xhat * xp.mean(u * xhat, axis=-1, keepdims=True))
    dg = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dg


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (RoPE), interleaved pairs (2i, 2i+1) as in Meta's and llama2.c's code
# ---------------------------------------------------------------------------------------------
# (the frequencies and cos/sin tables with their scalings: minillama/core/rope_scaling.py)
def _rotate_pairs(x, cos, sin):
    """(x_{2i}, x_{2i+1}) -> (x_{2i} c - x_{2i+1} s, x_{2i} s + x_{2i+1} c) for every head."""
    xp = array_module(x)
    c = cos[None, :, None, :] if cos.ndim == 2 else cos[:, :, None, :]  # (1 or B, T, 1, hd/2)
    s = sin[None, :, None, :] if sin.ndim == 2 else sin[:, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (B, T, heads, hd/2) each
    y = xp.empty(x.shape, dtype=xp.result_type(x, c))
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y


def rope_forward(x, cos, sin):
    r"""Rotate each pair (x_{2i}, x_{2i+1}) of every head by the angle \varphi_{m,i} = m \theta_i of
    its position m (the tables carry \mathrm{mscale}, 1 except for yarn):

    y_{2i} = x_{2i} \cos(m\theta_i) - x_{2i+1} \sin(m\theta_i),
    y_{2i+1} = x_{2i} \sin(m\theta_i) + x_{2i+1} \cos(m\theta_i).

    x: (B, T, H or KVH, hd) (queries or keys); cos, sin: (T, hd/2) or (B, T, hd/2), already
    gathered at the positions. Returns y: (B, T, H or KVH, hd).
    """
    return _rotate_pairs(x, cos, sin), (cos, sin)


def rope_backward(dy, ctx):
    r"""Gradient of RoPE: the forward is linear, per pair y = \mathrm{mscale}\, x
    R(\varphi_{m,i})^T with the
    tables holding \mathrm{mscale} \cos and \mathrm{mscale} \sin (1 except for yarn), so the
    gradient is its transpose, \bar{x} = \mathrm{mscale}\, \bar{y} R(\varphi_{m,i}): the same tables
    with the sine negated:

    \bar{x}_{2i} = \bar{y}_{2i} \cos + \bar{y}_{2i+1} \sin, \bar{x}_{2i+1} = -\bar{y}_{2i} \sin +
    \bar{y}_{2i+1} \cos

    (\cos, \sin the table entries, \mathrm{mscale} included). It is the inverse rotation only
    when \mathrm{mscale} = 1.

    dy: (B, T, H or KVH, hd). Returns dx: (B, T, H or KVH, hd).
    """
    cos, sin = ctx
    return _rotate_pairs(dy, cos, -sin)


# ---------------------------------------------------------------------------------------------
# Causal scaled dot-product attention with grouped KV heads (MHA / GQA / MQA)
# ---------------------------------------------------------------------------------------------
def causal_mask(xp, T: int, S: int, start_pos, window: int | None = None, segments=None):
    r"""Boolean (0/1) mask M_{b,t,j} = [j \le p_b + t]: query t of sequence b sits at absolute
    position
    p_b + t and may read keys 0..p_b + t. ``start_pos`` is an int or a (B,) integer array.
    With a sliding ``window`` W_{win} only the last W_{win} of them:
    M_{b,t,j} = [p_b + t - W_{win} < j \le p_b + t].
    Packed sequences (``segments`` (B, T) example ids, S = T) read only their own example:
    M_{b,t,j} = [j \le t] [\mathrm{seg}_{b,t} = \mathrm{seg}_{b,j}] (block-diagonal causal).

    Returns a (1 or B, 1, 1, T, S) array that broadcasts over (B, KVH, G, T, S).
    """
    start = xp.asarray(start_pos).reshape(-1, 1, 1)  # (B or 1, 1, 1)
    t = xp.arange(T).reshape(1, T, 1)
    j = xp.arange(S).reshape(1, 1, S)
    m = j <= start + t
    if window is not None:
        m &= j > start + t - window
    if segments is not None:
        m = m & (segments[:, :, None] == segments[:, None, :])  # (B, T, S)
    return m[:, None, None, :, :]


def segment_positions(segments):
    r"""Positions that restart at every example of a packed row: m_{b,t} = t - (the first index
    of \mathrm{seg}_{b,t}'s run). segments: (B, T) example ids \mathrm{seg}, each example one
    contiguous run.
    Returns (B, T) int64, so RoPE turns a packed example exactly as it turns it alone."""
    xp = array_module(segments)
    B, T = segments.shape
    t = xp.broadcast_to(xp.arange(T), (B, T))
    new = xp.ones((B, T), dtype=bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = xp.maximum.accumulate(xp.where(new, t, 0), axis=1)  # where the current run began
    return (t - first).astype(xp.int64)


def softmax(x, axis: int = -1):
    r"""Softmax with the row maximum subtracted: P_j = e^{x_j - x_{\max}} / \sum_{j'} e^{x_{j'} -
    x_{\max}},
    x_{\max} = \max_{j'} x_{j'}. Entries equal to -inf get probability 0. Any shape; reduces
    ``axis``."""
    xp = array_module(x)
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def attention_forward(q, k, v, start_pos=0, window: int | None = None, segments=None):
    r"""Causal scaled dot-product attention where query head h reads KV head h // G, G = H / KVH:

    A^{(h)}_{tj} = q_{t,h} \cdot k_{j,\kappa(h)} / \sqrt{hd} where M_{tj} = 1 and -\infty where
    M_{tj} = 0 (:func:`causal_mask`: j \le p_b + t, with a sliding ``window`` W_{win} also
    j > p_b + t - W_{win}, for packed rows also \mathrm{seg}_{b,t} = \mathrm{seg}_{b,j}),
    P^{(h)}_{tj} = \mathrm{softmax}_j(A^{(h)}_{t\cdot}),  o_{t,h} = \sum_j P^{(h)}_{tj}
    v_{j,\kappa(h)}.
    (The code's ``s`` holds the scores A, ``p`` the probabilities P.)

    q: (B, T, H, hd); k, v: (B, S, KVH, hd) with S >= T (S > T when earlier positions come from a
    KV cache); start_pos: int or (B,) ints, the absolute position of query 0; segments: None or
    (B, T) example ids of packed rows (S = T). Returns o: (B, T, H, hd).
    The G query heads of a group are one axis that broadcasts against their shared K and V.
    """
    xp = array_module(q)
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, KVH, H // KVH, hd).transpose(0, 2, 3, 1, 4)  # (B, KVH, G, T, hd)
    kg = k.transpose(0, 2, 1, 3)[:, :, None]  # (B, KVH, 1, S, hd), shared by the group
    vg = v.transpose(0, 2, 1, 3)[:, :, None]  # (B, KVH, 1, S, hd)
    scale = 1.0 / math.sqrt(hd)
    s = (qg @ kg.swapaxes(-1, -2)) * scale  # (B, KVH, G, T, S)
    s = xp.where(causal_mask(xp, T, S, start_pos, window, segments), s, -xp.inf)
    p = softmax(s, axis=-1)
    o = p @ vg  # (B, KVH, G, T, hd)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd), (qg, kg, vg, p, scale)


def attention_backward(dout, ctx):
    r"""Gradients of causal GQA attention. With dO the output gradient:

    \bar{P}_{tj} = \bar{o}_t \cdot v_j,  \delta_t = \sum_j P_{tj} \bar{P}_{tj},
    \bar{A}_{tj} = P_{tj} (\bar{P}_{tj} - \delta_t),  \bar{q}_t = \sum_j \bar{A}_{tj} k_j /
    \sqrt{hd},
    \bar{k}_j = \sum_{h \in group} \sum_t \bar{A}_{tj} q_t / \sqrt{hd},
    \bar{v}_j = \sum_{h \in group} \sum_t P_{tj} \bar{o}_t  (head indices as in the forward; the
    code's ``dp``, ``ds``).

    dout: (B, T, H, hd). Returns (dq: (B, T, H, hd), dk, dv: (B, S, KVH, hd)).
    """
    qg, kg, vg, p, scale = ctx
    B, T, H, hd = dout.shape
    KVH, G = qg.shape[1], qg.shape[2]
    do = dout.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4)  # (B, KVH, G, T, hd)
    dp = do @ vg.swapaxes(-1, -2)  # (B, KVH, G, T, S)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = (ds @ kg) * scale  # (B, KVH, G, T, hd)
    dk = (ds.swapaxes(-1, -2) @ qg).sum(axis=2) * scale  # (B, KVH, S, hd), group summed
    dv = (p.swapaxes(-1, -2) @ do).sum(axis=2)  # (B, KVH, S, hd)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------
# SwiGLU gate
# ---------------------------------------------------------------------------------------------
def sigmoid(a):
    r"""\mathrm{sigmoid}(a) = 1 / (1 + e^{-a}). For a very negative, e^{-a} overflows to +inf and
    the result
    is the correct limit 0 (the overflow warning is silenced); accurate in both tails."""
    xp = array_module(a)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + xp.exp(-a))


def swiglu_forward(a, b):
    r"""SwiGLU gate: f = \mathrm{silu}(a_1) \odot a_3, \mathrm{silu}(a) = a\, \mathrm{sigmoid}(a).

    In the FFN, a_1 = \hat{h} W_1^T (the argument ``a``) and a_3 = \hat{h} W_3^T (``b``), and the
    block returns f W_2^T. a, b: (..., F). Returns f: (..., F). Saves a_1, a_3,
    \mathrm{sigmoid}(a_1) and \mathrm{silu}(a_1).
    """
    s = sigmoid(a)
    silu = a * s
    return silu * b, (a, b, s, silu)


def swiglu_backward(dh, ctx):
    r"""Gradients of f = \mathrm{silu}(a_1) \odot a_3:
    \bar{a}_3 = \bar{f} \odot \mathrm{silu}(a_1),
    \bar{a}_1 = \bar{f} \odot a_3 \odot \mathrm{sigmoid}(a_1)(1 + a_1(1 - \mathrm{sigmoid}(a_1))).

    dh = \bar{f}: (..., F). Returns (da, db) = (\bar{a}_1, \bar{a}_3), each (..., F).
    """
    a, b, s, silu = ctx
    return dh * b * s * (1.0 + a * (1.0 - s)), dh * silu


# ---------------------------------------------------------------------------------------------
# Softmax cross-entropy (fused), with an ignore index
# ---------------------------------------------------------------------------------------------
def cross_entropy_forward(logits, targets, ignore_index: int = -1):
    r"""Mean softmax cross-entropy over the rows whose target is not ``ignore_index``, the kept rows
    \mathcal{K} = \{n : \mathrm{tgt}_n \ne \mathrm{ignore}\}:

    \ell_n = \log \sum_\nu e^{z_{n\nu}} - z_{n, \mathrm{tgt}_n},
    \mathcal{L} = \frac{1}{|\mathcal{K}|} \sum_{n \in \mathcal{K}} \ell_n

    (\mathcal{L} = 0 when every target is ignored). logits z: (N, V); targets \mathrm{tgt}: (N,)
    integers. Returns the scalar loss (a 0-d array) and saves P = softmax(z): (N, V).
    """
    xp = array_module(logits)
    valid = targets != ignore_index  # (N,)
    t = xp.where(valid, targets, 0)
    m = xp.max(logits, axis=-1)
    lse = m + xp.log(xp.sum(xp.exp(logits - m[:, None]), axis=-1))  # (N,) log-sum-exp
    picked = logits[xp.arange(logits.shape[0]), t]  # z_{n, y_n}
    count = xp.maximum(valid.sum(), 1)
    loss = xp.sum(xp.where(valid, lse - picked, 0.0)) / count
    return loss.astype(logits.dtype), (xp.exp(logits - lse[:, None]), t, valid, count)


def cross_entropy_backward(dloss, ctx):
    r"""Gradient of the mean cross-entropy:
    \bar{z}_{n\nu} = \bar{\mathcal{L}}\, (P_{n\nu} - [\nu = \mathrm{tgt}_n]) / |\mathcal{K}| for
    kept
    rows,
    0 for ignored rows (\bar{\mathcal{L}} the upstream scalar ``dloss``).

    Returns dlogits: (N, V).
    """
    p, t, valid, count = ctx
    xp = array_module(p)
    dz = p.copy()
    dz[xp.arange(p.shape[0]), t] -= 1.0  # p - onehot(y)
    coef = (xp.asarray(dloss, dtype=p.dtype) * valid / count).astype(p.dtype)  # (N,)
    return dz * coef[:, None]


def linear_cross_entropy_forward(x, w, targets, ignore_index: int = -1):
    r"""The output projection and the mean cross-entropy as one op (the training loss head):
    z = x W^T, then
    \mathcal{L} = \frac{1}{|\mathcal{K}|} \sum_{n \in \mathcal{K}} (\mathrm{lse}_n - z_{n,
    \mathrm{tgt}_n})
    as in :func:`linear_forward` and :func:`cross_entropy_forward`.

    x: (N, D); w: (V, D); targets: (N,). Returns the 0-d loss and ctx. Written here as the two ops
    one after the other; a backend may compute it without ever holding all of z: (N, V).
    """
    z, c_lin = linear_forward(x, w)
    loss, c_ce = cross_entropy_forward(z, targets, ignore_index)
    return loss, (c_lin, c_ce)


def linear_cross_entropy_backward(dloss, ctx):
    r"""Gradients of :func:`linear_cross_entropy_forward`: \bar{z} from
    :func:`cross_entropy_backward`, then \bar{x} = \bar{z} W and \bar{W} = \bar{z}^T x.

    Returns (dx: (N, D), dW: (V, D)).
    """
    c_lin, c_ce = ctx
    return linear_backward(cross_entropy_backward(dloss, c_ce), c_lin)
