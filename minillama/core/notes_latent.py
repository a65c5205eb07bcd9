r"""The latent transformer block (Perceiver style) and a small encoder that runs it end to end: the
notes' alternative to self-attention over long inputs (docs/MATH.md section 18), beside the notes'
other pieces. The LLaMA model does not use it; an identity, its tests and
``scripts/bench_ops.py --latent`` do.

A learned latent array Z: (M, D) is expanded over the batch and reads the input sequence
x: (B, L, D) through cross-attention, so a block costs O(M L) instead of self-attention's O(L^2):

    z = Z (for every sequence)
    z = z + \mathrm{CrossAttn}(q \leftarrow \mathrm{LN}(z), k, v \leftarrow \mathrm{LN}(x))
    z = z + \mathrm{SelfAttn}(\mathrm{LN}(z))          (over the M latents, no mask)
    z = z + \mathrm{FFN}(\mathrm{LN}(z))               (GELU two-matrix FFN)

Each LayerNorm has its own gain and bias. Everything is built from the reference ops of
:mod:`minillama.core.ops` and :mod:`minillama.core.notes_ops` (forward and backward), so it runs
on NumPy or CuPy arrays alike. With no positions in x, the output does not depend on the order of
the input tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minillama.core import notes_ops, ops
from minillama.core.errors import MinillamaError

#: the parameters of one latent block (prefix ``blocks.{i}.``)
BLOCK_PARAMS = ("latent_norm", "input_norm", "cross.wq", "cross.wk", "cross.wv", "cross.wo",
                "self_norm", "self.wq", "self.wk", "self.wv", "self.wo", "ffn_norm", "ffn.w1",
                "ffn.w2")


@dataclass
class LatentConfig:
    """Sizes of a Perceiver-style encoder: V inputs symbols, D width, M latents, H/KVH heads,
    F FFN width, ``n_blocks`` latent blocks, ``n_classes`` outputs."""

    vocab_size: int = 256
    dim: int = 32
    n_latents: int = 8
    n_heads: int = 4
    n_kv_heads: int = 4
    hidden_dim: int = 64
    n_blocks: int = 1
    n_classes: int = 2
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_latents", "n_heads", "n_kv_heads", "hidden_dim",
                     "n_blocks", "n_classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MinillamaError(f"LatentConfig.{name} must be a positive integer, got "
                                     f"{value!r}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise MinillamaError(f"dim % n_heads and n_heads % n_kv_heads must be 0 (dim="
                                 f"{self.dim}, n_heads={self.n_heads}, n_kv_heads="
                                 f"{self.n_kv_heads})")


def block_shapes(cfg: LatentConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of one block's parameters (norms have ``.weight`` and ``.bias``)."""
    D, F = cfg.dim, cfg.hidden_dim
    kv = cfg.n_kv_heads * (D // cfg.n_heads)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in BLOCK_PARAMS:
        if name.endswith("norm"):
            shapes[name + ".weight"], shapes[name + ".bias"] = (D,), (D,)
        elif name.endswith(("wk", "wv")):
            shapes[name + ".weight"] = (kv, D)
        elif name == "ffn.w1":
            shapes[name + ".weight"] = (F, D)
        elif name == "ffn.w2":
            shapes[name + ".weight"] = (D, F)
        else:
            shapes[name + ".weight"] = (D, D)
    return shapes


def init_block(cfg: LatentConfig, rng, dtype=np.float64) -> dict[str, np.ndarray]:
    """Random block parameters: matrices ~ N(0, 1/D) (0.5/D for the output projections), norm
    gains 1 and biases 0."""
    p = {}
    for name, shape in block_shapes(cfg).items():
        if name.endswith("norm.weight"):
            p[name] = np.ones(shape, dtype=dtype)
        elif name.endswith("norm.bias"):
            p[name] = np.zeros(shape, dtype=dtype)
        else:
            std = (0.5 if name.endswith(("wo.weight", "w2.weight")) else 1.0) / np.sqrt(shape[1])
            p[name] = (rng.standard_normal(shape) * std).astype(dtype)
    return p


def _attend(nq, nkv, p, pre, H, KVH):
    """W_o CrossAttn(W_q nq, W_k nkv, W_v nkv): nq (B, M, D), nkv (B, L, D) -> (B, M, D)."""
    B, M, D = nq.shape
    L, hd = nkv.shape[1], D // H
    q, cq = ops.linear_forward(nq, p[pre + "wq.weight"])
    k, ck = ops.linear_forward(nkv, p[pre + "wk.weight"])
    v, cv = ops.linear_forward(nkv, p[pre + "wv.weight"])
    a, ca = notes_ops.cross_attention_forward(q.reshape(B, M, H, hd), k.reshape(B, L, KVH, hd),
                                        v.reshape(B, L, KVH, hd))
    o, co = ops.linear_forward(a.reshape(B, M, D), p[pre + "wo.weight"])
    return o, (cq, ck, cv, ca, co)


def _attend_backward(do, ctx, pre, grads):
    """Returns (d nq, d nkv) and fills the four projection gradients under ``pre``."""
    cq, ck, cv, ca, co = ctx
    B, M, D = do.shape
    da, grads[pre + "wo.weight"] = ops.linear_backward(do, co)
    H = ca[0].shape[1] * (ca[0].shape[2] // M)  # KVH * G
    dq, dk, dv = notes_ops.cross_attention_backward(da.reshape(B, M, H, D // H), ca)
    L = dk.shape[1]
    dnq, grads[pre + "wq.weight"] = ops.linear_backward(dq.reshape(B, M, D), cq)
    dnk, grads[pre + "wk.weight"] = ops.linear_backward(dk.reshape(B, L, -1), ck)
    dnv, grads[pre + "wv.weight"] = ops.linear_backward(dv.reshape(B, L, -1), cv)
    return dnq, dnk + dnv


def _ln(x, p, name, eps):
    return notes_ops.layernorm_forward(x, p[name + ".weight"], p[name + ".bias"], eps)


def _ln_backward(dy, ctx, name, grads):
    dx, grads[name + ".weight"], grads[name + ".bias"] = notes_ops.layernorm_backward(dy, ctx)
    return dx


def latent_block_forward(z, x, p, n_heads: int, n_kv_heads: int, eps: float = 1e-5):
    r"""One latent block: z = z + CrossAttn(LN(z), LN(x)); z = z + SelfAttn(LN(z));
    z = z + FFN(LN(z)).

    z: (B, M, D) latents; x: (B, L, D) inputs; p: the block's parameters (:func:`block_shapes`).
    Returns (z', ctx), z': (B, M, D).
    """
    H, KVH = n_heads, n_kv_heads
    n1, c1 = _ln(z, p, "latent_norm", eps)
    nx, cx = _ln(x, p, "input_norm", eps)
    o, c_cross = _attend(n1, nx, p, "cross.", H, KVH)
    z = z + o
    n2, c2 = _ln(z, p, "self_norm", eps)
    o, c_self = _attend(n2, n2, p, "self.", H, KVH)
    z = z + o
    n3, c3 = _ln(z, p, "ffn_norm", eps)
    f, c_ffn = notes_ops.mlp_forward(n3, p["ffn.w1.weight"], p["ffn.w2.weight"], "gelu")
    return z + f, (c1, cx, c_cross, c2, c_self, c3, c_ffn)


def latent_block_backward(dz, ctx):
    r"""Gradient of :func:`latent_block_forward`, the sublayers in reverse; each residual adds its
    branch's input gradient to the one that skips it. dz: (B, M, D).

    Returns (dz: (B, M, D), dx: (B, L, D), grads: dict name -> array).
    """
    c1, cx, c_cross, c2, c_self, c3, c_ffn = ctx
    g: dict[str, Any] = {}
    dn3, g["ffn.w1.weight"], g["ffn.w2.weight"] = notes_ops.mlp_backward(dz, c_ffn)
    dz = dz + _ln_backward(dn3, c3, "ffn_norm", g)
    dq, dkv = _attend_backward(dz, c_self, "self.", g)
    dz = dz + _ln_backward(dq + dkv, c2, "self_norm", g)
    dq, dkv = _attend_backward(dz, c_cross, "cross.", g)
    dx = _ln_backward(dkv, cx, "input_norm", g)
    dz = dz + _ln_backward(dq, c1, "latent_norm", g)
    return dz, dx, g


class PerceiverClassifier:
    r"""A small Perceiver-style encoder: symbols -> embeddings (no positions) -> latents Z read
    them through ``n_blocks`` latent blocks -> mean over the M latents -> LayerNorm -> class
    logits. It compresses a length-L sequence into M vectors, at cost O(M L) per block.

    logits = \mathrm{LN}(\tfrac1M \sum_m z_m) W_{cls}^T: (B, n_classes).
    """

    def __init__(self, cfg: LatentConfig, seed: int = 0, dtype=np.float64):
        self.cfg = cfg
        rng = np.random.default_rng(seed)
        D = cfg.dim
        self.params: dict[str, np.ndarray] = {
            "tok_embeddings.weight": rng.standard_normal((cfg.vocab_size, D)).astype(dtype),
            "latents": (rng.standard_normal((cfg.n_latents, D)) * 0.5).astype(dtype),
            "norm.weight": np.ones(D, dtype=dtype), "norm.bias": np.zeros(D, dtype=dtype),
            "classifier.weight": (rng.standard_normal((cfg.n_classes, D)) / np.sqrt(D))
            .astype(dtype),
        }
        for i in range(cfg.n_blocks):
            for k, v in init_block(cfg, rng, dtype).items():
                self.params[f"blocks.{i}.{k}"] = v

    def _block(self, i):
        pre = f"blocks.{i}."
        return {k[len(pre):]: v for k, v in self.params.items() if k.startswith(pre)}

    def _run(self, tokens):
        cfg, p = self.cfg, self.params
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise MinillamaError(f"tokens must be a non-empty (B, L) array, got {tokens.shape}")
        x, c_emb = ops.embedding_forward(p["tok_embeddings.weight"], tokens)
        z, _ = notes_ops.latent_expand_forward(p["latents"], tokens.shape[0])
        c_blocks = []
        for i in range(cfg.n_blocks):
            z, c = latent_block_forward(z, x, self._block(i), cfg.n_heads, cfg.n_kv_heads,
                                        cfg.norm_eps)
            c_blocks.append(c)
        pooled = z.mean(axis=1)
        n, c_n = notes_ops.layernorm_forward(pooled, p["norm.weight"], p["norm.bias"], cfg.norm_eps)
        logits, c_cls = ops.linear_forward(n, p["classifier.weight"])
        return logits, (c_emb, c_blocks, c_n, c_cls, z.shape)

    def forward(self, tokens):
        """Class logits (B, n_classes) of a (B, L) batch of symbols."""
        return self._run(tokens)[0]

    def loss_and_grads(self, tokens, labels):
        """Mean cross-entropy of the labels (B,) and the gradient of every parameter."""
        logits, (c_emb, c_blocks, c_n, c_cls, zshape) = self._run(tokens)
        loss, c_ce = ops.cross_entropy_forward(logits, np.asarray(labels))
        g: dict[str, Any] = {}
        dn, g["classifier.weight"] = ops.linear_backward(ops.cross_entropy_backward(1.0, c_ce),
                                                         c_cls)
        dpool, g["norm.weight"], g["norm.bias"] = notes_ops.layernorm_backward(dn, c_n)
        dz = np.broadcast_to(dpool[:, None, :] / zshape[1], zshape)
        dx = 0.0
        for i in reversed(range(self.cfg.n_blocks)):
            dz, dxi, gi = latent_block_backward(dz, c_blocks[i])
            dx = dx + dxi
            g.update({f"blocks.{i}.{k}": v for k, v in gi.items()})
        g["latents"] = notes_ops.latent_expand_backward(dz, None)
        g["tok_embeddings.weight"] = ops.embedding_backward(dx, c_emb)
        return float(loss), {k: g[k] for k in self.params}
