r"""``minillama convert-gqa IN OUT --n-kv-heads G``: turn a model's key/value heads into G groups.

Ainslie et al. (2023) convert a multi-head checkpoint to grouped-query attention by mean-pooling
the key and value projection heads of each group, then uptraining briefly. With H query heads and
G groups, group g serves the query heads g H/G .. (g+1) H/G - 1, and its projections are

    W_k^{(g)} = \frac{G}{H} \sum_{h \in g} W_k^{(h)},   W_v^{(g)} = \frac{G}{H} \sum_{h \in g} W_v^{(h)}

(each W^{(h)} the hd rows of head h in Meta's (KVH hd, D) layout). A model that already shares
its KV heads (KVH < H) pools its KVH heads in runs of KVH / G, which is the same mean over the
query heads of the group. Every other tensor is copied; the result is written in the project's
format. G = KVH is the identity, and the conversion is exact when the heads of a group are equal.
"""

from __future__ import annotations

import dataclasses
import sys
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


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-gqa", help="mean-pool a model's key/value heads into fewer groups (MHA -> GQA)",
        description="Convert a checkpoint (any supported format) to grouped-query attention with "
                    "G key/value heads by mean-pooling the wk/wv heads of each group of query "
                    "heads; writes the project's .safetensors format. Uptrain it with "
                    "`minillama train --init-from OUT`.")
    p.add_argument("input", metavar="IN", help="the checkpoint to convert")
    p.add_argument("output", metavar="OUT", help="the .safetensors file to write")
    p.add_argument("--n-kv-heads", type=int, required=True, metavar="G",
                   help="key/value heads of the result (must divide the query heads)")
    p.set_defaults(func=run_convert_gqa)


def run_convert_gqa(args) -> int:
    from minillama.io.checkpoint import save_checkpoint
    from minillama.io.load import load_params
    from minillama.core.quant import dequantize_params

    _, cfg, params, tok = load_params(args.input)
    params = dequantize_params(params)  # quantized GGUF matrices: converted as float32
    new_cfg, new_params = convert_gqa(cfg, params, args.n_kv_heads)
    path = save_checkpoint(args.output, new_cfg, new_params, tokenizer=tok)
    print(f"wrote {path}: {cfg.n_heads} query heads, KV heads {cfg.n_kv_heads} -> "
          f"{new_cfg.n_kv_heads}, {cfg.n_params():,} -> {new_cfg.n_params():,} parameters",
          file=sys.stderr)
    return 0
