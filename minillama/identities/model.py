r"""Identities of the whole model: a small :class:`~minillama.model.transformer.Transformer` on
the backend, in the subject's dtype.

The weights are "lively" (matrices 0.2 N(0, 1), norm gains 1 + 0.2 N(0, 1)): far enough from the
linear regime that attention is not nearly uniform, so a masking or position error shows.
Tolerances are :func:`~minillama.identities.base.model_tolerance`: both sides compute the same
sums in another order or grouping, each layer's sums have at most D + F + S terms, and the
logits are made from the final normalised hidden state and the head's rows.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core.config import ModelConfig, param_shapes
from minillama.identities import strategies as ids
from minillama.identities.base import (
    MODEL_FORWARD_OPS,
    MODEL_TRAIN_OPS,
    Identity,
    Subject,
    contrast_floor,
    differs,
    model_scale,
    model_tolerance,
    ratio,
)


def lively_params(cfg: ModelConfig, seed: int, scale: float = 0.2,
                  gain: float = 0.2) -> dict[str, np.ndarray]:
    """float64 weights of ``cfg``: matrices ``scale`` N(0, 1), norm gains 1 + ``gain`` N(0, 1),
    biases ``gain`` N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + gain * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            out[name] = gain * rng.standard_normal(shape)
        else:
            out[name] = scale * rng.standard_normal(shape)
    return out


def small_config(H: int = 4, KVH: int = 2, hd: int = 4, **kw) -> ModelConfig:
    """Two layers, D = H hd, F 20, V 13, up to 16 positions, tied head."""
    base = dict(dim=H * hd, n_layers=2, n_heads=H, n_kv_heads=KVH, vocab_size=13, hidden_dim=20,
                max_seq_len=16, tie_embeddings=True)
    return ModelConfig(**{**base, **kw})


def _tokens(cfg: ModelConfig, seed: int, B: int, T: int) -> np.ndarray:
    return np.random.default_rng([seed, 3]).integers(0, cfg.vocab_size, (B, T))


def _causality(s: Subject, ex: dict) -> float:
    cfg = small_config()
    model = s.model(cfg, lively_params(cfg, ex["seed"]))
    T, pos = ex["T"], ex["pos"]
    tok = _tokens(cfg, ex["seed"], 2, T)
    tok2 = tok.copy()
    tok2[:, pos] = (tok[:, pos] + 1 + ex["step"]) % cfg.vocab_size  # another token at pos
    a, b = s.logits(model, tok), s.logits(model, tok2)
    tol = model_tolerance(model, T, s.u)
    floor = contrast_floor(tol, model_scale(model))
    return max(ratio(a[:, :pos] - b[:, :pos], tol), differs(a[:, pos] - b[:, pos], floor))


def _kv_cache(s: Subject, ex: dict) -> float:
    cfg = small_config()
    model = s.model(cfg, lively_params(cfg, ex["seed"]))
    P, chunks = ex["P"], ex["chunks"]
    N = sum(chunks)
    tok = _tokens(cfg, ex["seed"], 2, P + N)
    full = s.logits(model, tok)
    cache = model.new_cache(2)
    got = [s.logits(model, tok[:, :P], start_pos=0, cache=cache)]
    i = P
    for c in chunks:  # a chunk of c > 1 tokens is a prefill after a cached prefix
        got.append(s.logits(model, tok[:, i:i + c], start_pos=i, cache=cache))
        i += c
    return ratio(np.concatenate(got, axis=1) - full, model_tolerance(model, P + N, s.u))


def _repeat_kv(cfg: ModelConfig, p: dict, G: int) -> dict:
    """The weights of the MHA model whose K/V heads are those of ``p``, each repeated G times."""
    hd, KVH = cfg.head_dim, cfg.n_kv_heads
    out = dict(p)
    for layer in range(cfg.n_layers):
        for w in ("wk", "wv"):
            name = f"layers.{layer}.attention.{w}.weight"
            out[name] = np.repeat(p[name].reshape(KVH, hd, -1), G, axis=0).reshape(KVH * G * hd,
                                                                                   -1)
    return out


def _gqa_repeated(s: Subject, ex: dict) -> float:
    KVH, G = ex["KVH"], ex["G"]
    cfg, mha = small_config(KVH * G, KVH), small_config(KVH * G, KVH * G)
    p = lively_params(cfg, ex["seed"])
    tok = _tokens(cfg, ex["seed"], 2, ex["T"])
    model = s.model(cfg, p)
    a = s.logits(model, tok)
    b = s.logits(s.model(mha, _repeat_kv(cfg, p, G)), tok)
    return ratio(a - b, model_tolerance(model, ex["T"], s.u))


def _permuted(cfg: ModelConfig, p: dict, rows_q, rows_kv, move_q: bool = True) -> dict:
    out = dict(p)
    for layer in range(cfg.n_layers):
        pre = f"layers.{layer}.attention."
        if move_q:
            out[pre + "wq.weight"] = p[pre + "wq.weight"][rows_q]
            out[pre + "wo.weight"] = p[pre + "wo.weight"][:, rows_q]
        out[pre + "wk.weight"] = p[pre + "wk.weight"][rows_kv]
        out[pre + "wv.weight"] = p[pre + "wv.weight"][rows_kv]
    return out


def _head_permutation(s: Subject, ex: dict) -> float:
    KVH, G = ex["KVH"], ex["G"]
    cfg = small_config(KVH * G, KVH)
    hd = cfg.head_dim
    p = lively_params(cfg, ex["seed"])
    order = [ex["pi"][j] * G + ex["sigma"][j][g] for j in range(KVH) for g in range(G)]
    rows_q = np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in order])
    rows_kv = np.concatenate([np.arange(j * hd, (j + 1) * hd) for j in ex["pi"]])
    tok = _tokens(cfg, ex["seed"], 2, 6)
    model = s.model(cfg, p)
    a = s.logits(model, tok)
    b = s.logits(s.model(cfg, _permuted(cfg, p, rows_q, rows_kv)), tok)
    tol = model_tolerance(model, 6, s.u)
    worst = ratio(a - b, tol)
    if list(ex["pi"]) != sorted(ex["pi"]):  # the KV heads moved without their query heads
        c = s.logits(s.model(cfg, _permuted(cfg, p, rows_q, rows_kv, move_q=False)), tok)
        worst = max(worst, differs(a - c, contrast_floor(tol, model_scale(model))))
    return worst


def _batch_forward(s: Subject, ex: dict) -> float:
    cfg = small_config(4, 1)
    model = s.model(cfg, lively_params(cfg, ex["seed"]))
    tok = _tokens(cfg, ex["seed"], ex["B"], ex["T"])
    full = s.logits(model, tok)
    tol = model_tolerance(model, ex["T"], s.u)
    return max(ratio(s.logits(model, tok[b:b + 1]) - full[b:b + 1], tol)
               for b in range(ex["B"]))


def _batch_gradient(s: Subject, ex: dict) -> float:
    cfg = small_config(4, 1)
    model = s.model(cfg, lively_params(cfg, ex["seed"]))
    B, T = ex["B"], ex["T"]
    tok = _tokens(cfg, ex["seed"], B, T)
    tgt = np.random.default_rng([ex["seed"], 4]).integers(0, cfg.vocab_size, (B, T))
    _, g = model.loss_and_grads(tok, tgt)
    singles = [model.loss_and_grads(tok[b:b + 1], tgt[b:b + 1])[1] for b in range(B)]
    parts = {name: [s.get(one[name]) for one in singles] for name in g}
    made_of = max(float(np.abs(x).max()) for xs in parts.values() for x in xs)
    tol = 64 * (cfg.n_layers + 1) * (cfg.dim + cfg.hidden_dim + T + cfg.vocab_size) * s.u
    return max(ratio(s.get(g[name]) - sum(parts[name]) / B, tol * made_of) for name in g)


_PERMUTE = ids.head_permutation_cases(st.fixed_dictionaries({
    "seed": ids.seeds, "KVH": st.integers(1, 3), "G": st.integers(1, 3)}))

IDENTITIES = [
    Identity(
        name="model_causality", topic="model",
        statement="Changing the token at position p leaves the logits of every earlier "
                  "position unchanged and changes those at p.",
        equation=r"z_t(x) = z_t(x') \text{ for } t < p \text{ when } x_t = x'_t "
                 r"\text{ for } t \ne p",
        strategy=st.integers(2, 8).flatmap(lambda T: st.fixed_dictionaries({
            "seed": ids.seeds, "T": st.just(T), "pos": st.integers(0, T - 1),
            "step": st.integers(0, 11)})),
        tolerance="model_tolerance: 64 (L + 1) (D + F + S) u sqrt(D) max|g| max_v |W_v|",
        ops=MODEL_FORWARD_OPS, fn=_causality),
    Identity(
        name="model_kv_cache_decode", topic="model",
        statement="Prefilling P tokens into the KV cache and feeding N more in chunks (one "
                  "token at a time, or several at once after the cached prefix) gives the "
                  "logits of one full forward over all P + N tokens.",
        equation=r"[z_{0:P}, z_{P:P+c_1}, \ldots]_{\mathrm{cached}} = z(x_{0:P+N}), \ "
                 r"N = \sum_i c_i",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "P": st.integers(1, 6),
                                        "chunks": st.lists(st.integers(1, 3), min_size=1,
                                                           max_size=3)}),  # P + N <= 15
        tolerance="model_tolerance",
        ops=MODEL_FORWARD_OPS, fn=_kv_cache),
    Identity(
        name="model_gqa_equals_repeated_mha", topic="model",
        statement="A GQA model computes the same logits as the MHA model whose K/V weights "
                  "repeat each KV head's rows for the G query heads of its group.",
        equation=r"z_{GQA}(x; W_k, W_v) = z_{MHA}(x; \mathrm{rep}_G(W_k), \mathrm{rep}_G(W_v))",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "KVH": st.integers(1, 3),
                                        "G": st.integers(1, 3), "T": st.integers(1, 6)}),
        tolerance="model_tolerance",
        ops=MODEL_FORWARD_OPS, fn=_gqa_repeated),
    Identity(
        name="model_head_permutation", topic="model",
        statement="Relabelling the heads (KV groups by pi, query heads within each group by "
                  "sigma_j; rows of wq, wk, wv and columns of wo follow) leaves the model's "
                  "function unchanged; moving the KV heads alone changes it.",
        equation=r"z(x; W_q^{\rho}, W_k^{\pi}, W_v^{\pi}, W_o^{\rho}) = z(x; W_q, W_k, W_v, W_o)",
        strategy=_PERMUTE,
        tolerance="model_tolerance",
        ops=MODEL_FORWARD_OPS, fn=_head_permutation),
    Identity(
        name="model_batch_independence", topic="model",
        statement="Each sequence's logits are the same alone as in a batch.",
        equation=r"z(X)_b = z(X_b)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "B": st.integers(2, 4),
                                        "T": st.integers(1, 7)}),
        tolerance="model_tolerance",
        ops=MODEL_FORWARD_OPS, fn=_batch_forward),
    Identity(
        name="model_batch_gradient_is_mean", topic="model",
        statement="The gradient of the mean loss over a batch of B equally long sequences is "
                  "the mean of the B sequences' own gradients.",
        equation=r"\nabla_\theta L(X) = \frac{1}{B} \sum_b \nabla_\theta L(X_b)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "B": st.integers(2, 4),
                                        "T": st.integers(1, 7)}),
        tolerance="64 (L + 1) (D + F + T + V) u times the largest entry of the sequences' "
                  "gradients: a gradient whose terms cancel (wq's with one position) is held to "
                  "the scale of the terms",
        ops=MODEL_TRAIN_OPS, fn=_batch_gradient),
]
