"""Property tests (hypothesis) of the notes' claims about the pieces LLaMA chose against.

Each property is stated so that it fails for the wrong op: e.g. the RMSNorm shift test demands a
change that LayerNorm would not show, the BatchNorm coupling test demands a change that a per-row
norm never shows, the sinusoidal test demands a dependence on absolute position that RoPE lacks.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama import ModelConfig, Transformer
from minillama.core import ops
from minillama.model import latent
from minillama.model.gqa import convert_gqa
from minillama.model.transformer import init_params

FAST = settings(max_examples=25, deadline=None)
SLOW = settings(max_examples=8, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def rows(seed, n=3, d=8):
    return np.random.default_rng(seed).standard_normal((n, d))


# ---------------------------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, c=st.floats(-50, 50), a=st.floats(0.05, 50))
def test_layernorm_invariant_to_shift_and_scale(seed, c, a):
    x = rows(seed)
    g, b = np.random.default_rng(seed + 1).standard_normal((2, 8))
    y, _ = ops.layernorm_forward(x, g, b, 0.0)
    ys, _ = ops.layernorm_forward(a * x + c, g, b, 0.0)
    np.testing.assert_allclose(ys, y, rtol=1e-7, atol=1e-7)


@FAST
@given(seed=seeds, a=st.floats(0.05, 50), c=st.floats(0.5, 50))
def test_rmsnorm_invariant_to_scale_but_not_to_shift(seed, a, c):
    x = rows(seed)
    g = np.ones(8)
    y, _ = ops.rmsnorm_forward(x, g, 0.0)
    np.testing.assert_allclose(ops.rmsnorm_forward(a * x, g, 0.0)[0], y, rtol=1e-9, atol=1e-12)
    # adding c to every entry moves each row towards c * (1, ..., 1) / rms: a visible change
    shifted, _ = ops.rmsnorm_forward(x + c, g, 0.0)
    assert np.abs(shifted - y).max() > 1e-3


@FAST
@given(seed=seeds, i=st.integers(0, 4), delta=st.floats(0.5, 5.0))
def test_batchnorm_couples_the_batch_per_row_norms_do_not(seed, i, delta):
    x = np.random.default_rng(seed).standard_normal((5, 6))
    x2 = x.copy()
    x2[i] += delta * np.sign(x2[i] + 1e-12)  # change one sample
    others = [j for j in range(5) if j != i]
    g, b = np.ones(6), np.zeros(6)
    bn = ops.batchnorm_forward(x, g, b, 1e-5)[0], ops.batchnorm_forward(x2, g, b, 1e-5)[0]
    assert np.abs(bn[0][others] - bn[1][others]).max() > 1e-3
    ln = ops.layernorm_forward(x, g, b, 1e-5)[0], ops.layernorm_forward(x2, g, b, 1e-5)[0]
    np.testing.assert_array_equal(ln[0][others], ln[1][others])
    rn = ops.rmsnorm_forward(x, g, 1e-5)[0], ops.rmsnorm_forward(x2, g, 1e-5)[0]
    np.testing.assert_array_equal(rn[0][others], rn[1][others])


# ---------------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, m=st.integers(1, 60), n=st.integers(0, 60), s=st.integers(1, 60))
def test_sinusoidal_scores_depend_on_absolute_positions_rope_only_on_offset(seed, m, n, s):
    D = 16
    rng = np.random.default_rng(seed)
    e_a, e_b = rng.standard_normal((2, D)) * 0.3
    Wq, Wk = rng.standard_normal((2, D, D)) / np.sqrt(D)
    P = ops.sinusoidal_positions(128, D, dtype=np.float64)

    def sin_score(i, j):
        return float((e_a + P[i]) @ Wq.T @ ((e_b + P[j]) @ Wk.T))

    # the same offset m - n at two absolute places gives a different score
    assert abs(sin_score(m, n) - sin_score(m + s, n + s)) > 1e-6
    cos, sin = ops.rope_tables(D, 128, dtype=np.float64)

    def rope_score(i, j):
        q = ops.rope_forward((e_a @ Wq.T)[None, None, None], cos[i:i + 1], sin[i:i + 1])[0]
        k = ops.rope_forward((e_b @ Wk.T)[None, None, None], cos[j:j + 1], sin[j:j + 1])[0]
        return float(np.sum(q * k))

    assert abs(rope_score(m, n) - rope_score(m + s, n + s)) < 1e-9


# ---------------------------------------------------------------------------------------------
# cross-attention and the latent block
# ---------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, T=st.integers(1, 9), kvh=st.sampled_from([1, 2, 4]))
def test_cross_attention_with_itself_is_noncausal_self_attention(seed, T, kvh):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, 4, 8))
    k, v = rng.standard_normal((2, 2, T, kvh, 8))
    o, _ = ops.cross_attention_forward(q, k, v)
    # the causal op with every key visible: queries placed at the last position
    full, _ = ops.attention_forward(q, k, v, start_pos=T - 1)
    np.testing.assert_allclose(o, full, rtol=1e-10, atol=1e-12)
    if T > 1:  # and it differs from causal self-attention (the first query sees only key 0)
        causal, _ = ops.attention_forward(q, k, v, start_pos=0)
        assert np.abs(o - causal).max() > 1e-6


@SLOW
@given(seed=seeds, L=st.integers(2, 12))
def test_latent_block_is_permutation_invariant_without_positions(seed, L):
    cfg = latent.LatentConfig(dim=8, n_latents=3, n_heads=2, n_kv_heads=1, hidden_dim=16)
    rng = np.random.default_rng(seed)
    p = latent.init_block(cfg, rng)
    z, _ = ops.latent_expand_forward(rng.standard_normal((3, 8)), 2)
    x = rng.standard_normal((2, L, 8))
    perm = rng.permutation(L)
    a, _ = latent.latent_block_forward(z, x, p, 2, 1)
    b, _ = latent.latent_block_forward(z, x[:, perm], p, 2, 1)
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # adding positions to the inputs breaks it (unless the permutation is the identity)
    if (perm != np.arange(L)).any():
        P = ops.sinusoidal_positions(L, 8, dtype=np.float64)
        c, _ = latent.latent_block_forward(z, x + P, p, 2, 1)
        d, _ = latent.latent_block_forward(z, x[:, perm] + P, p, 2, 1)
        assert np.abs(c - d).max() > 1e-9


# ---------------------------------------------------------------------------------------------
# convert-gqa
# ---------------------------------------------------------------------------------------------
def _mha(seed, H=4):
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=H, n_kv_heads=H, vocab_size=13, hidden_dim=24,
                      max_seq_len=12)
    return cfg, init_params(cfg, seed=seed, dtype=np.float64)


@SLOW
@given(seed=seeds)
def test_convert_gqa_identity_when_groups_equal_heads(seed):
    cfg, params = _mha(seed % 1000)
    cfg2, p2 = convert_gqa(cfg, params, cfg.n_heads)
    assert cfg2 == cfg
    for k in params:
        np.testing.assert_array_equal(p2[k], params[k])


@SLOW
@given(seed=seeds, G=st.sampled_from([1, 2]))
def test_convert_gqa_exact_when_heads_of_a_group_are_equal(seed, G):
    cfg, params = _mha(seed % 1000)
    H, hd = cfg.n_heads, cfg.head_dim
    for name in list(params):
        if name.endswith(("wk.weight", "wv.weight")):  # make the heads of each group equal
            w = params[name].reshape(G, H // G, hd, cfg.dim)
            params[name] = np.repeat(w[:, :1], H // G, axis=1).reshape(H * hd, cfg.dim)
    tok = np.random.default_rng(seed).integers(0, 13, (2, 7))
    before = Transformer(cfg, params, dtype=np.float64).forward(tok)
    cfg2, p2 = convert_gqa(cfg, params, G)
    assert cfg2.n_kv_heads == G and p2["layers.0.attention.wk.weight"].shape == (G * hd, 16)
    np.testing.assert_allclose(Transformer(cfg2, p2, dtype=np.float64).forward(tok), before,
                               rtol=1e-10, atol=1e-12)
    # with unequal heads the conversion changes the model: the equality above is not vacuous
    cfg3, p3 = _mha(seed % 1000)
    after = Transformer(*convert_gqa(cfg3, p3, G), dtype=np.float64).forward(tok)
    assert np.abs(after - Transformer(cfg3, p3, dtype=np.float64).forward(tok)).max() > 1e-9


# ---------------------------------------------------------------------------------------------
# logit scale and post-norm
# ---------------------------------------------------------------------------------------------
@settings(max_examples=5, deadline=None)
@given(seed=seeds)
def test_logit_std_grows_like_sqrt_width_and_the_scale_flattens_it(seed):
    """z = h W^T with unit-RMS h and W ~ N(0, sigma^2): std(z) = sqrt(D) sigma; s = 1/sqrt(D)
    makes it sigma at every width."""
    rng = np.random.default_rng(seed)
    sigma, stds, scaled = 0.02, [], []
    widths = [16, 64, 256, 1024]
    for D in widths:
        h, _ = ops.rmsnorm_forward(rng.standard_normal((64, D)), np.ones(D), 1e-6)
        z, _ = ops.linear_forward(h, rng.normal(0, sigma, (512, D)))
        stds.append(z.std())
        scaled.append(ops.logit_scale_forward(z, 1 / np.sqrt(D))[0].std())
    ratio = np.array(stds) / (np.sqrt(widths) * sigma)
    assert np.all(np.abs(ratio - 1) < 0.1), ratio  # grows like sqrt(D) ...
    assert stds[-1] / stds[0] > 6  # ... 8x over a 64x wider model
    assert np.all(np.abs(np.array(scaled) / sigma - 1) < 0.1), scaled  # flat with the scale


@SLOW
@given(seed=seeds, norm=st.sampled_from(["rmsnorm", "layernorm"]))
def test_post_norm_blocks_output_normalised_rows(seed, norm):
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=4, vocab_size=13, max_seq_len=8, norm=norm,
                      norm_position="post", pos_encoding="sinusoidal", ffn="gelu")
    m = Transformer(cfg, dtype=np.float64, seed=seed % 1000)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 16)) * 3 + 1
    for layer in range(cfg.n_layers):
        y, _ = m._block_forward(layer, x, None, None, None, 0)
        if norm == "rmsnorm":
            np.testing.assert_allclose(np.sqrt((y * y).mean(-1)), 1.0, rtol=1e-4)
        else:
            np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-9)
            np.testing.assert_allclose(y.std(-1), 1.0, rtol=1e-4)
        # a pre-norm block does not normalise its output
        pre = Transformer(ModelConfig(**{**cfg.to_dict(), "norm_position": "pre"}),
                          m.params, dtype=np.float64)
        yp, _ = pre._block_forward(layer, x, None, None, None, 0)
        assert np.abs(np.sqrt((yp * yp).mean(-1)) - 1).max() > 0.1
