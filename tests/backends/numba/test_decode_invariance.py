r"""Same input, same output, in the numba backend's fused decode steps
(backends/numba/decode/float_step.py, decode/quant_step.py): a sequence's logits and K/V rows do not
depend on the thread count the tuner picks, nor, on GGML-block weights, on the sequences batched
with it.

What fixes the order of every float sum: each product row is one kernel call whatever the split
of the rows over threads; attention cuts the cache rows of a sequence at position p into spans
of ``float_step.SPAN`` rows starting at 0 (never into one span per thread), each span's softmax
parts are computed by one thread, and the spans are joined in order; RMSNorm, RoPE and SwiGLU
are computed per row. So the results are asserted equal bit for bit, at positions that cross
several spans."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.model.transformer import Transformer, init_params

try:
    NUMBA = get_backend("numba")
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)

from minillama.backends.numba.backend_decode import (  # noqa: E402
    _NO_IDS,
    _NO_IDS_2D,
    _model_args,
)
from minillama.backends.numba.decode import float_step as decode  # noqa: E402
from tests.backends.numba.decode.test_quant_step import quant_model  # noqa: E402
from tests.backends.numba.quant.test_matmul import random_matrix  # noqa: E402

S = 3 * decode.SPAN + 20  # contexts long enough for three spans and part of a fourth
LENS = [decode.SPAN + 7, 2 * decode.SPAN + 30, 5, decode.SPAN]


def _prefilled(model, rng, lens):
    """A cache of len(lens) rows, row b prefilled with lens[b] random tokens."""
    cache = model.new_cache(len(lens), S)
    for b, n in enumerate(lens):
        prompt = rng.integers(0, model.cfg.vocab_size, (1, int(n)))
        model.forward(prompt, 0, cache.rows(b, b + 1), last_only=True)
    return cache


def _copy(model, cache):
    out = model.new_cache(cache.batch_size, S)
    for a, r in zip(out.k + out.v, cache.k + cache.v):
        a[...] = r
    return out


def _one(model, cache, b, tok, pos, threads):
    """Row b of the cache stepped alone by the one-sequence fused kernel on ``threads`` parts."""
    plan = NUMBA._decode_plan(model)
    kc, vc = NUMBA._cache_lists(cache.rows(b, b + 1), model.dtype)
    logits = np.empty((1, model.cfg.vocab_size), np.float32)
    NUMBA._step_one(plan, np.array([tok], np.int64), np.array([pos], np.int64), kc, vc, logits,
                    _NO_IDS, _NO_IDS, threads)
    return logits[0]


@pytest.fixture
def numba_threads():
    """Restores Numba's thread count after a test that changes it."""
    before = numba.get_num_threads()
    yield numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(before)


@pytest.mark.parametrize("mode", ["int8", "float"])
def test_quantized_decode_is_thread_invariant(mode, monkeypatch, numba_threads):
    """The one-sequence step on GGML blocks: the same logits and K/V rows bit for bit on 1, 2
    and 3 parts and with Numba's pool at one thread or all of them."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", mode)
    model = quant_model(("Q4_1", "Q4_K", "Q8_0"), seed=7, max_seq_len=S)
    rng = np.random.default_rng(8)
    base = _prefilled(model, rng, LENS[:2])
    tok = rng.integers(0, model.cfg.vocab_size, 2)
    runs = []
    for pool, threads in ((1, 1), (numba_threads, 2), (numba_threads, 3), (1, 2)):
        numba.set_num_threads(pool)
        cache = _copy(model, base)
        z = [_one(model, cache, b, int(tok[b]), LENS[b], threads) for b in range(2)]
        runs.append((z, cache))
    z0, c0 = runs[0]
    for z, cache in runs[1:]:
        for b in range(2):
            np.testing.assert_array_equal(z[b], z0[b])
        for a, r in zip(cache.k + cache.v, c0.k + c0.v):
            np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize("kv", ["auto", "f32"])
def test_quantized_batched_step_equals_each_row_alone_on_any_thread_count(monkeypatch,
                                                                          numba_threads, kv):
    """The step of several sequences on GGML blocks (continuous batching) gives each row the
    logits and K/V the one-sequence step gives it alone, bit for bit, though the batch runs on
    2 parts and each row alone on 1 (the tuner picks each batch size's count on its own); with
    the default half cache and a float32 one; blocks of 32 (4 rows of x per decoding of W) and
    K-quants (one)."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "int8")
    model = quant_model(("Q4_1", "Q8_0", "Q4_K", "Q6_K"), seed=9, max_seq_len=S)
    model.kv_cache = kv
    assert model.kv_dtype == (np.float16 if kv == "auto" else np.float32)
    rng = np.random.default_rng(10)
    base = _prefilled(model, rng, LENS)
    B, V = len(LENS), model.cfg.vocab_size
    tok = rng.integers(0, V, B)
    batch = _copy(model, base)
    plan = NUMBA._decode_plan(model)
    kc, vc = NUMBA._cache_lists(batch, model.dtype)
    got = np.empty((B, V), np.float32)
    NUMBA._step_rows_q(plan, tok.astype(np.int64), np.array(LENS, np.int64),
                       np.arange(B, dtype=np.int64), kc, vc, got, 2)
    alone = _copy(model, base)
    numba.set_num_threads(1)
    for b in range(B):
        np.testing.assert_array_equal(got[b], _one(model, alone, b, int(tok[b]), LENS[b], 1))
    for a, r in zip(batch.k + batch.v, alone.k + alone.v):
        np.testing.assert_array_equal(a, r)


def test_float_decode_step_is_thread_invariant(numba_threads):
    """The one-sequence step of a float32 model: the same logits bit for bit on 1 and 2 parts
    (its products are one dot per row, its attention in spans of SPAN rows)."""
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=71,
                      hidden_dim=256, multiple_of=64, max_seq_len=S)
    model = Transformer(cfg, init_params(cfg, seed=11, dtype=np.float32), backend="numba",
                        dtype=np.float32)
    rng = np.random.default_rng(12)
    base = _prefilled(model, rng, LENS[1:2])
    tok = int(rng.integers(0, cfg.vocab_size))
    runs = []
    for pool, threads in ((1, 1), (numba_threads, 2)):
        numba.set_num_threads(pool)
        runs.append(_one(model, _copy(model, base), 0, tok, LENS[1], threads))
    np.testing.assert_array_equal(runs[1], runs[0])


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_float_batched_step_equals_each_row_alone_on_any_thread_count(numba_threads, kv):
    """The step of several sequences of a float32 model gives each row the logits and K/V rows
    the one-sequence step gives it alone, bit for bit, the batch on 2 parts and each row alone
    on 1, at positions that cross several attention spans; with a float32 and a half cache."""
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=71,
                      hidden_dim=256, multiple_of=64, max_seq_len=S)
    model = Transformer(cfg, init_params(cfg, seed=15, dtype=np.float32), backend="numba",
                        dtype=np.float32)
    model.kv_cache = kv
    rng = np.random.default_rng(16)
    base = _prefilled(model, rng, LENS)
    B, V = len(LENS), cfg.vocab_size
    tok = rng.integers(0, V, B)
    batch = _copy(model, base)
    plan = NUMBA._decode_plan(model)
    kc, vc = NUMBA._cache_lists(batch, model.dtype)
    got = np.empty((B, V), np.float32)
    NUMBA._decode.decode_step(tok.astype(np.int64), np.array(LENS, np.int64),
                              np.arange(B, dtype=np.int64), *_model_args(plan, kc, vc), got, 2,
                              _NO_IDS, _NO_IDS_2D)
    alone = _copy(model, base)
    numba.set_num_threads(1)
    for b in range(B):
        np.testing.assert_array_equal(got[b], _one(model, alone, b, int(tok[b]), LENS[b], 1))
    for a, r in zip(batch.k + batch.v, alone.k + alone.v):
        np.testing.assert_array_equal(a, r)


def _copy_rows(model, src, n, B=1):
    """A new cache of B rows holding src's first n positions in row 0."""
    out = model.new_cache(B, S)
    for a, r in zip(out.k + out.v, src.k + src.v):
        a[0, :n] = r[0, :n]
    return out


def test_a_prompt_gives_the_same_logits_cold_after_a_cached_prefix_and_beside_others(
        monkeypatch, numba_threads):
    """Block weights, 8-bit products: a prompt's last-position logits and K/V rows are the same
    bit for bit prefilled cold, after a cached prefix of another prompt's rows (the server's
    prefix cache), beside longer prompts in a padded group, and on another thread count: its
    rows but the last are computed row by row alike (the integer GEMM for any row count,
    attention in the decode steps' spans), its last token by the decode step."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "int8")
    model = quant_model(("Q4_1", "Q4_K", "Q8_0"), seed=13, max_seq_len=S)
    rng = np.random.default_rng(14)
    V = model.cfg.vocab_size
    P = decode.SPAN + 26
    prompt = rng.integers(0, V, (1, P))
    cold = model.new_cache(1, S)
    z = model.forward(prompt, 0, cold, last_only=True)[0]
    # an earlier request that shared the first c tokens, its rows kept by the prefix cache
    for c in (P - 2, P - 1, 40, 5):
        other = np.concatenate([prompt[:, :c], rng.integers(0, V, (1, 9))], axis=1)
        earlier = model.new_cache(1, S)
        model.forward(other, 0, earlier, last_only=True)
        warm = _copy_rows(model, earlier, c)
        got = model.forward(prompt[:, c:], c, warm, last_only=True)[0]
        np.testing.assert_array_equal(got, z)
        # a rest of one token is a decode step, as it is alone: its K/V row is the step's, not
        # the prefill's that the cold prompt keeps (Transformer.prefill_start never leaves a
        # front end such a rest); every row before it is a prefill's
        n = P - 1 if c == P - 1 else P
        for a, r in zip(warm.k + warm.v, cold.k + cold.v):
            np.testing.assert_array_equal(a[0, :n], r[0, :n])
    # a padded group: the prompt beside a longer and a shorter one
    longer = rng.integers(0, V, (1, P + 30))
    block = np.concatenate([np.concatenate([prompt, np.zeros((1, 30), np.int64)], axis=1),
                            longer, np.concatenate([prompt[:, :7], np.zeros((1, P + 23),
                                                                            np.int64)], axis=1)])
    group = model.new_cache(3, S)
    zg = model.forward(block, 0, group, output_index=np.array([P - 1, P + 29, 6]))
    np.testing.assert_array_equal(zg[0], z)
    for a, r in zip(group.k + group.v, cold.k + cold.v):
        np.testing.assert_array_equal(a[0, :P], r[0, :P])
    numba.set_num_threads(1)
    one = model.new_cache(1, S)
    np.testing.assert_array_equal(model.forward(prompt, 0, one, last_only=True)[0], z)


#: layer types of the models below: the blocks of 32 with a Q8_0 embedding; the K-quants (sub-blocks
#: of 32 and of 16) beside a block of 32, with a Q4_1 embedding (an offset: the embedding rows of
#: both sides come from one kernel)
INVARIANT_MODELS = {"blocks of 32": (("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1"), "Q8_0"),
                    "K-quants": (("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "Q5_1"), "Q4_1")}


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("kind", sorted(INVARIANT_MODELS))
def test_decode_steps_compute_a_position_as_the_prefill(monkeypatch, numba_threads, kv, kind):
    """Every type of the integer GEMM (each with a lanes kernel), 8-bit products: a prompt fed
    one token at a time by decode steps (one sequence, and beside another in the several-row
    step) writes the K/V rows one prefill of it writes and gets its logits, bit for bit, at
    positions that cross spans, on a half and a float32 cache, on one thread and two; so the
    model keeps every row of a reply (reusable_rows) and a model with a type that has none
    (IQ4_NL) does not."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "int8")
    types_, emb = INVARIANT_MODELS[kind]
    model = quant_model(types_, seed=21, max_seq_len=S)
    model.params["tok_embeddings.weight"] = random_matrix(emb, 67, 256, np.random.default_rng(3))
    model.kv_cache = kv
    assert model.backend.prefill_decode_invariant(model) and not model.decode_rows_differ
    assert model.reusable_rows(10, 30) == 30
    iq = quant_model(("Q4_1", "IQ4_NL"), seed=21, max_seq_len=S)
    assert not iq.backend.prefill_decode_invariant(iq)
    rng = np.random.default_rng(22)
    P = decode.SPAN + 26
    prompt = rng.integers(0, 67, (1, P))
    other = rng.integers(0, 67, (1, P))
    for threads in (1, 2):
        numba.set_num_threads(threads)
        cold = model.new_cache(1, S)
        want = model.forward(prompt, 0, cold, last_only=True)[0]
        one = model.new_cache(1, S)
        pair = model.new_cache(2, S)
        for t in range(P):
            z = model.forward(prompt[:, t:t + 1], t, one, last_only=True)[0]
            zz = model.forward(np.array([[prompt[0, t]], [other[0, t]]]), t, pair,
                               last_only=True)
        np.testing.assert_array_equal(z, want)
        np.testing.assert_array_equal(zz[0], want)
        for c, o, p in zip(cold.k + cold.v, one.k + one.v, pair.k + pair.v):
            np.testing.assert_array_equal(o[0, :P], c[0, :P])
            np.testing.assert_array_equal(p[0, :P], c[0, :P])
