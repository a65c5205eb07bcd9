"""KV cache: size at GQA width, and prefill + cached decode == one full forward (property)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.model.kvcache import KVCache
from minillama.model.transformer import Transformer


@st.composite
def configs(draw):
    hd = draw(st.sampled_from([2, 4, 8]))
    H = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["mha", "gqa", "mqa"]))
    KVH = {"mha": H, "mqa": 1, "gqa": max(1, H // 2)}[kind]
    return ModelConfig(dim=H * hd, n_layers=draw(st.integers(1, 2)), n_heads=H, n_kv_heads=KVH,
                       vocab_size=draw(st.integers(5, 40)), hidden_dim=draw(st.integers(3, 24)),
                       max_seq_len=24, rope_theta=draw(st.sampled_from([100.0, 10000.0])),
                       tie_embeddings=draw(st.booleans()))


def _model(cfg, backend, dtype, seed):
    from minillama.model.transformer import init_params
    # std 0.5 (not 0.02) so attention is far from uniform and position errors would show
    params = init_params(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for v in params.values():
        v[...] = rng.normal(0, 0.5, v.shape) if v.ndim == 2 else rng.uniform(0.5, 1.5, v.shape)
    return Transformer(cfg, params, backend=backend, dtype=dtype)


@pytest.mark.parametrize("kvh", [4, 2, 1])
def test_cache_bytes_formula(kvh):
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=kvh, vocab_size=10, max_seq_len=20)
    for dtype in (np.float32, np.float64):
        c = KVCache(cfg, batch_size=2, max_seq_len=16, dtype=dtype)
        assert c.nbytes == 2 * 3 * 2 * 16 * kvh * 8 * np.dtype(dtype).itemsize
        assert c.k[0].shape == (2, 16, kvh, 8)  # GQA width, never the H repeated heads


def test_cache_longer_than_context_is_an_error():
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=10, max_seq_len=8)
    with pytest.raises(MinillamaError, match="exceeds the model context"):
        KVCache(cfg, 1, 9)
    m = Transformer(cfg)
    cache = m.new_cache(1, 4)
    m.forward([[1, 2, 3]], cache=cache)
    with pytest.raises(MinillamaError, match="exceeds the KV cache length"):
        m.forward([[1, 2]], start_pos=3, cache=cache)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture],
          deadline=None)
@given(cfg=configs(), data=st.data())
def test_prefill_then_decode_equals_full_forward(backend, dtype, tol, cfg, data):
    T = data.draw(st.integers(2, 12), label="T")
    split = data.draw(st.integers(1, T - 1), label="split")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    m = _model(cfg, backend.name, dtype, seed)
    toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, T))
    full = np.asarray(backend.to_numpy(m.forward(toks)), dtype=np.float64)
    cache = m.new_cache(1)
    got = [backend.to_numpy(m.forward(toks[:, :split], cache=cache))]
    for t in range(split, T):
        got.append(backend.to_numpy(m.forward(toks[:, t:t + 1], start_pos=t, cache=cache)))
    got = np.concatenate(got, axis=1).astype(np.float64)
    scale = max(1.0, np.abs(full).max())
    assert np.abs(got - full).max() <= tol * scale
    # last_only in prefill gives exactly that row
    cache2 = m.new_cache(1)
    last = backend.to_numpy(m.forward(toks[:, :split], cache=cache2, last_only=True))
    assert np.abs(last - full[:, split - 1]).max() <= tol * scale


@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture],
          deadline=None)
@given(cfg=configs(), data=st.data())
def test_batched_ragged_decode_equals_each_alone(backend, cfg, data):
    """Right-padded prompts of different lengths: per-sequence start_pos in one batch gives the
    logits each sequence gets alone."""
    B = data.draw(st.integers(2, 3), label="B")
    lens = [data.draw(st.integers(1, 8), label=f"len{b}") for b in range(B)]
    steps = data.draw(st.integers(1, 4), label="steps")
    m = _model(cfg, backend.name, np.float64, 7)
    rng = np.random.default_rng(sum(lens))
    seqs = [rng.integers(0, cfg.vocab_size, size=n + steps) for n in lens]
    # each alone
    alone = []
    for s, n in zip(seqs, lens):
        c = m.new_cache(1)
        rows = [backend.to_numpy(m.forward(s[None, :n], cache=c, last_only=True))[0]]
        for j in range(steps):
            rows.append(backend.to_numpy(
                m.forward(s[None, n + j:n + j + 1], start_pos=n + j, cache=c, last_only=True))[0])
        alone.append(np.stack(rows))
    # batched
    Tm = max(lens)
    block = np.zeros((B, Tm), dtype=np.int64)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        block[b, :n] = s[:n]
    c = m.new_cache(B)
    lens_a = np.array(lens)
    rows = [backend.to_numpy(m.forward(block, cache=c, output_index=lens_a - 1))]
    for j in range(steps):
        nxt = np.array([[s[n + j]] for s, n in zip(seqs, lens)])
        rows.append(backend.to_numpy(m.forward(nxt, start_pos=lens_a + j, cache=c, last_only=True)))
    batched = np.stack(rows, axis=1)  # (B, steps+1, V)
    for b in range(B):
        np.testing.assert_allclose(batched[b], alone[b], rtol=0, atol=1e-10)


def test_the_storage_follows_the_kind_the_weights_and_the_backend():
    """"auto" takes half precision for block-quantized float32 models on a backend that keeps
    half caches and the compute dtype otherwise; "f16" where it cannot be kept is refused."""
    from types import SimpleNamespace

    from minillama.model.kvcache import kv_storage_dtype

    half, none = (SimpleNamespace(name=n, half_kv_cache=h) for n, h in (("numba", True),
                                                                       ("cupy", False)))
    f16, f32, f64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
    for kind, dtype, blocks, be, want in [
            ("auto", f32, True, half, f16), ("auto", f32, False, half, f32),
            ("auto", f64, True, half, f64), ("auto", f32, True, none, f32),
            ("f16", f32, False, half, f16), ("f32", f32, True, half, f32),
            ("f32", f64, False, none, f64)]:
        assert kv_storage_dtype(kind, dtype, blocks, be) == want, (kind, dtype, blocks, be)
    for kind, dtype, be in [("f16", f64, half), ("f16", f32, none), ("bf16", f32, half)]:
        with pytest.raises(MinillamaError):
            kv_storage_dtype(kind, dtype, False, be)


class _RoundingCache(KVCache):
    """A float32 cache that rounds each written K/V row to half precision and back."""

    def update(self, layer, k_new, v_new, start_pos):
        half = [a.astype(np.float16).astype(np.float32) for a in (k_new, v_new)]
        return super().update(layer, *half, start_pos)


@pytest.mark.parametrize("backend_name", ["reference", "numpy"])
def test_a_half_cache_is_the_float32_math_on_k_and_v_rounded_to_half(backend_name):
    """With ``kv_cache = "f16"`` the cache stores float16 (half the bytes) and a prefill and the
    decode steps after it give, bit for bit, the logits of a float32 cache whose rows are
    rounded to half as they are written: the model widens what it reads exactly and changes
    nothing else."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40,
                      hidden_dim=48, max_seq_len=24)
    m = _model(cfg, backend_name, np.float32, 3)
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 12))
    f32 = m.new_cache(1)
    m.kv_cache = "f16"
    half = m.new_cache(1)
    assert half.k[0].dtype == np.float16 and half.nbytes * 2 == f32.nbytes
    rounded = _RoundingCache(cfg, 1, dtype=np.float32)
    for cache in (half, rounded):
        rows = [m.forward(toks[:, :7], cache=cache)]
        rows += [m.forward(toks[:, t:t + 1], start_pos=t, cache=cache) for t in range(7, 12)]
        cache.logits = np.concatenate(rows, axis=1)
    np.testing.assert_array_equal(half.logits, rounded.logits)
    for a, r in zip(half.k + half.v, rounded.k + rounded.v):
        np.testing.assert_array_equal(a.astype(np.float32), r)


def test_kept_rows_are_put_back_and_the_rest_stays_written():
    """``KVCache.kept``: the named (sequence, position) rows of every layer's K and V are as they
    were before the block, also when it raises; every other write in it stays; none named is a
    no-op."""
    cfg = ModelConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=5, hidden_dim=4,
                      max_seq_len=6)
    cache = KVCache(cfg, 3, dtype=np.float32)
    for i, a in enumerate(cache.k + cache.v):
        a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape) + 100 * i
    before = [a.copy() for a in cache.k + cache.v]
    with pytest.raises(RuntimeError):
        with cache.kept([0, 2], [4, 1]):
            for a in cache.k + cache.v:
                a[...] = -1.0
            raise RuntimeError("a failing step")
    for a, b in zip(cache.k + cache.v, before):
        assert np.array_equal(a[[0, 2], [4, 1]], b[[0, 2], [4, 1]])
        rest = np.ones(a.shape[:2], dtype=bool)
        rest[[0, 2], [4, 1]] = False
        assert (a[rest] == -1.0).all()
    with cache.kept([], []):
        cache.k[0][1, 3] = 7.0
    assert (cache.k[0][1, 3] == 7.0).all()
