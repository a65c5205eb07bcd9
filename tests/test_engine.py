"""The continuous-batching engine (minillama/infer/engine.py), without HTTP: batched decode of rows
at different positions equals each row alone, requests sharing the batch get the tokens they get
alone (greedy and seeded sampling), slots are reused and freed, stop strings cut streamed text."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.infer.engine import Engine, StopText
from minillama.infer.generate import generate
from minillama.model.transformer import Transformer, init_params


def _model(backend="numpy", dtype=np.float64, seed=0, max_seq_len=48, tie=True):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, hidden_dim=48,
                      max_seq_len=max_seq_len, tie_embeddings=tie)
    params = init_params(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for v in params.values():  # far from uniform attention, so a wrong position would show
        v[...] = rng.normal(0, 0.5, v.shape) if v.ndim == 2 else rng.uniform(0.5, 1.5, v.shape)
    return Transformer(cfg, params, backend=backend, dtype=dtype)


def test_cache_rows_share_memory():
    m = _model()
    cache = m.new_cache(3, 10)
    view = cache.rows(1, 3)
    assert view.batch_size == 2 and view.max_seq_len == 10
    view.k[0][0, 4] = 7.0
    assert np.all(cache.k[0][1, 4] == 7.0) and np.all(cache.k[0][0, 4] == 0.0)
    with pytest.raises(MinillamaError, match="outside the cache batch"):
        cache.rows(2, 4)


def test_batched_decode_at_different_positions_equals_each_row_alone(backend):
    """Rows prefilled to different lengths (through one-row views of a shared cache) then
    decoded together, each at its own position, give the logits of each row decoded alone."""
    m = _model(backend)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 37, n).tolist() for n in (3, 9, 5)]
    B = len(prompts)
    shared = m.new_cache(B, 32)
    alone = [m.new_cache(1, 32) for _ in prompts]
    last = []
    for b, p in enumerate(prompts):
        z1 = m.forward([p], 0, shared.rows(b, b + 1), last_only=True)
        z2 = m.forward([p], 0, alone[b], last_only=True)
        np.testing.assert_allclose(m.backend.to_numpy(z1), m.backend.to_numpy(z2), atol=1e-10)
        last.append(int(np.argmax(m.backend.to_numpy(z2)[0])))
    pos = np.array([len(p) for p in prompts])
    for _ in range(4):
        zb = m.backend.to_numpy(m.forward(np.array(last)[:, None], pos, shared, last_only=True))
        for b in range(B):
            za = m.backend.to_numpy(m.forward([[last[b]]], int(pos[b]), alone[b],
                                              last_only=True))
            np.testing.assert_allclose(zb[b], za[0], atol=1e-9, rtol=1e-9)
        last = [int(t) for t in np.argmax(zb, axis=-1)]
        pos += 1


def _run_together(engine, jobs, queued: bool):
    """Submit every job (prompt, kwargs) and wait for all; their results in order. ``queued``:
    submitted while the scheduler is held, so it admits them all at once (one batched prefill);
    else each from its own thread at once."""
    if queued:
        with engine._cv:  # a re-entrant lock: submit() takes it too
            reqs = [engine.submit(p, **kw) for p, kw in jobs]
        out = []
        for r in reqs:
            assert list(r.events(timeout=60))[-1][0] == "done"
            out.append((r.tokens, r.finish_reason))
        return out
    out = [None] * len(jobs)
    gate = threading.Barrier(len(jobs))

    def run(i):
        gate.wait()
        out[i] = engine.generate(jobs[i][0], **jobs[i][1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("max_batch", [2, 8])
def test_concurrent_requests_get_their_own_tokens(max_batch):
    """Greedy and seeded sampled requests of different prompt lengths, budgets and stop ids,
    run together equal each one alone: with 8 slots all prefilled in one padded forward, with 2
    slots queued from threads, slots reused and rows moved."""
    m = _model(dtype=np.float64, max_seq_len=40)
    rng = np.random.default_rng(2)
    jobs = []
    for i in range(6):
        prompt = rng.integers(0, 37, int(rng.integers(1, 12))).tolist()
        kw = {"max_tokens": int(rng.integers(3, 30)), "stop_ids": {int(rng.integers(0, 37))}}
        if i % 2:
            kw.update(temperature=0.9, top_p=0.95, seed=100 + i)
        jobs.append((prompt, kw))
    jobs.append(([5] * 38, {"max_tokens": 10}))  # runs into the end of the context
    engine = Engine(m, max_batch=max_batch)
    try:
        got = _run_together(engine, jobs, queued=max_batch == 8)
        assert engine.max_active >= 2  # the requests did share decode steps
        if max_batch == 8:
            assert engine.prefills == 1
    finally:
        engine.close()
    for (prompt, kw), (ids, reason) in zip(jobs, got):
        want = generate(m, prompt, max_new_tokens=kw["max_tokens"],
                        temperature=kw.get("temperature", 0.0), top_p=kw.get("top_p"),
                        seed=kw.get("seed"), stop_ids=kw["stop_ids"] if "stop_ids" in kw else ())
        assert ids == list(want), (prompt, kw)
        budget = min(kw["max_tokens"], 40 - len(prompt) + 1)
        assert reason == ("length" if len(ids) == budget else "stop")
    assert got[-1] == (got[-1][0], "length") and len(got[-1][0]) == 3  # 40 - 38 + 1
    assert engine.active == 0


def test_cancel_frees_the_slot():
    m = _model(dtype=np.float32, max_seq_len=4096)
    engine = Engine(m, max_batch=2)
    try:
        seen = threading.Event()
        req = engine.submit([1, 2, 3], max_tokens=4000,
                            on_event=lambda ev: seen.set() if ev[0] == "token" else None)
        assert seen.wait(20)
        assert engine.active == 1
        req.cancel()
        t0 = time.time()
        while engine.active and time.time() - t0 < 10:
            time.sleep(0.01)
        assert engine.active == 0 and req.finish_reason == "cancelled"
        assert len(req.tokens) < 4000
        ids, reason = engine.generate([4, 5], max_tokens=5)  # the engine goes on serving
        assert reason == "length" and len(ids) == 5
        assert engine.finished["cancelled"] == 1 and engine.finished["length"] == 1
    finally:
        engine.close()


def test_bad_submissions_are_refused():
    m = _model(max_seq_len=16)
    engine = Engine(m, max_batch=1)
    try:
        for args, kw, msg in [([], {}, "at least one token"),
                              ([1] * 17, {}, "longer than the context"),
                              ([99], {}, "must lie in"),
                              ([1], {"max_tokens": -1}, "max_tokens"),
                              ([1], {"temperature": float("nan")}, "temperature"),
                              ([1], {"top_p": 0.0}, "top_p"),
                              ([1], {"seed": -3}, "seed")]:
            with pytest.raises(MinillamaError, match=msg):
                engine.submit(args, **kw)
        assert engine.generate([1], max_tokens=0) == ([], "length")
    finally:
        engine.close()
    with pytest.raises(MinillamaError, match="closed"):
        engine.submit([1])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n.", max_size=30),
       stops=st.lists(st.text(alphabet="ab\n.", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
@example(text="aaaaaaa.a", stops=[".", "a.a"], cuts=[8])  # a longer stop starting earlier
def test_stop_text_cuts_at_the_first_stop_however_the_text_arrives(text, stops, cuts):
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[:min(found)] if found else text
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    st_ = StopText(stops)
    got = "".join(st_.push(text[a:b]) for a, b in zip(bounds, bounds[1:])) + st_.flush()
    assert got == want
    assert st_.hit == bool(found)


def test_a_failing_row_ends_only_its_own_request():
    """A prompt whose logits turn NaN (token 7's embedding is NaN here) ends with an error event;
    the request decoding beside it in the same batch is untouched and the engine goes on."""
    m = _model(tie=False)  # (a tied head would give every row a NaN logit for token 7)
    m.params["tok_embeddings.weight"][7] = np.nan
    good, bad = [1, 2, 3], [4, 7, 5]
    want = generate(m, good, max_new_tokens=12, stop_ids={7})
    engine = Engine(m, max_batch=4)
    try:
        with engine._cv:
            r_good = engine.submit(good, max_tokens=12, stop_ids={7})
            r_bad = engine.submit(bad, max_tokens=12, stop_ids={7})
        assert list(r_bad.events(timeout=60)) == [
            ("error", "the model's logits hold NaN/inf values (its weights overflow the compute "
                      "dtype)")]
        assert [v for k, v in r_good.events(timeout=60) if k == "token"] == want
        assert engine.generate(good, max_tokens=12, stop_ids={7}) == (want, "length")
        with pytest.raises(MinillamaError, match="NaN/inf"):
            engine.generate(bad, max_tokens=3)
    finally:
        engine.close()
