r"""Identities of the pieces LLaMA chose against (docs/MATH.md part II), each stated so that the
wrong piece fails it: LayerNorm is shift invariant and RMSNorm is not, BatchNorm couples the
rows of a batch and the per-row norms do not, sinusoidal positions are absolute and RoPE's are
relative, cross-attention with itself is attention without the mask, a latent block without
positions ignores the order of its inputs, MHA -> GQA pooling keeps equal heads' function, and
a post-norm block normalises its output rows.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core import notes_latent, notes_ops
from minillama.core.config import ModelConfig
from minillama.identities import strategies as ids
from minillama.identities.base import (
    MODEL_FORWARD_OPS,
    Identity,
    Subject,
    attention_bound,
    contrast_floor,
    differs,
    model_scale,
    model_tolerance,
    ratio,
    with_helpers,
)
from minillama.identities.model import lively_params
from minillama.identities.rows import table_error
from minillama.model.gqa import convert_gqa
from minillama.model.transformer import Transformer


def _rows(ex: dict, s: Subject, n: int = 3) -> np.ndarray:
    return np.random.default_rng(ex["seed"]).standard_normal((n, ex["D"])).astype(s.dtype)


def _layernorm_shift_scale(s: Subject, ex: dict) -> float:
    x = _rows(ex, s)
    D = x.shape[-1]
    g, b = np.random.default_rng([ex["seed"], 1]).standard_normal((2, D))
    a, c = ex["a"], ex["c"]
    x64 = x.astype(np.float64)
    xs = (a * x64 + c).astype(s.dtype)
    y, ys = s.layernorm(x, g, b, 0.0), s.layernorm(xs, g, b, 0.0)
    sigma = x64.std(axis=-1, keepdims=True)
    spread = (np.abs(xs.astype(np.float64)).max(-1, keepdims=True) / (a * sigma)
              + np.abs(x64).max(-1, keepdims=True) / sigma)
    return ratio(ys - y, 4 * (D + 4) * s.u * (spread * np.abs(g) + np.abs(b)))


def _rmsnorm_not_shift(s: Subject, ex: dict) -> float:
    x = _rows(ex, s)
    D = x.shape[-1]
    y = s.rmsnorm(x, np.ones(D), 0.0)
    ys = s.rmsnorm(x.astype(np.float64) + ex["c"], np.ones(D), 0.0)
    return differs(ys - y, contrast_floor(2 * (D + 12) * s.u, 1.0))


def _rows_independent(kind: str):
    """Change one row of a batch: BatchNorm's other rows change, the per-row norm's do not."""

    def check(s: Subject, ex: dict) -> float:
        x = np.random.default_rng(ex["seed"]).standard_normal((ex["N"], ex["D"]))
        i, N, D = ex["i"], ex["N"], ex["D"]
        x2 = x.copy()
        x2[i] += ex["delta"] * np.where(x2[i] >= 0, 1.0, -1.0)
        others = [j for j in range(N) if j != i]
        g, b = np.ones(D), np.zeros(D)
        bn = (notes_ops.batchnorm_forward(x, g, b, 1e-5)[0]
              - notes_ops.batchnorm_forward(x2, g, b, 1e-5)[0])
        if kind == "rmsnorm":
            y, y2 = s.rmsnorm(x, g, 1e-5), s.rmsnorm(x2, g, 1e-5)
        else:
            y, y2 = s.layernorm(x, g, b, 1e-5), s.layernorm(x2, g, b, 1e-5)
        tol = 2 * (D + 12) * s.u * (1 + np.abs(y[others]))
        return max(ratio(y[others] - y2[others], tol), differs(bn[others], 1e-3))

    return check


def _sinusoidal(s: Subject, ex: dict) -> float:
    D, (m, n, sh) = 16, (ex["m"], ex["n"], ex["s"])
    rng = np.random.default_rng(ex["seed"])
    e_a, e_b = rng.standard_normal((2, D)) * 0.3
    Wq, Wk = rng.standard_normal((2, D, D)) / np.sqrt(D)
    P = notes_ops.sinusoidal_positions(128, D, dtype=np.float64)

    def sin_score(i, j):
        return float((e_a + P[i]) @ Wq.T @ ((e_b + P[j]) @ Wk.T))

    q = (e_a @ Wq.T).reshape(1, 1, 1, D).astype(s.dtype)
    k = (e_b @ Wk.T).reshape(1, 1, 1, D).astype(s.dtype)

    def rope_score(i, j):
        return float(np.sum(s.rotate(q, [i]) * s.rotate(k, [j])))

    qk = np.linalg.norm(q) * np.linalg.norm(k)
    tol = (16 * table_error(s, max(m, n) + sh) + (32 + 4 * D) * s.u) * qk
    rope = ratio(rope_score(m, n) - rope_score(m + sh, n + sh), tol)
    return max(rope, differs(sin_score(m, n) - sin_score(m + sh, n + sh), 1e-6))


def _cross_self(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    T, kvh = ex["T"], ex["KVH"]
    q = rng.standard_normal((2, T, 4, 8)).astype(s.dtype)
    k, v = rng.standard_normal((2, 2, T, kvh, 8)).astype(s.dtype)
    o = s.cross_attention(q, k, v)
    tol = attention_bound(q, k, v, s.u)
    worst = ratio(o - s.attention(q, k, v, T - 1), tol)  # the last position sees every key
    if T > 1:  # causal self-attention differs: query 0 sees key 0 only
        causal = s.attention(q, k, v, 0)
        worst = max(worst, differs(o - causal, contrast_floor(tol.max(), np.abs(v).max())))
    return worst


def _latent_permutation(s: Subject, ex: dict) -> float:
    cfg = notes_latent.LatentConfig(dim=8, n_latents=3, n_heads=2, n_kv_heads=1, hidden_dim=16)
    rng = np.random.default_rng(ex["seed"])
    p = notes_latent.init_block(cfg, rng, dtype=s.dtype)
    z, _ = notes_ops.latent_expand_forward(rng.standard_normal((3, 8)).astype(s.dtype), 2)
    L = ex["L"]
    x = rng.standard_normal((2, L, 8)).astype(s.dtype)
    perm = rng.permutation(L)
    a, _ = notes_latent.latent_block_forward(z, x, p, 2, 1)
    b, _ = notes_latent.latent_block_forward(z, x[:, perm], p, 2, 1)
    tol = 64 * (cfg.dim + L + cfg.hidden_dim) * s.u * (np.abs(z).max() + np.abs(a).max())
    worst = ratio(a - b, tol)
    if (perm != np.arange(L)).any():  # with positions added the order matters
        P = notes_ops.sinusoidal_positions(L, 8, dtype=s.dtype)
        c, _ = notes_latent.latent_block_forward(z, x + P, p, 2, 1)
        d, _ = notes_latent.latent_block_forward(z, x[:, perm] + P, p, 2, 1)
        worst = max(worst, differs(c - d, contrast_floor(tol, np.abs(c).max())))
    return worst


def _convert_gqa(s: Subject, ex: dict) -> float:
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=13,
                      hidden_dim=24, max_seq_len=12)
    params = lively_params(cfg, ex["seed"])
    cfg_same, p_same = convert_gqa(cfg, params, cfg.n_heads)  # G = H: nothing changes
    worst = 0.0 if cfg_same == cfg and all(np.array_equal(p_same[k], params[k])
                                           for k in params) else float("inf")
    G, H, hd = ex["G"], cfg.n_heads, cfg.head_dim
    equal = dict(params)
    for name in params:
        if name.endswith(("wk.weight", "wv.weight")):  # the heads of each group made equal
            w = params[name].reshape(G, H // G, hd, cfg.dim)
            equal[name] = np.repeat(w[:, :1], H // G, axis=1).reshape(H * hd, cfg.dim)
    tok = np.random.default_rng(ex["seed"]).integers(0, 13, (2, 7))
    before = s.model(cfg, equal)
    z0 = s.logits(before, tok)
    tol = model_tolerance(before, 7, s.u)
    worst = max(worst, ratio(s.logits(s.model(*convert_gqa(cfg, equal, G)), tok) - z0, tol))
    # with unequal heads the pooling changes the function: the equality above is not vacuous
    z1 = s.logits(s.model(cfg, params), tok)
    z2 = s.logits(s.model(*convert_gqa(cfg, params, G)), tok)
    return max(worst, differs(z2 - z1, contrast_floor(tol, model_scale(before))))


class _NormInputs:
    """A backend whose norm ops also keep their last input (the sum a block normalises)."""

    def __init__(self, backend):
        self._backend, self.last = backend, None

    def __getattr__(self, key):
        return getattr(self._backend, key)

    def rmsnorm_forward(self, x, g, eps):
        self.last = x
        return self._backend.rmsnorm_forward(x, g, eps)

    def layernorm_forward(self, x, g, b, eps):
        self.last = x
        return self._backend.layernorm_forward(x, g, b, eps)


def _post_norm(s: Subject, ex: dict) -> float:
    norm = ex["norm"]
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=4, vocab_size=13, max_seq_len=8, norm=norm,
                      norm_position="post", pos_encoding="sinusoidal", ffn="gelu")
    spy = _NormInputs(with_helpers(s.backend))
    m = Transformer(cfg, backend=spy, dtype=s.dtype, seed=ex["seed"] % 1000)  # gains 1, bias 0
    pre = Transformer(ModelConfig(**{**cfg.to_dict(), "norm_position": "pre"}), m.params,
                      backend=m.backend, dtype=s.dtype)
    x = (np.random.default_rng(ex["seed"]).standard_normal((2, 8, 16)) * 3 + 1).astype(s.dtype)
    D, eps, worst = cfg.dim, cfg.norm_eps, 0.0
    for layer in range(cfg.n_layers):
        y = s.get(m._block_forward(layer, s.put(x), None, None, None, 0)[0])
        h = s.get(spy.last)  # the normalised sum a + FFN(a)
        if norm == "rmsnorm":
            ms = (h * h).mean(-1)
            want = np.sqrt(ms / (ms + eps))
            worst = max(worst, ratio(np.sqrt((y * y).mean(-1)) - want, 2 * (D + 8) * s.u))
        else:
            var = h.var(-1)
            spread = 1 + np.abs(h - h.mean(-1, keepdims=True)).max(-1) / np.sqrt(var)
            tol = 2 * (D + 8) * s.u * spread
            worst = max(worst, ratio(y.mean(-1), tol),
                        ratio(y.std(-1) - np.sqrt(var / (var + eps)), tol))
        yp = s.get(pre._block_forward(layer, s.put(x), None, None, None, 0)[0])
        worst = max(worst, differs(np.sqrt((yp * yp).mean(-1)) - 1, 0.1))  # pre-norm does not
    return worst


_ROW_CHANGE = st.integers(4, 8).flatmap(lambda N: st.fixed_dictionaries({
    "seed": ids.seeds, "N": st.just(N), "D": st.integers(2, 8), "i": st.integers(0, N - 1),
    "delta": st.floats(0.5, 5.0)}))
_NORM_ROWS = "2 (D + 12) u (1 + |y|) for the untouched rows; BatchNorm's must move by 1e-3"

IDENTITIES = [
    Identity(
        name="layernorm_shift_scale_invariance", topic="notes",
        statement="LayerNorm (epsilon 0) ignores both a shift and a positive scale of its input "
                  "row.",
        equation=r"\mathrm{LN}(a x + c; 0) = \mathrm{LN}(x; 0), \ a > 0",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "D": st.integers(4, 32),
                                        "a": st.floats(0.05, 50.0), "c": st.floats(-50, 50)}),
        tolerance="4 (D + 4) u (max|ax + c| / (a sigma) + max|x| / sigma) |g| + |b|: centering "
                  "cancels the shift c, leaving its rounding relative to the spread sigma",
        ops=("layernorm_forward",), fn=_layernorm_shift_scale),
    Identity(
        name="rmsnorm_not_shift_invariant", topic="notes",
        statement="RMSNorm does not centre: adding c to every entry of a row moves its output "
                  "towards the constant row (a change LayerNorm would not show).",
        equation=r"\mathrm{RMSNorm}(x + c\mathbf{1}) \ne \mathrm{RMSNorm}(x)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "D": st.integers(8, 32),
                                        "c": st.floats(0.5, 50.0)}),
        tolerance="a contrast: the outputs must differ by more than 1e-4 (and 10 rounding "
                  "bounds)",
        ops=("rmsnorm_forward",), fn=_rmsnorm_not_shift),
    Identity(
        name="rmsnorm_rows_independent", topic="notes",
        statement="Changing one row of a batch leaves RMSNorm's other output rows unchanged; "
                  "training-mode BatchNorm's other rows change.",
        equation=r"\mathrm{RMSNorm}(X')_j = \mathrm{RMSNorm}(X)_j, \ "
                 r"\mathrm{BN}(X')_j \ne \mathrm{BN}(X)_j \ (j \ne i)",
        strategy=_ROW_CHANGE, tolerance=_NORM_ROWS,
        ops=("rmsnorm_forward",), fn=_rows_independent("rmsnorm")),
    Identity(
        name="layernorm_rows_independent", topic="notes",
        statement="Changing one row of a batch leaves LayerNorm's other output rows unchanged; "
                  "training-mode BatchNorm's other rows change.",
        equation=r"\mathrm{LN}(X')_j = \mathrm{LN}(X)_j, \ "
                 r"\mathrm{BN}(X')_j \ne \mathrm{BN}(X)_j \ (j \ne i)",
        strategy=_ROW_CHANGE, tolerance=_NORM_ROWS,
        ops=("layernorm_forward",), fn=_rows_independent("layernorm")),
    Identity(
        name="sinusoidal_positions_are_absolute", topic="notes",
        statement="With sinusoidal positions added to the embeddings, the same offset at two "
                  "absolute places gives different scores; with RoPE the same scores.",
        equation=r"s_{sin}(m, n) \ne s_{sin}(m + s, n + s), \ s_{RoPE}(m, n) = "
                 r"s_{RoPE}(m + s, n + s)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "m": st.integers(1, 60),
                                        "n": st.integers(0, 60), "s": st.integers(1, 60)}),
        tolerance="RoPE side as rope_relative_position; sinusoidal scores must differ by 1e-6",
        ops=("rope_forward",), fn=_sinusoidal),
    Identity(
        name="cross_attention_self_is_unmasked_attention", topic="notes",
        statement="Cross-attention of a sequence with itself is self-attention without the "
                  "causal mask (causal attention with every key visible), and differs from "
                  "causal self-attention.",
        equation=r"\mathrm{xattn}(Q, K, V) = \mathrm{attn}(Q, K, V; p = T - 1)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "T": st.integers(1, 9),
                                        "KVH": st.sampled_from((1, 2, 4))}),
        tolerance="attention_bound",
        ops=("cross_attention_forward", "attention_forward"), fn=_cross_self),
    Identity(
        name="latent_block_permutation_invariance", topic="notes",
        statement="A latent (Perceiver-style) block reads its inputs through cross-attention "
                  "without positions: permuting them leaves its output unchanged; adding "
                  "positions breaks that.",
        equation=r"\mathrm{block}(Z, X_{\pi}) = \mathrm{block}(Z, X)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "L": st.integers(2, 12)}),
        tolerance="64 (D + L + F) u (max|Z| + max|out|): a residual stream of sums over L "
                  "inputs taken in another order",
        ops=(), fn=_latent_permutation),
    Identity(
        name="convert_gqa_keeps_equal_heads", topic="notes",
        statement="Mean-pooling MHA's K/V heads into G groups is the identity for G = H, and "
                  "keeps the model's function when the heads of each group are equal (and "
                  "changes it when they are not).",
        equation=r"z(x; \mathrm{pool}_G(W)) = z(x; W) \text{ when } W^{(h)} = W^{(h')} "
                 r"\text{ within each group}",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "G": st.sampled_from((1, 2))}),
        tolerance="model_tolerance",
        ops=MODEL_FORWARD_OPS, fn=_convert_gqa),
    Identity(
        name="post_norm_rows_normalised", topic="notes",
        statement="A post-norm block's output rows are normalised (unit gain: RMS "
                  "sqrt(ms / (ms + eps)) for RMSNorm, mean 0 and std sqrt(var / (var + eps)) "
                  "for LayerNorm); a pre-norm block's are not.",
        equation=r"y = \mathrm{Norm}(a + \mathrm{FFN}(a)) \Rightarrow \mathrm{rms}(y) = "
                 r"\sqrt{ms / (ms + \epsilon)}",
        strategy=st.fixed_dictionaries({"seed": ids.seeds,
                                        "norm": st.sampled_from(("rmsnorm", "layernorm"))}),
        tolerance="2 (D + 8) u (times 1 + max|h - mean| / std for LayerNorm's centering); the "
                  "pre-norm block's RMS must be off 1 by 0.1",
        ops=("rmsnorm_forward", "layernorm_forward", "linear_forward", "attention_forward",
             "attention_backward", "gelu_forward"), fn=_post_norm),
]
