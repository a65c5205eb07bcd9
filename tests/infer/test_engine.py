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

from minillama.backends import get_backend
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


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def test_a_second_turn_prefills_only_its_new_tokens_and_equals_a_cold_run():
    """Turn 2's prompt is turn 1's prompt, its reply and a new message: the row that ran turn 1
    still holds the K/V of all but the reply's last token, so only the rest is prefilled; the
    greedy reply equals that of an engine that reuses nothing, and generate()'s."""
    m = _model(max_seq_len=128)
    rng = np.random.default_rng(5)
    first = rng.integers(0, 37, 20).tolist()
    warm, cold = Engine(m, max_batch=2), Engine(m, max_batch=2, prefix_reuse=False)
    try:
        reply, _ = warm.generate(first, max_tokens=10)
        assert len(reply) == 10
        second = first + reply + rng.integers(0, 37, 6).tolist()
        st = warm.stats
        before = (st.prompt_tokens, st.prefilled_tokens, st.cached_tokens)
        got, reason = warm.generate(second, max_tokens=12)
        assert (st.prompt_tokens - before[0], st.prefilled_tokens - before[1],
                st.cached_tokens - before[2]) == (len(second), 6 + 1, len(second) - 7)
        want = cold.generate(second, max_tokens=12)
        assert (got, reason) == want
        assert got == generate(m, second, max_new_tokens=12)
        assert cold.stats.cached_tokens == 0
        assert cold.stats.prefilled_tokens == len(second)
        # the same prompt again: all but its last token come from the cache
        req = warm.submit(second, max_tokens=12)
        assert list(req.events(timeout=60))[-1] == ("done", "length")
        assert req.tokens == got and req.cached_tokens == len(second) - 1
    finally:
        warm.close()
        cold.close()


def test_a_shared_system_prompt_is_copied_from_a_running_row():
    """A request whose prompt starts like that of a request still running copies that row's
    cached prefix instead of prefilling it, and gets the tokens it gets alone."""
    m = _model(max_seq_len=96)
    rng = np.random.default_rng(6)
    system = rng.integers(0, 37, 24).tolist()
    a, b = system + [1, 2, 3], system + [4, 5]
    engine = Engine(m, max_batch=3)
    try:
        later = []

        def on_a(ev):  # submitted while `a` runs: admitted at the next step beside it
            if ev[0] == "token" and not later:
                later.append(engine.submit(b, max_tokens=8))

        ra = engine.submit(a, max_tokens=30, on_event=on_a)
        t0 = time.time()
        while ra.finish_reason is None and time.time() - t0 < 60:
            time.sleep(0.01)
        rb = later[0]
        assert list(rb.events(timeout=60))[-1] == ("done", "length")
        assert rb.cached_tokens == len(system)
        assert rb.tokens == generate(m, b, max_new_tokens=8)
        assert ra.tokens == generate(m, a, max_new_tokens=30)
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("prefill_tokens,forwards", [(4096, 1), (30, 2)])
def test_second_turns_arriving_together_share_one_prefill(prefill_tokens, forwards, backend):
    """Four conversations' second turns admitted at once, each from the row its first turn left
    (cached prefixes of different lengths, new parts of different lengths): the new parts are
    prefilled together, right-padded, each row from its own position (more forwards only when
    the padded tokens would pass ``prefill_tokens``), and every reply is the cold run's."""
    m = _model(backend=backend, max_seq_len=128)
    rng = np.random.default_rng(8)
    engine = Engine(m, max_batch=4, prefill_tokens=prefill_tokens)
    try:
        firsts = [rng.integers(0, 37, n).tolist() for n in (12, 20, 9, 16)]
        replies = [engine.generate(p, max_tokens=4)[0] for p in firsts]
        seconds = [f + r + rng.integers(0, 37, k).tolist()
                   for f, r, k in zip(firsts, replies, (3, 11, 6, 1))]
        prefills, cached = engine.batch.prefills, engine.stats.cached_tokens
        got = _run_together(engine, [(p, {"max_tokens": 7}) for p in seconds], queued=True)
        assert engine.batch.prefills - prefills == forwards
        assert engine.stats.cached_tokens - cached == sum(
            len(f) + len(r) - 1 for f, r in zip(firsts, replies))
        for p, (tokens, reason) in zip(seconds, got):
            assert tokens == generate(m, p, max_new_tokens=7) and reason == "length"
    finally:
        engine.close()


def test_a_request_arriving_during_a_prefill_starts_in_the_same_step():
    """B is submitted while A's prefill runs (from A's first-token event, on the scheduler
    thread): it is admitted before the step's decode, so its first token comes with no decode
    step in between, and both get the tokens they get alone."""
    m = _model(max_seq_len=96)
    rng = np.random.default_rng(9)
    a, b = rng.integers(0, 37, 14).tolist(), rng.integers(0, 37, 9).tolist()
    engine = Engine(m, max_batch=2)
    try:
        first_at = {}
        later = []

        def on_a(ev):
            if "a" not in first_at:
                first_at["a"] = engine.decode_steps
                later.append(engine.submit(b, max_tokens=6, on_event=on_b))

        def on_b(ev):
            first_at.setdefault("b", engine.decode_steps)

        ra = engine.submit(a, max_tokens=6, on_event=on_a)
        t0 = time.time()
        while (ra.finish_reason is None or not later or later[0].finish_reason is None) \
                and time.time() - t0 < 60:
            time.sleep(0.01)
        assert first_at["a"] == first_at["b"]
        assert ra.tokens == generate(m, a, max_new_tokens=6)
        assert later[0].tokens == generate(m, b, max_new_tokens=6)
    finally:
        engine.close()


def test_requests_arriving_together_share_a_prefix_only_one_row_holds():
    """A system prompt is cached in one free row; two requests that start with it arrive
    together: the first takes that row, the second copies the prefix from the first's row before
    their one shared prefill, and both get the tokens they get alone."""
    m = _model(max_seq_len=96)
    rng = np.random.default_rng(10)
    system = rng.integers(0, 37, 20).tolist()
    engine = Engine(m, max_batch=3)
    try:
        engine.generate(system + [1, 2], max_tokens=3)
        jobs = [system + rng.integers(0, 37, k).tolist() for k in (4, 6)]
        prefills = engine.batch.prefills
        with engine._cv:
            reqs = [engine.submit(p, max_tokens=5) for p in jobs]
        for r, p in zip(reqs, jobs):
            assert list(r.events(timeout=60))[-1] == ("done", "length")
            assert r.cached_tokens >= len(system)
            assert r.tokens == generate(m, p, max_new_tokens=5)
        assert engine.batch.prefills - prefills == 1
    finally:
        engine.close()


def test_one_step_admits_at_most_max_batch_requests():
    """Requests that end at admission (max_tokens 1) free their rows at once; however many keep
    arriving while a step admits, the step takes at most max_batch of them and returns."""
    from minillama.core.sampling import SamplingParams
    from minillama.infer.engine import Request

    m = _model()
    engine = Engine(m, max_batch=3)
    calls = []

    def req():
        return Request(engine, [1, 2, 3], 1, SamplingParams(), set(), lambda ev: None)

    def more():
        calls.append(1)
        return [req()]

    engine.batch.step([req()], more=more)
    assert len(calls) == 2  # 1 + 2 more: three requests admitted, then the step ends
    assert not engine.batch.slots


def test_extra_prefix_rows_keep_conversations_that_others_displaced():
    """One slot and two prefix rows: conversation A's row survives B and C running in the slot
    after it (the least recently used content goes first), and A's second turn reuses it."""
    m = _model(max_seq_len=96)
    rng = np.random.default_rng(7)
    convs = [rng.integers(0, 37, 16).tolist() for _ in range(3)]
    engine = Engine(m, max_batch=1, prefix_rows=2)
    try:
        replies = [engine.generate(p, max_tokens=5)[0] for p in convs]
        assert engine.stats.cached_tokens == 0
        turn2 = convs[0] + replies[0] + [1, 2, 3]
        req = engine.submit(turn2, max_tokens=6)
        list(req.events(timeout=60))
        assert req.cached_tokens == len(convs[0]) + len(replies[0]) - 1
        assert req.tokens == generate(m, turn2, max_new_tokens=6)
        # with no extra rows A's content is gone once B has run in the only row
        small = Engine(m, max_batch=1)
        try:
            for p in convs[:2]:
                small.generate(p, max_tokens=5)
            r2 = small.submit(turn2, max_tokens=6)
            list(r2.events(timeout=60))
            assert r2.cached_tokens == 0 and r2.tokens == req.tokens
        finally:
            small.close()
    finally:
        engine.close()


def test_logprobs_are_the_log_softmax_of_the_models_own_logits():
    """Each token's log-probability and top alternatives equal the log-softmax of a full forward
    over prompt + reply (no cache), sampled (seeded, with a temperature and top-k the model's
    distribution does not see) or greedy."""
    m = _model(max_seq_len=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine = Engine(m, max_batch=2)
    try:
        for kw in ({"temperature": 0.0}, {"temperature": 1.5, "top_k": 5, "seed": 3}):
            req = engine.submit(prompt, max_tokens=12, logprobs=4, **kw)
            list(req.events(timeout=60))
            ids = prompt + req.tokens
            lsm = _log_softmax(m.forward([ids])[0])[len(prompt) - 1:-1]
            assert len(req.token_logprobs) == len(req.tokens) == 12
            for j, (t, (lp, top)) in enumerate(zip(req.tokens, req.token_logprobs)):
                assert lp == pytest.approx(lsm[j, t], abs=1e-9)
                order = np.argsort(-lsm[j], kind="stable")[:4]
                assert [i for i, _ in top] == order.tolist()
                np.testing.assert_allclose([v for _, v in top], lsm[j, order], atol=1e-9)
        with pytest.raises(MinillamaError, match="logprobs"):
            engine.submit(prompt, logprobs=21)
    finally:
        engine.close()


def test_the_queue_bound_refuses_requests_beyond_it():
    from minillama.infer.engine import QueueFull

    m = _model(max_seq_len=64)
    engine = Engine(m, max_batch=1, max_queue=2)
    try:
        with engine._cv:  # the scheduler admits nothing while this is held
            reqs = [engine.submit([1, 2, 3], max_tokens=40) for _ in range(3)]
            with pytest.raises(QueueFull, match="busy"):
                engine.submit([1, 2, 3])
        for r in reqs:
            r.cancel()
        for r in reqs:
            assert list(r.events(timeout=60))[-1][0] == "done"
        assert engine.generate([1, 2], max_tokens=3)[1] == "length"  # room again
    finally:
        engine.close()


def test_a_cancelled_request_leaves_within_one_decode_step():
    m = _model(dtype=np.float32, max_seq_len=2048)
    engine = Engine(m, max_batch=2)
    try:
        other = engine.submit([7, 8], max_tokens=300)
        seen = threading.Semaphore(0)
        req = engine.submit([1, 2, 3], max_tokens=2000, on_event=lambda ev: seen.release())
        for _ in range(5):
            assert seen.acquire(timeout=30)
        req.cancel()
        t0 = time.time()
        while req.finish_reason is None and time.time() - t0 < 10:
            time.sleep(0.005)
        assert req.finish_reason == "cancelled"
        assert req.end_step - req.cancel_step <= 1
        list(other.events(timeout=60))
        assert other.tokens == generate(m, [7, 8], max_new_tokens=300)
    finally:
        engine.close()


def test_a_finished_row_keeps_its_contents_when_the_running_rows_close_up(backend):
    """A finishes in row 0 while B runs on in row 1: B moves to row 0 and A's cache to row 1
    (exchanged, not overwritten), where A's next turn finds it; on every backend's arrays."""
    m = _model(backend, max_seq_len=128)
    rng = np.random.default_rng(8)
    pa, pb = rng.integers(0, 37, 18).tolist(), rng.integers(0, 37, 14).tolist()
    engine = Engine(m, max_batch=2)
    try:
        with engine._cv:
            ra = engine.submit(pa, max_tokens=4)
            rb = engine.submit(pb, max_tokens=60)
        list(ra.events(timeout=60))
        turn2 = pa + ra.tokens + [5, 6, 7]
        r2 = engine.submit(turn2, max_tokens=10)
        list(r2.events(timeout=60))
        list(rb.events(timeout=60))
        assert engine.max_active == 2
        assert r2.cached_tokens == len(pa) + len(ra.tokens) - 1
        assert r2.tokens == generate(m, turn2, max_new_tokens=10)
        assert rb.tokens == generate(m, pb, max_new_tokens=60)
        assert ra.tokens == generate(m, pa, max_new_tokens=4)
    finally:
        engine.close()


def test_a_request_cancelled_while_queued_leaves_the_queue():
    m = _model(max_seq_len=64)
    engine = Engine(m, max_batch=1, max_queue=1)
    try:
        queued: list = []

        def on_running(ev):  # at its first token: one more waits, and gives up at once
            if not queued:
                queued.append(engine.submit([3, 4], max_tokens=5))
                queued[0].cancel()

        running = engine.submit([1, 2], max_tokens=60, on_event=on_running)
        t0 = time.time()
        while not queued and time.time() - t0 < 30:
            time.sleep(0.005)
        assert list(queued[0].events(timeout=30)) == [("done", "cancelled")]
        last = engine.submit([5], max_tokens=2)  # its place in the queue is free again
        assert list(last.events(timeout=60))[-1] == ("done", "length")
        assert len(running.tokens) == 60
    finally:
        engine.close()


def test_smollm2_second_turn_reuses_the_first_and_equals_a_cold_run(smollm2_gguf):
    """On the SmolLM2 Q4_1 file (numba where it is installed): a chat's second turn prefills
    only what follows the first turn's cached prompt and reply, and its greedy reply equals that
    of an engine that prefills the whole prompt."""
    pytest.importorskip("jinja2")
    from minillama.backends import available_backends
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids
    from minillama.io.load import load_model

    backend = "numba" if "numba" in available_backends() else "numpy"
    model, tok = load_model(smollm2_gguf, backend=backend)
    stops = stop_ids(tok)
    turn1 = [{"role": "system", "content": "You answer in one short sentence. " * 4},
             {"role": "user", "content": "What is the capital of France?"}]
    warm = Engine(model, max_batch=2, max_seq_len=512)
    cold = Engine(model, max_batch=2, max_seq_len=512, prefix_reuse=False)
    try:
        p1 = encode_rendered(tok, render_chat(tok, turn1))
        r1, _ = warm.generate(p1, max_tokens=16, stop_ids=stops)
        turn2 = turn1 + [{"role": "assistant", "content": tok.decode(r1)},
                         {"role": "user", "content": "And of Italy?"}]
        p2 = encode_rendered(tok, render_chat(tok, turn2))
        before = warm.stats.prefilled_tokens
        got = warm.submit(p2, max_tokens=16, stop_ids=stops)
        list(got.events(timeout=300))
        # the rows of the first prompt's prefill at least (numba keeps no more: the reply's rows
        # came from decode steps, in another order than a prompt's)
        assert got.cached_tokens >= model.reusable_rows(len(p1), len(p1) + len(r1))
        assert got.cached_tokens >= len(p1)
        assert warm.stats.prefilled_tokens - before == len(p2) - got.cached_tokens
        assert (got.tokens, got.finish_reason) == cold.generate(p2, max_tokens=16,
                                                                stop_ids=stops)
        assert "Rome" in tok.decode(got.tokens)
    finally:
        warm.close()
        cold.close()


def test_work_handed_to_the_engine_runs_on_its_thread_between_steps():
    """run_in_thread runs a callable on the scheduler thread (the one that runs every step),
    returns its result, raises its exception, and refuses once the engine is closed."""
    eng = Engine(_model(), max_batch=2)
    try:
        seen = eng.run_in_thread(lambda a, b: (threading.current_thread().name, a + b), 2, 3)
        assert seen == ("minillama-engine", 5)
        tokens, _ = eng.generate([1, 2, 3], max_tokens=4)  # requests still run after it
        assert len(tokens) == 4

        def fails():
            raise ValueError("from the engine's thread")

        with pytest.raises(ValueError, match="from the engine's thread"):
            eng.run_in_thread(fails)
    finally:
        eng.close()
    with pytest.raises(MinillamaError, match="closed"):
        eng.run_in_thread(lambda: None)


def test_a_second_turn_on_block_weights_equals_a_cold_run_bit_for_bit():
    """On GGML blocks of 32 (numba), whose decode steps compute a position as a prefill does: a
    second turn keeps the rows of the first turn's prompt and of its reply, prefills the new
    message, and gets the cold run's tokens and log-probabilities bit for bit."""
    from minillama.backends import available_backends
    from minillama.identities import Subject
    from minillama.identities.invariance import VOCAB, block_model

    if "numba" not in available_backends():
        pytest.skip("numba is not installed")
    m = block_model(Subject(get_backend("numba"), np.float32), 4)
    rng = np.random.default_rng(9)
    first = rng.integers(0, VOCAB, 30).tolist()
    warm, cold = Engine(m, max_batch=2), Engine(m, max_batch=2, prefix_reuse=False)
    try:
        reply, _ = warm.generate(first, max_tokens=12)
        second = first + reply + rng.integers(0, VOCAB, 5).tolist()
        runs = [e.submit(second, max_tokens=12, logprobs=5) for e in (warm, cold)]
        for r in runs:
            assert list(r.events(timeout=120))[-1] == ("done", "length")
        assert len(first) < runs[0].cached_tokens <= len(first) + len(reply)
        assert runs[1].cached_tokens == 0
        assert runs[0].tokens == runs[1].tokens
        assert runs[0].token_logprobs == runs[1].token_logprobs
        # the same second turn again: all its rows are cached, one token is fed (its row kept
        # as the prefill wrote it), and it gets the cold run's numbers; a third turn after it too
        again = warm.submit(second, max_tokens=12, logprobs=5)
        list(again.events(timeout=120))
        assert again.cached_tokens == len(second) - 1
        assert again.token_logprobs == runs[1].token_logprobs
        third = second + again.tokens + rng.integers(0, VOCAB, 3).tolist()
        runs = [e.submit(third, max_tokens=8, logprobs=5) for e in (warm, cold)]
        for r in runs:
            list(r.events(timeout=120))
        assert len(second) < runs[0].cached_tokens <= len(second) + len(again.tokens)
        assert runs[0].token_logprobs == runs[1].token_logprobs
    finally:
        warm.close()
        cold.close()


def test_smollm2_repeats_and_second_turns_get_the_cold_numbers_bit_for_bit(smollm2_gguf,
                                                                          monkeypatch):
    """SmolLM2's Q4_1 file on numba with its default 8-bit products: a chat request sent again
    (all its rows cached: one token fed, its row kept as the prefill wrote it) and the
    conversation's second turn after it (the reply's rows prefilled again) get the
    log-probabilities of an engine that reuses nothing, bit for bit."""
    pytest.importorskip("jinja2")
    from minillama.backends import available_backends
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids
    from minillama.io.load import load_model

    if "numba" not in available_backends():
        pytest.skip("numba is not installed")
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    model, tok = load_model(smollm2_gguf, backend="numba")
    stops = stop_ids(tok)
    turn1 = [{"role": "user", "content": "Tell me about a violin."}]
    p1 = encode_rendered(tok, render_chat(tok, turn1))
    warm = Engine(model, max_batch=2, max_seq_len=256)
    cold = Engine(model, max_batch=2, max_seq_len=256, prefix_reuse=False)

    def both(prompt, engines):
        runs = [e.submit(prompt, max_tokens=24, stop_ids=stops, logprobs=3) for e in engines]
        for r in runs:
            list(r.events(timeout=300))
        return runs

    try:
        first, want = both(p1, (warm, cold))
        again, = both(p1, (warm,))
        assert again.cached_tokens == len(p1) - 1
        assert first.token_logprobs == want.token_logprobs == again.token_logprobs
        turn2 = turn1 + [{"role": "assistant", "content": tok.decode(again.tokens)},
                         {"role": "user", "content": "And a cello?"}]
        got, want = both(encode_rendered(tok, render_chat(tok, turn2)), (warm, cold))
        assert got.cached_tokens >= len(p1) and want.cached_tokens == 0
        assert got.tokens == want.tokens and got.token_logprobs == want.token_logprobs
    finally:
        warm.close()
        cold.close()
