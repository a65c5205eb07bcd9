r"""Reference math of the notes' other pieces: what LLaMA chose against, each a forward and a
backward side by side.

LayerNorm, BatchNorm (training and running-statistics inference), absolute sinusoidal positions,
GELU/ReLU two-matrix FFNs, the post-norm residual, the logit scale, cross-attention and the latent
array of a Perceiver-style block (docs/MATH.md part II). The LLaMA ops are in
:mod:`minillama.core.ops`, whose conventions these follow: ``*_forward(...)`` returns
``(out, ctx)``, ``*_backward(dout, ctx)`` the gradients of the forward's differentiable inputs;
each docstring gives its equation in MATH.md's notation and its shapes, each body is that equation
in a few array expressions, array-module generic (NumPy or CuPy), plain and exact in float64. The
model runs some of them as config variants through its backend (``layernorm``, ``gelu``, ``relu``,
``logit_scale``, whose reference pairs ``backends/reference.py`` binds);
:mod:`minillama.core.notes_latent` builds the latent block from them.
"""

from __future__ import annotations

import math

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.ops import (
    array_module,
    linear_backward,
    linear_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    softmax,
)


def _norm_backward(dy, xhat, r, g, axes):
    r"""Shared backward of y = \hat{x} \odot g (+ \beta), \hat{x} = (x - \mu) r, statistics over
    ``axes``: \bar{x} = r (\bar{\hat{x}} - \mathrm{mean}(\bar{\hat{x}}) -
    \hat{x}\,\mathrm{mean}(\bar{\hat{x}} \odot \hat{x})),
    \bar{\hat{x}} = \bar{y} \odot g (the code's ``u``)."""
    u = dy * g
    return r * (u - u.mean(axis=axes, keepdims=True)
                - xhat * (u * xhat).mean(axis=axes, keepdims=True))


def layernorm_forward(x, g, b, eps):
    r"""LayerNorm over the last axis (biased variance):

    \mu = \mathrm{mean}(x), \sigma^2 = \mathrm{mean}((x - \mu)^2),
    \hat{x} = (x - \mu) / \sqrt{\sigma^2 + \epsilon},
    y = \hat{x} \odot g + \beta.

    x: (..., D); g, b = \beta: (D,). Returns y: (..., D). Saves \hat{x} and
    r = 1/\sqrt{\sigma^2+\epsilon}: (..., 1).
    """
    xp = array_module(x)
    xc = x - x.mean(axis=-1, keepdims=True)
    r = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * r
    return xhat * g + b, (xhat, r, g)


def layernorm_backward(dy, ctx):
    r"""Gradients of LayerNorm, \bar{\hat{x}} = \bar{y} \odot g:
    \bar{x} = r (\bar{\hat{x}} - \mathrm{mean}(\bar{\hat{x}}) -
    \hat{x}\,\mathrm{mean}(\bar{\hat{x}} \odot \hat{x})),
    \bar{g} = \sum_{rows} \bar{y} \odot \hat{x}, \bar{\beta} = \sum_{rows} \bar{y}.

    dy: (..., D). Returns (dx: (..., D), dg: (D,), db: (D,)).
    """
    xhat, r, g = ctx
    rows = tuple(range(dy.ndim - 1))
    return (_norm_backward(dy, xhat, r, g, -1), (dy * xhat).sum(axis=rows), dy.sum(axis=rows))


def _bn_axes_shape(x):
    """BatchNorm's reduced axes (every axis but 1) and the broadcast shape (1, C, 1, ...)."""
    return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)


def batchnorm_forward(x, g, b, eps, running=None, momentum=0.1):
    r"""BatchNorm, training mode: per channel \mathit{ch}, statistics over the batch and every
    spatial axis,

    \mu_{ch} = \mathrm{mean}_{n,*}(x_{n,ch,*}),
    \sigma_{ch}^2 = \mathrm{mean}_{n,*}((x - \mu_{ch})^2) (biased),
    y = (x - \mu_{ch})/\sqrt{\sigma_{ch}^2 + \epsilon} \odot g_{ch} + \beta_{ch}.

    x: (N, C) or (N, C, *spatial); g, b: (C,). Returns y shaped like x. ``running`` (a dict with
    ``mean`` and ``var``, each (C,)) is updated in place as PyTorch does:
    \mu^{run} \leftarrow (1 - \mathrm{momentum})\, \mu^{run} + \mathrm{momentum}\, \mu,
    \sigma^{2,run} \leftarrow (1 - \mathrm{momentum})\, \sigma^{2,run} + \mathrm{momentum}\,
    \sigma^2 n_{ch}/(n_{ch}-1)
    (unbiased), n_{ch} = the number of values per channel. Inference uses
    :func:`batchnorm_inference`.
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
    \bar{x} = r (\bar{\hat{x}} - \mathrm{mean}(\bar{\hat{x}}) -
    \hat{x}\,\mathrm{mean}(\bar{\hat{x}} \odot \hat{x})),
    \bar{\hat{x}} = \bar{y} \odot g; \bar{g}_{ch} = \sum_{n,*} \bar{y} \odot \hat{x},
    \bar{\beta}_{ch} = \sum_{n,*} \bar{y}.

    dy shaped like x. Returns (dx, dg: (C,), db: (C,)).
    """
    xhat, r, g, axes = ctx
    return (_norm_backward(dy, xhat, r, g, axes), (dy * xhat).sum(axis=axes),
            dy.sum(axis=axes))


def batchnorm_inference(x, g, b, running_mean, running_var, eps):
    r"""BatchNorm at inference: the running statistics replace the batch's, so each sample is
    normalised on its own: y = (x - \mu^{run}_{ch}) / \sqrt{\sigma^{2,run}_{ch} + \epsilon} \odot
    g_{ch} + \beta_{ch}.

    x: (N, C, *spatial); g, b, running_mean, running_var: (C,). Returns y shaped like x.
    """
    xp = array_module(x)
    _, shape = _bn_axes_shape(x)
    scale = g / xp.sqrt(running_var + eps)
    return (x - running_mean.reshape(shape)) * scale.reshape(shape) + b.reshape(shape)


def sinusoidal_positions(max_seq_len: int, dim: int, base: float = 10000.0, dtype=np.float32,
                         xp=np):
    r"""The vanilla transformer's absolute positional encoding (Vaswani et al., 2017), added to
    the token embeddings scaled by \sqrt{D} (h_0 = \sqrt{D}\, E_{\mathrm{tok}} + E^{pos}, as
    :meth:`~minillama.model.transformer.Transformer._embed` computes):

    E^{pos}_{m, 2i} = \sin(m / \mathrm{base}^{2i/D}),  E^{pos}_{m, 2i+1} = \cos(m /
    \mathrm{base}^{2i/D}).

    Computed in float64 and cast. Returns E^{pos}: (max_seq_len, D). D must be even.
    """
    if dim % 2:
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

    \mathrm{gelu}(a) = \tfrac12 a (1 + \tanh \xi),  \xi = \sqrt{2/\pi}(a + 0.044715 a^3).

    a: (..., F). Returns h: (..., F). Saves a and \tanh \xi.
    """
    xp = array_module(a)
    t = xp.tanh(_GELU_C * (a + 0.044715 * a * a * a))
    return 0.5 * a * (1.0 + t), (a, t)


def gelu_backward(dh, ctx):
    r"""d\,\mathrm{gelu}/da = \tfrac12 (1 + \tanh \xi) +
    \tfrac12 a (1 - \tanh^2 \xi) \sqrt{2/\pi}(1 + 3 \cdot 0.044715 a^2).

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
    r"""The classic two-matrix FFN: y = \mathrm{act}(x W_1^T) W_2^T, \mathrm{act} = GELU or ReLU.

    x: (..., D); w1: (F, D); w2: (D, F). Returns y: (..., D).
    """
    act_fwd, act_bwd = ACTIVATIONS[activation]
    a, c1 = linear_forward(x, w1)
    h, ca = act_fwd(a)
    y, c2 = linear_forward(h, w2)
    return y, (c1, ca, act_bwd, c2)


def mlp_backward(dy, ctx):
    r"""\bar{h} = \bar{y} W_2, \bar{W}_2 = \bar{y}^T h; \bar{a} = \mathrm{act}'(a) \odot \bar{h};
    \bar{x} = \bar{a} W_1,
    \bar{W}_1 = \bar{a}^T x (a = x W_1^T, h = \mathrm{act}(a)).

    dy: (..., D). Returns (dx: (..., D), dw1: (F, D), dw2: (D, F)).
    """
    c1, ca, act_bwd, c2 = ctx
    dh, dw2 = linear_backward(dy, c2)
    dx, dw1 = linear_backward(act_bwd(dh, ca), c1)
    return dx, dw1, dw2


def postnorm_residual_forward(x, fx, g, b, eps):
    r"""The post-norm residual (the original transformer's): y = \mathrm{Norm}(x +
    \mathrm{Sub}(x)), with
    LayerNorm when a bias ``b`` is given and RMSNorm when ``b`` is None. (Pre-norm, LLaMA's, is
    y = x + \mathrm{Sub}(\mathrm{Norm}(x)): the skip path bypasses the norm.)

    x, fx: (..., D) (fx = \mathrm{Sub}(x), computed by the caller); g, b: (D,). Returns y: (..., D).
    """
    s = x + fx
    if b is None:
        y, c = rmsnorm_forward(s, g, eps)
    else:
        y, c = layernorm_forward(s, g, b, eps)
    return y, (b is None, c)


def postnorm_residual_backward(dy, ctx):
    r"""\bar{\Sigma} = \mathrm{Norm}'(\bar{y}); the sum sends it to both x and \mathrm{Sub}(x):
    \bar{x} = \overline{\mathrm{Sub}(x)} = \bar{\Sigma}.
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
    r"""Scaled logits z' = s_z z. Without it std(z) grows like \sqrt{D}\, \mathrm{std}_W for
    unit-RMS features and weights of std \mathrm{std}_W; s_z = 1/\sqrt{D} keeps it flat. z: (...,
    V)."""
    return z * scale, scale


def logit_scale_backward(dz, ctx):
    r"""\bar{z} = s_z\, \bar{z}'. Returns dz: (..., V)."""
    return dz * ctx


def cross_attention_forward(q, k, v):
    r"""Scaled dot-product cross-attention, no mask: T queries of one sequence against S keys and
    values of another (the code's ``M`` and ``L``); query head h reads KV head \kappa(h) = h // G:

    A_{tj} = q_t \cdot k_j / \sqrt{hd},  P_{tj} = \mathrm{softmax}_j(A_{t\cdot}),  o_t = \sum_j
    P_{tj} v_j.

    q: (B, T, H, hd); k, v: (B, S, KVH, hd). Returns o: (B, T, H, hd). Cost O(B H T S hd).
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
    r"""Gradients of cross-attention, \delta_t = \bar{o}_t \cdot o_t:
    \bar{v}_j = \sum_t P_{tj} \bar{o}_t, \bar{A}_{tj} = P_{tj} (\bar{o}_t \cdot v_j - \delta_t),
    \bar{q}_t = \sum_j \bar{A}_{tj} k_j / \sqrt{hd}, \bar{k}_j = \sum_t \bar{A}_{tj} q_t / \sqrt{hd}
    (the G heads of a group are rows of one matrix, so \bar{k}, \bar{v} sum over the group).

    dout: (B, T, H, hd). Returns (dq: (B, T, H, hd), dk, dv: (B, S, KVH, hd)).
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
    r"""The learned latent array Z: (T, D) of T latents, shared by every sequence: Z_b = Z for
    b < B. Returns (B, T, D) (a broadcast view; do not write into it)."""
    xp = array_module(z)
    return xp.broadcast_to(z, (batch_size,) + z.shape), None


def latent_expand_backward(dz, ctx):
    r"""\bar{Z} = \sum_b \bar{Z}_b: each sequence's gradient flows into the one shared array.
    Returns (T, D)."""
    return dz.sum(axis=0)
