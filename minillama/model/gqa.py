r"""Multi-head to grouped-query attention: a model's key/value heads mean-pooled into G groups.

Ainslie et al. (2023) convert a multi-head checkpoint to grouped-query attention by mean-pooling
the key and value projection heads of each group, then uptraining briefly. With H query heads and
G groups, group g serves the query heads g H/G .. (g+1) H/G - 1, and its projections are

    W_k^{(g)} = \frac{G}{H} \sum_{h \in g} W_k^{(h)},
    W_v^{(g)} = \frac{G}{H} \sum_{h \in g} W_v^{(h)}

(each W^{(h)} the hd rows of head h in Meta's (KVH hd, D) layout). A model that already shares
its KV heads (KVH < H) pools its KVH heads in runs of KVH / G, which is the same mean over the
query heads of the group. Every other tensor is copied. G = KVH is the identity, and the
conversion is exact when the heads of a group are equal. ``minillama convert-gqa``
(:mod:`minillama.cli.convert`) applies it to a checkpoint file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError


def convert_gqa(cfg: ModelConfig, params: dict[str, Any], n_groups: int):
    r"""(cfg', params') with ``n_groups`` KV heads: W_k, W_v of every layer mean-pooled per group.

    wk, wv: (KVH hd, D) -> (G hd, D). Raises :class:`MinillamaError` unless G divides H and KVH.
    """
    H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = n_groups
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise MinillamaError(f"--n-kv-heads must be a positive integer, got {G!r}")
    if H % G:
        raise MinillamaError(f"cannot group {H} query heads into {G} KV heads: n_heads % "
                             f"n_kv_heads must be 0")
    if G > KVH or KVH % G:
        raise MinillamaError(f"the model has {KVH} KV heads; mean-pooling can only merge them "
                             f"into a divisor of {KVH}, not {G}")
    out = dict(params)
    for layer in range(cfg.n_layers):
        for w in ("wk", "wv"):
            name = f"layers.{layer}.attention.{w}.weight"
            a = np.asarray(params[name])
            pooled = a.reshape(G, KVH // G, hd, a.shape[-1]).astype(np.float64).mean(axis=1)
            out[name] = pooled.reshape(G * hd, a.shape[-1]).astype(a.dtype)
            bias = name.replace(".weight", ".bias")
            if bias in params:  # qkv_bias models: the biases of a group are pooled alike
                b = np.asarray(params[bias])
                out[bias] = b.reshape(G, KVH // G, hd).astype(np.float64).mean(axis=1) \
                    .reshape(G * hd).astype(b.dtype)
    return dataclasses.replace(cfg, n_kv_heads=G), out
