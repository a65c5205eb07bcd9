"""Generation: the stories260K golden ids, sampling rules, stop conditions, batching, streaming."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.sampling import candidates, check_sampling, sample
from minillama.infer.generate import GenerationStats, TextStreamer, generate, generate_steps, stream
from minillama.io.load import load_model
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import Transformer, init_params


def _model(backend="numpy", dtype=np.float64, seed=0, **kw):
    args = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=48,
                max_seq_len=64)
    args.update(kw)
    cfg = ModelConfig(**args)
    params = init_params(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for v in params.values():
        if v.ndim == 2:
            v[...] = rng.normal(0, 0.3, v.shape)
    return Transformer(cfg, params, backend=backend, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# the golden fixture
# ---------------------------------------------------------------------------------------------
def test_stories260k_greedy_matches_golden(shared_data, backend):
    gold = [int(x) for x in (shared_data / "stories260K.greedy.txt").read_text().split()]
    assert len(gold) == 64
    model, tok = load_model(shared_data / "stories260K.bin", backend=backend.name)
    assert tok is None and model.cfg.n_kv_heads == 4 and model.cfg.n_heads == 8
    out = generate(model, [1], max_new_tokens=64, temperature=0.0)
    assert out == gold


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_top_k_1_is_greedy():
    rng = np.random.default_rng(0)
    z = rng.normal(size=100)
    assert sample(z, None, 0.0) == int(np.argmax(z))
    for _ in range(20):
        assert sample(z, rng, 1.5, top_k=1) == int(np.argmax(z))


def _brute_nucleus(z, t, k, p):
    probs = np.exp(z / t - np.log(np.exp(z / t).sum()))
    order = np.argsort(-probs, kind="stable")
    if k is not None:
        order = order[:k]
    if p is not None:
        c = np.cumsum(probs[order])
        n = int(np.argmax(c >= p)) + 1 if (c >= p).any() else len(order)
        order = order[:n]
    kept = probs[order]
    return order, kept / kept.sum()


@pytest.mark.parametrize("V", [7, 300, 5000])
@pytest.mark.parametrize("t,k,p", [(1.0, None, 0.9), (0.7, 40, None), (1.3, 50, 0.5),
                                   (1.0, None, 0.999), (2.0, 3, 0.99), (1.0, None, None)])
def test_candidates_match_a_full_sort(V, t, k, p):
    z = np.random.default_rng(V).normal(scale=3.0, size=V)
    ids, probs = candidates(z, t, k, p)
    ref_ids, ref_p = _brute_nucleus(z, t, k, p)
    if k is None and p is None:  # unfiltered: vocabulary order, no sort at all
        np.testing.assert_array_equal(ids, np.arange(V))
        order = np.argsort(-probs, kind="stable")
        ids, probs = ids[order], probs[order]
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(probs, ref_p, rtol=1e-12, atol=1e-15)
    assert abs(probs.sum() - 1) < 1e-12


def test_sampling_frequencies_follow_the_distribution():
    z = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))
    rng = np.random.default_rng(1)
    n = 20000
    counts = np.bincount([sample(z, rng, 1.0) for _ in range(n)], minlength=5) / n
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.015)
    # top-p 0.8 keeps {0, 1, 2} (0.5 + 0.25 < 0.8 <= 0.9), renormalised
    counts = np.bincount([sample(z, rng, 1.0, top_p=0.8) for _ in range(n)], minlength=5) / n
    np.testing.assert_allclose(counts, np.array([0.5, 0.25, 0.15, 0, 0]) / 0.9, atol=0.015)
    # temperature 0.5 squares the odds
    sq = np.array([0.5, 0.25, 0.15, 0.07, 0.03]) ** 2
    counts = np.bincount([sample(z, rng, 0.5) for _ in range(n)], minlength=5) / n
    np.testing.assert_allclose(counts, sq / sq.sum(), atol=0.015)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=float("nan")),
                                dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings(kw):
    with pytest.raises(MinillamaError):
        check_sampling(**kw)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------
def test_greedy_generation_equals_argmax_of_full_forward():
    m = _model()
    prompt = [3, 1, 4, 1, 5]
    out = generate(m, prompt, max_new_tokens=12)
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(np.argmax(m.forward(np.array([seq]))[0, -1])))
    assert out == seq[len(prompt):]


def test_generation_on_a_given_cache_from_a_cached_prefix():
    """generate_steps on a cache whose first positions another call filled (the chat turns'
    path): the prompt's rest is prefilled from there, the tokens are those of a fresh run, the
    cache holds the prompt and the tokens fed (stats.positions), the sequence's generator is
    the one given; a cache given with several prompts or with the whole prompt cached is
    refused."""
    m = _model()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(m, prompt, max_new_tokens=6)
    cache = m.new_cache(1, 32)
    m.forward(np.array([prompt[:5] + [7, 7]]), cache=cache)  # another prompt sharing 5 tokens
    stats = GenerationStats()
    got = [t for step in generate_steps(m, [prompt], 6, stats=stats, cache=cache, cached=5)
           for _, t in step]
    assert got == want and stats.prompt_tokens == 3
    assert stats.positions == len(prompt) + 5  # the last new token is not fed
    rng = np.random.default_rng(4)
    drawn = [t for step in generate_steps(m, [prompt], 6, cache=m.new_cache(1, 32),
                                          temperature=1.0, rngs=[rng]) for _, t in step]
    assert drawn == generate(m, prompt, max_new_tokens=6, temperature=1.0, seed=4)
    for kw in (dict(prompts=[prompt, prompt], cached=0), dict(prompts=[prompt], cached=8)):
        with pytest.raises(MinillamaError, match="a given cache takes one prompt"):
            list(generate_steps(m, kw["prompts"], 3, cache=m.new_cache(1, 32),
                                cached=kw["cached"]))


def test_seed_makes_sampling_reproducible():
    m = _model()
    a = generate(m, [1, 2], max_new_tokens=20, temperature=1.0, top_p=0.95, seed=5)
    b = generate(m, [1, 2], max_new_tokens=20, temperature=1.0, top_p=0.95, seed=5)
    c = generate(m, [1, 2], max_new_tokens=20, temperature=1.0, top_p=0.95, seed=6)
    assert a == b and len(a) == 20
    assert a != c


def test_stop_token_ends_generation_and_is_not_returned():
    m = _model()
    free = generate(m, [1, 2], max_new_tokens=15)
    assert len(free) == 15
    stop = free[5]
    first = free.index(stop)
    out = generate(m, [1, 2], max_new_tokens=15, stop_ids=[stop])
    assert out == free[:first]


def test_max_new_tokens_and_end_of_context():
    m = _model(max_seq_len=10)
    assert generate(m, [1, 2, 3], max_new_tokens=0) == []
    assert len(generate(m, [1, 2, 3], max_new_tokens=4)) == 4
    # prompt 3 + 8 new = 11 > 10: the 8th token would be sampled past the context; only 8 fit
    # (token k lands at position 3 + k - 1 <= 10 is sampled from position <= 9)
    out = generate(m, [1, 2, 3], max_new_tokens=100)
    assert len(out) == 10 - 3 + 1
    with pytest.raises(MinillamaError, match="longer than the model context"):
        generate(m, list(range(11)), max_new_tokens=1)
    with pytest.raises(MinillamaError, match="at least one token"):
        generate(m, [], max_new_tokens=1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_generation_equals_each_alone(backend, temperature):
    m = _model(backend=backend.name)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [4, 4, 2, 8]]
    alone = [generate(m, p, max_new_tokens=10, temperature=temperature, top_k=20, seed=11,
                      stop_ids=[7]) for p in prompts]
    batched = generate(m, prompts, max_new_tokens=10, temperature=temperature, top_k=20, seed=11,
                       stop_ids=[7])
    assert batched == alone


def test_a_seeded_prompt_samples_the_same_text_wherever_it_stands_in_a_batch(backend):
    """Sequence b's generator does not depend on b: the same prompt first, last and alone."""
    m = _model(backend=backend.name)
    p, other = [4, 4, 2, 8], [1, 2, 3]
    kw = dict(max_new_tokens=12, temperature=1.0, seed=5)
    first = generate(m, [p, other, other], **kw)[0]
    last = generate(m, [other, other, p], **kw)[2]
    assert first == last == generate(m, p, **kw)


def test_batched_sequences_stop_independently():
    m = _model()
    prompts = [[1, 2], [3, 4, 5]]
    free = generate(m, prompts, max_new_tokens=8)
    stop = free[0][2]
    out = generate(m, prompts, max_new_tokens=8, stop_ids=[stop])
    for f, o in zip(free, out):
        assert o == (f[:f.index(stop)] if stop in f else f)


def test_streaming_and_callback_and_stats():
    m = _model()
    seen = []
    stats = GenerationStats()
    out = generate(m, [1, 2, 3], max_new_tokens=6, callback=lambda b, t: seen.append((b, t)),
                   stats=stats)
    assert seen == [(0, t) for t in out]
    assert list(stream(m, [1, 2, 3], max_new_tokens=6)) == out
    steps = list(generate_steps(m, [[1, 2, 3]], max_new_tokens=6))
    assert [s[0][1] for s in steps] == out  # one token per model call
    assert stats.prompt_tokens == 3 and stats.new_tokens == 6 and stats.decode_steps == 5
    c = m.cfg
    assert stats.cache_bytes == 2 * c.n_layers * 1 * 9 * c.n_kv_heads * c.head_dim * 8
    assert stats.prefill_s > 0 and stats.decode_s > 0


def test_text_streamer_never_splits_characters():
    tok = ByteTokenizer()
    text = "héllo 🦙 wörld"
    ids = tok.encode(text, bos=False)
    s = TextStreamer(tok, [tok.bos_id])
    pieces = [s.start()] + [s.put(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_numba_decode_gemv_matches_blas():
    """The numba backend's few-row linear (the decode GEMV) equals x W^T."""
    from minillama.backends import get_backend
    from minillama.core.errors import MinillamaError as E
    try:
        be = get_backend("numba")
    except E as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(0)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-13)):
        w = rng.standard_normal((37, 29)).astype(dtype)
        for shape in ((1, 1, 29), (2, 1, 29), (1, 2, 29), (4, 1, 29), (5, 1, 29), (29,)):
            x = rng.standard_normal(shape).astype(dtype)
            y, ctx = be.linear_forward(x, w)
            assert y.shape == shape[:-1] + (37,) and y.dtype == dtype
            np.testing.assert_allclose(y, x @ w.T, rtol=tol, atol=tol)
            dx, dw = be.linear_backward(np.ones_like(y), ctx)
            assert dx.shape == x.shape and dw.shape == w.shape
