"""Property tests (hypothesis) of the ops and the model: invariances the math guarantees.

Shapes are small and max_examples modest so the file runs in seconds. Whole-model properties take
the ``backend`` fixture (stateless objects, so sharing one across hypothesis examples is safe).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import lively_params, require_float64
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minillama import ModelConfig, Transformer
from minillama.core import ops

FIXTURE_OK = settings(max_examples=12, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow])
FAST = settings(max_examples=30, deadline=None)

seeds = st.integers(0, 2**32 - 1)


def host(backend, a):
    return np.asarray(backend.to_numpy(a), dtype=np.float64)


f64_or_skip = require_float64


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def rotate(x, positions, theta=10000.0):
    """x: (T, hd) at the given absolute positions (T,), via the model's tables and op."""
    hd = x.shape[-1]
    cos, sin = ops.rope_tables(hd, int(max(positions)) + 1, theta, np.float64)
    pos = np.asarray(positions)
    y, _ = ops.rope_forward(x[None, :, None, :], cos[pos], sin[pos])
    return y[0, :, 0, :]


@FAST
@given(seed=seeds, half=st.integers(1, 16), m=st.integers(0, 2000), n=st.integers(0, 2000),
       shift=st.integers(0, 2000), theta=st.sampled_from([10000.0, 500000.0]))
def test_rope_relative_position(seed, half, m, n, shift, theta):
    """<R(m) q, R(n) k> = <R(m+s) q, R(n+s) k>: the score depends only on m - n."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, 2 * half))
    a = rotate(q, [m], theta) @ rotate(k, [n], theta).T
    b = rotate(q, [m + shift], theta) @ rotate(k, [n + shift], theta).T
    # cos/sin of angles up to 4000 rad are exact to ~1e-13 in float64
    assert abs(a - b).item() <= 1e-10 * np.linalg.norm(q) * np.linalg.norm(k)


@FAST
@given(seed=seeds, half=st.integers(1, 16), T=st.integers(1, 6), start=st.integers(0, 5000))
def test_rope_preserves_norm_and_zero_is_identity(seed, half, T, start):
    rng = np.random.default_rng(seed)
    x = 10.0 * rng.standard_normal((T, 2 * half))
    y = rotate(x, np.arange(start, start + T))
    # each pair is rotated by an orthogonal 2x2 matrix: every pair keeps its norm
    np.testing.assert_allclose(np.hypot(y[:, 0::2], y[:, 1::2]),
                               np.hypot(x[:, 0::2], x[:, 1::2]), rtol=1e-12)
    y0 = rotate(x, np.zeros(T, dtype=np.int64))
    np.testing.assert_array_equal(y0, x)  # cos 0 = 1, sin 0 = 0 exactly


def test_rope_rotates_interleaved_pairs_at_documented_frequencies():
    """Pair i of position m turns by m * base^(-2i/hd) (Meta/llama2.c layout, not half-split)."""
    hd, m = 8, 3
    x = np.zeros((1, hd))
    x[0, 0::2] = 1.0  # each pair starts at (1, 0)
    y = rotate(x, [m])
    angles = np.arctan2(y[0, 1::2], y[0, 0::2])
    expect = m * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(angles, expect, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, D=st.integers(1, 64), a=st.floats(0.05, 20.0), eps=st.sampled_from([1e-6, 1e-5]))
def test_rmsnorm_scale_invariance(seed, D, a, eps):
    r"""RMSNorm(a x) = x / sqrt(ms + eps/a^2) exactly, which differs from RMSNorm(x) only by eps.
    With ms = mean(x^2): |RMSNorm(ax) - RMSNorm(x)| / |RMSNorm(x)| <= |1/a^2 - 1| eps / (2 ms)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, D)) + 0.5
    g = rng.standard_normal(D)
    y1, _ = ops.rmsnorm_forward(a * x, g, eps)
    y0, _ = ops.rmsnorm_forward(x, g, eps)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    bound = abs(1.0 / a**2 - 1.0) * eps / (2 * ms)
    rel = np.linalg.norm(y1 - y0, axis=-1, keepdims=True) / np.linalg.norm(y0, axis=-1,
                                                                           keepdims=True)
    assert np.all(rel <= 1.01 * bound + 1e-13)
    # and the exact identity: scaling x by a is the same as dividing eps by a^2
    y2, _ = ops.rmsnorm_forward(x, g, eps / a**2)
    np.testing.assert_allclose(y1, y2, rtol=1e-12, atol=1e-14)


@FAST
@given(seed=seeds, D=st.integers(1, 64), scale=st.floats(0.1, 100.0))
def test_rmsnorm_unit_gain_unit_rms(seed, D, scale):
    """With g = 1 the output's RMS is sqrt(ms / (ms + eps)) = 1 - eps/(2 ms) + O(eps^2)."""
    eps = 1e-5
    rng = np.random.default_rng(seed)
    x = scale * (rng.standard_normal((4, D)) + 0.3)
    y, _ = ops.rmsnorm_forward(x, np.ones(D), eps)
    ms = np.mean(x * x, axis=-1)
    rms = np.sqrt(np.mean(y * y, axis=-1))
    assert np.all(np.abs(rms - 1.0) <= eps / (2 * ms) + 1e-12)


# ---------------------------------------------------------------------------------------------
# softmax / cross-entropy
# ---------------------------------------------------------------------------------------------
@FAST
@given(seed=seeds, N=st.integers(1, 5), V=st.integers(1, 30), shift=st.floats(-1e3, 1e3))
def test_softmax_shift_invariance(seed, N, V, shift):
    rng = np.random.default_rng(seed)
    x = 5 * rng.standard_normal((N, V))
    c = shift * rng.random((N, 1))
    p = ops.softmax(x)
    np.testing.assert_allclose(ops.softmax(x + c), p, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-14)
    t = rng.integers(0, V, N)
    l0, _ = ops.cross_entropy_forward(x, t)
    l1, _ = ops.cross_entropy_forward(x + c, t)
    assert float(l1) == pytest.approx(float(l0), rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# attention statistics
# ---------------------------------------------------------------------------------------------
def test_scaled_scores_have_unit_variance():
    r"""For q, k with i.i.d. N(0,1) entries, s = q.k/\sqrt{hd} has mean 0 and variance exactly 1
    (a sum of hd products of variance 1, divided by sqrt(hd)).

    The score is read off the op's output: with two visible keys, k_0 = 0 (score 0) and k_1 = k,
    and values v_0 = 0, v_1 = e_0, the output's first entry is P_1 = sigmoid(s), so
    s = log(o / (1 - o)). n = B H = 16000 scores; the sample variance has std
    sqrt(Var(s^2)/n) = sqrt((2 + 6/hd)/n) ~ 0.011 (heads of one KV group share k, which adds a
    little correlation), so |var - 1| < 0.1 is a ~9 sigma bound. A missing or doubled 1/sqrt(hd)
    gives variance hd = 64 or 1/64; using 1/hd gives 1/64 too.
    """
    rng = np.random.default_rng(2024)
    B, H, KVH, hd = 2000, 8, 4, 64
    q = rng.standard_normal((B, 1, H, hd))
    k = np.zeros((B, 2, KVH, hd))
    k[:, 1] = rng.standard_normal((B, KVH, hd))
    v = np.zeros((B, 2, KVH, hd))
    v[:, 1, :, 0] = 1.0
    o, _ = ops.attention_forward(q, k, v, start_pos=1)
    p1 = o[:, 0, :, 0]
    s = np.log(p1 / (1.0 - p1))
    direct = np.einsum("bhd,bhd->bh", q[:, 0], np.repeat(k[:, 1], H // KVH, axis=1)) / np.sqrt(hd)
    np.testing.assert_allclose(s, direct, rtol=1e-8, atol=1e-8)  # the readout is exact
    assert abs(s.mean()) < 0.05  # std of the mean ~ 1/sqrt(16000) = 0.008
    assert abs(s.var() - 1.0) < 0.1, s.var()


@FAST
@given(seed=seeds, T=st.integers(1, 6), extra=st.integers(0, 4), G=st.integers(1, 3),
       KVH=st.integers(1, 3))
def test_attention_gqa_equals_repeated_mha(seed, T, extra, G, KVH):
    """GQA on shared K/V equals MHA on K/V repeated G times per group (query h -> KV h // G)."""
    rng = np.random.default_rng(seed)
    B, hd, S = 2, 4, T + extra
    q = rng.standard_normal((B, T, KVH * G, hd))
    k = rng.standard_normal((B, S, KVH, hd))
    v = rng.standard_normal((B, S, KVH, hd))
    o, _ = ops.attention_forward(q, k, v, extra)
    o_mha, _ = ops.attention_forward(q, np.repeat(k, G, axis=2), np.repeat(v, G, axis=2), extra)
    np.testing.assert_allclose(o, o_mha, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# whole-model properties
# ---------------------------------------------------------------------------------------------
def make_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    return lively_params(cfg, seed, scale=0.2)


def cfg_of(H, KVH, hd=4, L=2, V=13, tie=True):
    return ModelConfig(dim=H * hd, n_layers=L, n_heads=H, n_kv_heads=KVH, vocab_size=V,
                       hidden_dim=20, max_seq_len=16, tie_embeddings=tie)


@FIXTURE_OK
@given(seed=seeds, T=st.integers(2, 8), t=st.data())
def test_causality(backend, seed, T, t):
    dtype = f64_or_skip(backend)
    cfg = cfg_of(4, 2)
    rng = np.random.default_rng(seed)
    model = Transformer(cfg, make_params(cfg, seed), backend=backend, dtype=dtype)
    tok = rng.integers(0, cfg.vocab_size, (2, T))
    pos = t.draw(st.integers(0, T - 1))
    tok2 = tok.copy()
    tok2[:, pos] = (tok[:, pos] + 1 + rng.integers(0, cfg.vocab_size - 1)) % cfg.vocab_size
    a = host(backend, model.forward(tok))
    b = host(backend, model.forward(tok2))
    np.testing.assert_allclose(a[:, :pos], b[:, :pos], rtol=0, atol=1e-12)
    assert np.abs(a[:, pos] - b[:, pos]).max() > 1e-6  # the change does reach position pos


@FIXTURE_OK
@given(seed=seeds, B=st.integers(2, 4), T=st.integers(1, 7))
def test_batch_independence(backend, seed, B, T):
    dtype = f64_or_skip(backend)
    cfg = cfg_of(4, 1)
    rng = np.random.default_rng(seed)
    model = Transformer(cfg, make_params(cfg, seed), backend=backend, dtype=dtype)
    tok = rng.integers(0, cfg.vocab_size, (B, T))
    full = host(backend, model.forward(tok))
    for b in range(B):
        alone = host(backend, model.forward(tok[b:b + 1]))
        np.testing.assert_allclose(full[b:b + 1], alone, rtol=1e-10, atol=1e-12)
    # and per-sequence losses/gradients: the batch gradient is the mean of the singles' gradients
    tgt = rng.integers(0, cfg.vocab_size, (B, T))
    _, g = model.loss_and_grads(tok, tgt)
    singles = [model.loss_and_grads(tok[b:b + 1], tgt[b:b + 1])[1] for b in range(B)]
    for k in ("layers.0.attention.wk.weight", "tok_embeddings.weight"):
        mean = sum(host(backend, s[k]) for s in singles) / B
        np.testing.assert_allclose(host(backend, g[k]), mean, rtol=1e-9, atol=1e-12)


@FIXTURE_OK
@given(seed=seeds, KVH=st.integers(1, 3), G=st.integers(1, 3), T=st.integers(1, 6))
def test_gqa_equals_mha_with_repeated_kv_weights(backend, seed, KVH, G, T):
    dtype = f64_or_skip(backend)
    hd = 4
    cfg = cfg_of(KVH * G, KVH, hd)
    mha = cfg_of(KVH * G, KVH * G, hd)
    p = make_params(cfg, seed)
    p_mha = dict(p)
    for layer in range(cfg.n_layers):
        for w in ("wk", "wv"):
            name = f"layers.{layer}.attention.{w}.weight"
            p_mha[name] = np.repeat(p[name].reshape(KVH, hd, -1), G, axis=0).reshape(KVH * G * hd,
                                                                                     -1)
    tok = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, T))
    a = host(backend, Transformer(cfg, p, backend=backend, dtype=dtype).forward(tok))
    b = host(backend, Transformer(mha, p_mha, backend=backend, dtype=dtype).forward(tok))
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@FIXTURE_OK
@given(seed=seeds, KVH=st.integers(1, 3), G=st.integers(1, 3), data=st.data())
def test_head_permutation_invariance(backend, seed, KVH, G, data):
    """Relabel the heads: KV groups permuted by pi (rows of wk, wv and the group's query heads
    move together), query heads permuted within each group by sigma_j; rows of wq and columns
    of wo follow. The model computes the same function."""
    dtype = f64_or_skip(backend)
    hd, H = 4, KVH * G
    cfg = cfg_of(H, KVH, hd)
    p = make_params(cfg, seed)
    pi = data.draw(st.permutations(range(KVH)))
    sig = [data.draw(st.permutations(range(G))) for _ in range(KVH)]
    assume(list(pi) != list(range(KVH)) or any(list(s) != list(range(G)) for s in sig))
    q_order = [pi[j] * G + sig[j][g] for j in range(KVH) for g in range(G)]
    rows_q = np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in q_order])
    rows_kv = np.concatenate([np.arange(j * hd, (j + 1) * hd) for j in pi])
    p2 = dict(p)
    for layer in range(cfg.n_layers):
        pre = f"layers.{layer}.attention."
        p2[pre + "wq.weight"] = p[pre + "wq.weight"][rows_q]
        p2[pre + "wo.weight"] = p[pre + "wo.weight"][:, rows_q]
        p2[pre + "wk.weight"] = p[pre + "wk.weight"][rows_kv]
        p2[pre + "wv.weight"] = p[pre + "wv.weight"][rows_kv]
    tok = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 6))
    a = host(backend, Transformer(cfg, p, backend=backend, dtype=dtype).forward(tok))
    b = host(backend, Transformer(cfg, p2, backend=backend, dtype=dtype).forward(tok))
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    if KVH > 1 and list(pi) != list(range(KVH)):
        # moving the KV heads without their query heads does change the function
        p3 = dict(p)
        for layer in range(cfg.n_layers):
            pre = f"layers.{layer}.attention."
            p3[pre + "wk.weight"] = p2[pre + "wk.weight"]
            p3[pre + "wv.weight"] = p2[pre + "wv.weight"]
        c = host(backend, Transformer(cfg, p3, backend=backend, dtype=dtype).forward(tok))
        assert np.abs(a - c).max() > 1e-6


@FIXTURE_OK
@given(seed=seeds, P=st.integers(1, 6), N=st.integers(1, 5))
def test_kv_cache_decode_matches_full_forward(backend, seed, P, N):
    """Prefill P tokens into the cache, then decode N tokens one by one: same logits as one
    full forward over all P + N tokens."""
    dtype = f64_or_skip(backend)
    cfg = cfg_of(4, 2)
    model = Transformer(cfg, make_params(cfg, seed), backend=backend, dtype=dtype)
    tok = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, P + N))
    full = host(backend, model.forward(tok))
    cache = model.new_cache(2)
    got = [host(backend, model.forward(tok[:, :P], start_pos=0, cache=cache))]
    for i in range(P, P + N):
        got.append(host(backend, model.forward(tok[:, i:i + 1], start_pos=i, cache=cache)))
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, rtol=1e-10, atol=1e-12)
