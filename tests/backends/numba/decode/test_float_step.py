"""The numba backend's fused decode step (backends/numba/decode/float_step.py) against the reference
per-op forward: logits, KV-cache contents, greedy tokens, GQA, per-sequence positions up to the end
of the context, in-place and replaced weights, and what it declines."""

from __future__ import annotations

import types

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.infer.generate import generate
from minillama.io.load import load_model
from minillama.model.kvcache import KVCache
from minillama.model.transformer import Transformer, init_params
from tests.support.errormodel import logits_bound

try:
    NUMBA = get_backend("numba")
    from minillama.backends.tuner import ThreadTuner
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)


def _pair(dtype=np.float32, seed=0, **kw):
    """The same random weights on the numpy (reference) and numba backends."""
    args = dict(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=61, hidden_dim=80,
                max_seq_len=24)
    args.update(kw)
    cfg = ModelConfig(**args)
    params = init_params(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for k, v in params.items():  # larger weights and non-unit gains: errors would show
        v[...] = rng.normal(1.0 if k.endswith("norm.weight") else 0.0, 0.3, v.shape)
    return (Transformer(cfg, params, backend="numpy", dtype=dtype),
            Transformer(cfg, params, backend="numba", dtype=dtype))


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused kernel's calls (so a test knows the fused path ran, not the fallback)."""
    from minillama.backends.numba.decode import float_step as numba_decode

    n = {"calls": 0}

    def counting(kernel):
        def run(*args):
            n["calls"] += 1
            return kernel(*args)
        return run

    monkeypatch.setattr(NUMBA, "_decode", types.SimpleNamespace(
        decode_step=counting(numba_decode.decode_step),
        decode_step_one=counting(numba_decode.decode_step_one)))
    # every call on all threads, as long as asked: the counts below are those of the chunking
    # (the thread tuner's probes, which split calls, are tested in tests/backends/test_tuner.py)
    monkeypatch.setattr(NUMBA, "_tuner", ThreadTuner(NUMBA.num_threads, adapt=False),
                        raising=False)
    return n


def _prefill(model, prompts, S):
    cache = model.new_cache(len(prompts), S)
    for b, pr in enumerate(prompts):  # prompts of different lengths, written row by row
        one = model.new_cache(1, S)
        model.forward(np.array([pr]), cache=one, last_only=True)
        for layer in range(model.cfg.n_layers):
            cache.k[layer][b] = one.k[layer][0]
            cache.v[layer][b] = one.v[layer][0]
    return cache


def _fused_step_matches(ref, fast, calls, lens, rng, tol):
    """Prefill random prompts of ``lens`` tokens on both models, then one decode step at
    per-sequence positions: the fast model takes one fused call, and its logits and every
    cache row equal the reference's within ``tol``. Returns the two caches."""
    S, B, V = ref.cfg.max_seq_len, len(lens), ref.cfg.vocab_size
    prompts = [rng.integers(0, 61, n).tolist() for n in lens]
    c_ref, c_fast = _prefill(ref, prompts, S), _prefill(fast, prompts, S)
    tok = rng.integers(0, 61, (B, 1))
    pos = np.array(lens)
    want = ref.forward(tok, start_pos=pos, cache=c_ref, last_only=True)
    before = calls["calls"]
    got = fast.forward(tok, start_pos=pos, cache=c_fast, last_only=True)
    assert calls["calls"] == before + 1
    assert got.shape == want.shape == (B, V) and got.dtype == ref.dtype
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    for layer in range(ref.cfg.n_layers):
        for got_c, want_c in ((c_fast.k[layer], c_ref.k[layer]), (c_fast.v[layer], c_ref.v[layer])):
            np.testing.assert_allclose(got_c, want_c, rtol=tol, atol=tol * np.abs(want_c).max())
    return c_ref, c_fast


@pytest.mark.parametrize("kvh", [2, 4, 1])
def test_fused_step_matches_reference_per_sequence_positions(calls, kvh):
    ref, fast = _pair(n_kv_heads=kvh)
    rng = np.random.default_rng(1)
    lens = [3, 9, ref.cfg.max_seq_len - 1]  # the last one writes the final slot of the context
    c_ref, c_fast = _fused_step_matches(ref, fast, calls, lens, rng, 2e-5)
    # without last_only the (B, 1, V) shape of the per-op forward
    tok2 = rng.integers(0, 61, (3, 1))
    pos2 = np.array([4, 10, 2])
    w2 = ref.forward(tok2, start_pos=pos2, cache=c_ref)
    g2 = fast.forward(tok2, start_pos=pos2, cache=c_fast)
    assert g2.shape == w2.shape == (3, 1, 61)
    np.testing.assert_allclose(g2, w2, rtol=2e-5, atol=2e-5 * np.abs(w2).max())


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-11)])
def test_many_sequences_match_reference(calls, dtype, tol):
    """13 sequences at their own positions in one step, float32 and float64: every sequence
    gets the reference's logits and cache rows."""
    ref, fast = _pair(dtype=dtype)
    rng = np.random.default_rng(2)
    lens = [int(n) for n in rng.integers(1, ref.cfg.max_seq_len - 1, 13)]
    _fused_step_matches(ref, fast, calls, lens, rng, tol)


@pytest.mark.parametrize("dtype,dim", [(np.float32, 48), (np.float64, 48), (np.float32, 320)])
def test_batched_fused_step_equals_per_sequence_fused_steps(calls, dtype, dim):
    """One fused step of 16 sequences at their own positions gives each sequence the logits and
    cache rows that the single-sequence kernel gives it alone, bit for bit: batching shares
    the reads of the weights and nothing else (dim 320: 16 activation rows over BLOCK_BYTES,
    so W is taken by blocks of rows)."""
    from minillama.backends.numba.decode import float_step

    assert (16 * dim * np.dtype(dtype).itemsize > float_step.BLOCK_BYTES) == (dim == 320)
    _, fast = _pair(dtype=dtype, dim=dim)
    rng = np.random.default_rng(5)
    S, B = fast.cfg.max_seq_len, 16
    prompts = [rng.integers(0, 61, int(n)).tolist() for n in rng.integers(1, S - 1, B)]
    pos = np.array([len(p) for p in prompts])
    tok = rng.integers(0, 61, (B, 1))
    cache = _prefill(fast, prompts, S)
    before = calls["calls"]
    got = fast.forward(tok, start_pos=pos, cache=cache, last_only=True)
    assert calls["calls"] == before + 1
    for b in range(B):
        one = _prefill(fast, [prompts[b]], S)
        before = calls["calls"]
        want = fast.forward(tok[b:b + 1], start_pos=int(pos[b]), cache=one, last_only=True)
        np.testing.assert_array_equal(got[b], want[0])
        for layer in range(fast.cfg.n_layers):
            np.testing.assert_array_equal(cache.k[layer][b], one.k[layer][0])
            np.testing.assert_array_equal(cache.v[layer][b], one.v[layer][0])
        assert calls["calls"] == before + 1


def test_greedy_tokens_equal_reference_batch(calls):
    ref, fast = _pair()
    prompts = [[1, 5, 7], [2], [9, 9, 9, 9, 9]]
    want = generate(ref, prompts, max_new_tokens=30)  # runs into the context end (24)
    got = generate(fast, prompts, max_new_tokens=30)
    assert calls["calls"] == 2  # the 23 decode steps, greedy_steps calls of 16 and 7
    assert got == want
    assert generate(fast, [4, 4], max_new_tokens=12) == generate(ref, [4, 4], max_new_tokens=12)


def test_weights_updated_in_place_or_replaced_are_seen(calls):
    ref, fast = _pair()
    tok = np.array([[3]])

    def step(model):
        cache = model.new_cache(1, 8)
        model.forward(np.array([[1, 2, 3]]), cache=cache)
        return model.forward(tok, start_pos=3, cache=cache, last_only=True)

    np.testing.assert_allclose(step(fast), step(ref), rtol=2e-5, atol=1e-5)
    for m in (ref, fast):
        m.params["layers.1.feed_forward.w2.weight"] *= 3.0  # in place
    np.testing.assert_allclose(step(fast), step(ref), rtol=2e-5, atol=1e-5)
    new = np.random.default_rng(5).normal(0, 0.3, ref.params["layers.0.attention.wq.weight"].shape)
    for m in (ref, fast):
        m.params["layers.0.attention.wq.weight"] = new.astype(np.float32)  # replaced
    np.testing.assert_allclose(step(fast), step(ref), rtol=2e-5, atol=1e-5)
    assert calls["calls"] == 3


def test_float64_matches_reference_tightly(calls):
    ref, fast = _pair(dtype=np.float64)
    c1, c2 = ref.new_cache(2), fast.new_cache(2)
    block = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    ref.forward(block, cache=c1)
    fast.forward(block, cache=c2)
    tok = np.array([[11], [12]])
    want = ref.forward(tok, start_pos=4, cache=c1, last_only=True)
    got = fast.forward(tok, start_pos=4, cache=c2, last_only=True)
    assert calls["calls"] == 1 and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_declines_prefill_and_checks_positions(calls):
    _, fast = _pair()
    cache = fast.new_cache(1, 6)
    assert NUMBA.decode_step(fast, np.array([[1, 2]]), 0, cache) is None  # T > 1: per-op path
    fast.forward(np.array([[1, 2]]), cache=cache)
    assert calls["calls"] == 0
    with pytest.raises(MinillamaError, match="KV cache length"):
        fast.forward(np.array([[3]]), start_pos=6, cache=cache)
    with pytest.raises(MinillamaError, match="context"):
        fast.forward(np.array([[3]]), start_pos=fast.cfg.max_seq_len, cache=fast.new_cache(1))
    with pytest.raises(MinillamaError, match="batch"):
        fast.forward(np.array([[3], [4]]), start_pos=2, cache=cache)


def test_stories260k_golden_ids_through_the_fused_step(shared_data, calls):
    gold = [int(x) for x in (shared_data / "stories260K.greedy.txt").read_text().split()]
    model, _ = load_model(shared_data / "stories260K.bin", backend="numba")
    assert generate(model, [1], max_new_tokens=64, temperature=0.0, speculate=False) == gold
    # the one-token prompt (one fused step), then the 63 greedy steps in calls of 16, 16, 16, 15
    assert calls["calls"] == 5
    # with prompt-lookup drafts (the default) the same ids
    assert generate(model, [1], max_new_tokens=64, temperature=0.0) == gold


@pytest.mark.parametrize("kvh,head_dim", [(2, None), (1, None), (4, 6)])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-11)])
def test_single_sequence_kernel_matches_reference_and_batched_kernel(calls, kvh, head_dim, dtype,
                                                                     tol):
    """B = 1 runs decode_step_one (plain row loops); it must give the reference's logits and
    cache rows, and the batched tile kernel on the same input must agree with it. head_dim 6
    makes RoPE pairs straddle the 4-row tiles of the batched kernel."""
    from minillama.backends.numba.decode import float_step as numba_decode

    extra = {} if head_dim is None else {"head_dim": head_dim}
    ref, fast = _pair(dtype=dtype, n_kv_heads=kvh, **extra)
    S = ref.cfg.max_seq_len
    for n in (1, 7, S - 1):  # position 0, the middle and the last slot of the context
        prompt = np.random.default_rng(n).integers(0, 61, (1, n))
        c_ref, c_fast = ref.new_cache(1, S), fast.new_cache(1, S)
        ref.forward(prompt, cache=c_ref)
        fast.forward(prompt, cache=c_fast)
        c_tile = fast.new_cache(1, S)
        for layer in range(ref.cfg.n_layers):
            c_tile.k[layer][...] = c_fast.k[layer]
            c_tile.v[layer][...] = c_fast.v[layer]
        tok = np.array([[n % 61]])
        want = ref.forward(tok, start_pos=n, cache=c_ref, last_only=True)
        got = fast.forward(tok, start_pos=n, cache=c_fast, last_only=True)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
        for layer in range(ref.cfg.n_layers):
            np.testing.assert_allclose(c_fast.k[layer][0, n], c_ref.k[layer][0, n], rtol=tol,
                                       atol=tol)
            np.testing.assert_allclose(c_fast.v[layer][0, n], c_ref.v[layer][0, n], rtol=tol,
                                       atol=tol)
        plan = NUMBA._decode_plan(fast)
        kc, vc = NUMBA._cache_lists(c_tile, fast.dtype)
        tiled = np.empty_like(got)
        numba_decode.decode_step(
            tok[:, 0].astype(np.int64), np.array([n], np.int64), np.zeros(1, np.int64),
            plan["emb"], plan["out"],
            plan["norm"], *plan["layers"], kc, vc, plan["cos"], plan["sin"], plan["eps"],
            plan["heads"], plan["zero"], tiled, 2, np.zeros(0, np.int64),
            np.zeros((0, 0), np.int64))
        np.testing.assert_allclose(tiled, got, rtol=tol, atol=tol * np.abs(want).max())
    assert calls["calls"] == 4  # three steps, and the one-token prompt of n = 1


class _Frozen(KVCache):
    """A cache that attention reads as it is: ``update`` writes nothing (its rows were copied
    in from another cache)."""

    def update(self, layer, k_new, v_new, start_pos):
        end = int(np.max(start_pos)) + k_new.shape[1]
        return self.k[layer][:, :end], self.v[layer][:, :end]


def test_half_cache_step_matches_reference(calls):
    """A float16 KV cache (``kv_cache = "f16"``): from the same cached rows, the fused step
    (which reads them as half bits and rounds its new row to half in the kernel) writes the new
    K/V row the reference's per-op step writes (NumPy's float16 casts) up to one half step: the
    same float32 numbers up to the order of their sums, each then rounded to the nearest half,
    so an entry may land on the neighbouring half (2^-10 of its row's scale at most). Given the
    fused step's rows, the reference's logits are the fused step's within the rounding bound of
    two float32 evaluations (:func:`tests.support.errormodel.logits_bound`)."""
    ref, fast = _pair()
    ref.kv_cache = fast.kv_cache = "f16"
    S = ref.cfg.max_seq_len
    for n in (1, 7, S - 1):
        prompt = np.random.default_rng(n).integers(0, 61, (1, n))
        c_fast, c_ref = fast.new_cache(1, S), ref.new_cache(1, S)
        assert c_fast.k[0].dtype == np.float16
        fast.forward(prompt, cache=c_fast)
        for a, b in zip(c_ref.k + c_ref.v, c_fast.k + c_fast.v):
            a[...] = b  # the same cached rows
        tok = np.array([[n % 61]])
        before = calls["calls"]
        got = fast.forward(tok, start_pos=n, cache=c_fast, last_only=True)
        assert calls["calls"] == before + 1
        ref.forward(tok, start_pos=n, cache=c_ref, last_only=True)
        for a, b in zip(c_ref.k + c_ref.v, c_fast.k + c_fast.v):
            x, y = a[0, n].astype(np.float32), b[0, n].astype(np.float32)
            np.testing.assert_allclose(y, x, rtol=0, atol=2.0 ** -10 * np.abs(x).max())
            np.testing.assert_array_equal(b[0, :n], a[0, :n])  # the cached rows untouched
        frozen = _Frozen(ref.cfg, 1, S, dtype=np.float16)
        for a, b in zip(frozen.k + frozen.v, c_fast.k + c_fast.v):
            a[...] = b
        want = ref.forward(tok, start_pos=n, cache=frozen, last_only=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=logits_bound(ref, n + 1))


@pytest.mark.parametrize("prompt_len", [1, 5])
def test_greedy_decoder_many_steps_per_call_equals_the_eager_loop(calls, prompt_len):
    """Greedy decoding of one sequence runs several steps per compiled call (GreedyDecoder);
    its tokens, stop rule and budget must be those of the reference backend's eager loop,
    with a stop id met inside a chunk of 16 steps and the context end reached; so must the
    speculative decoder's (the default, below)."""
    ref, fast = _pair(max_seq_len=40)
    prompt = np.random.default_rng(prompt_len).integers(0, 61, prompt_len).tolist()
    full = generate(ref, prompt, max_new_tokens=60)  # runs into the context end
    assert len(full) == 40 - prompt_len + 1
    before = calls["calls"]
    assert generate(fast, prompt, max_new_tokens=60, speculate=False) == full
    assert calls["calls"] - before <= 4  # 40 tokens: one per ~16-step call, not per token
    assert generate(fast, prompt, max_new_tokens=60) == full  # with prompt-lookup drafts
    for cut in (1, 18, len(full) - 2):  # stop at the first occurrence of full[cut]
        stop = full[cut]
        want = generate(ref, prompt, max_new_tokens=60, stop_ids=[stop])
        assert want == full[:full.index(stop)]
        assert generate(fast, prompt, max_new_tokens=60, stop_ids=[stop]) == want
    assert generate(fast, prompt, max_new_tokens=7) == full[:7]


def test_greedy_decoder_reports_nonfinite_logits():
    _, fast = _pair()
    dec = NUMBA.greedy_decoder(fast, 20)
    dec.prefill(np.array([[3, 4]]))
    fast.params["norm.weight"][...] = np.inf  # the next step's logits overflow
    NUMBA._decode_plans.clear()
    with pytest.raises(MinillamaError, match="logits for position 2 hold NaN/inf"):
        dec.more(5)


def test_batched_greedy_steps_replay_the_eager_loop(calls):
    """Greedy decoding of several sequences runs up to 16 steps per compiled call
    (greedy_steps) and replays them step by step: per sequence the reference backend's tokens,
    its stop rule (a stop id met mid-chunk by one sequence only), budget and context end."""
    ref, fast = _pair(max_seq_len=40)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 61, n).tolist() for n in (1, 4, 9, 2, 30)]
    full = generate(ref, prompts, max_new_tokens=60)
    before = calls["calls"]
    assert generate(fast, prompts, max_new_tokens=60) == full
    assert calls["calls"] - before <= 6  # prefill, then one call per <= 16 steps
    stop = full[1][5]  # ends sequence 1 at its 6th token (and any other where it comes first)
    want = generate(ref, prompts, max_new_tokens=60, stop_ids=[stop])
    assert len(want[1]) == full[1].index(stop)
    assert generate(fast, prompts, max_new_tokens=60, stop_ids=[stop]) == want
    assert generate(fast, prompts, max_new_tokens=21) == generate(ref, prompts, max_new_tokens=21)


def test_batched_greedy_steps_report_nonfinite_logits():
    _, fast = _pair()
    cache = fast.new_cache(2, 20)
    fast.forward(np.array([[3, 4], [5, 6]]), 0, cache, last_only=True)
    fast.params["norm.weight"][...] = np.inf
    ids = NUMBA.greedy_steps(fast, np.array([1, 2]), np.array([2, 2]), cache, 5)
    assert ids.shape == (2, 1) and (ids == -1).all()  # the first step's rows, then it stopped
