"""`minillama serve` under faults and load, on loopback: every malformed or out-of-range request
gets a 400 (or the 404/405/413 it names) with OpenAI's error object and never a 5xx; a full
queue answers 503 with Retry-After; a streaming client that hangs up frees its slot within one
decode step; and while all of this happens at once, the well-formed clients get exactly the text
they get alone. Every run here is bounded (a few seconds on the tiny chat model)."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from minillama.infer.engine import Engine  # noqa: E402
from minillama.infer.serve import build_app  # noqa: E402
from minillama.io.chat_template import encode_rendered, render_chat  # noqa: E402
from minillama.io.chat_template import stop_ids as _stops  # noqa: E402
from tests.infer.test_serve import MESSAGES, _Server, _text_of, make_chat_model, scrape  # noqa: E402

NAME = "tiny-chat"
CONTEXT = 128
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def _chat(**kw):
    return {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **kw}


def _text(**kw):
    return {"model": NAME, "prompt": "the cat", "max_tokens": 4, **kw}


def _msg(**m):
    return _chat(messages=[m])


#: (id, path, body: a JSON-able dict or raw bytes, status, error code, words the message holds)
FAULTS = [
    ("bad-json", CHAT, b'{"model": "tiny-chat", "messages": [', 400, "invalid_json", "JSON"),
    ("not-an-object", CHAT, b'"hello"', 400, "invalid_json", "object"),
    ("not-utf8", CHAT, b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xff'
     b'\xfe"}]}', 400, "invalid_encoding", "UTF-8"),
    ("lone-surrogate", CHAT, b'{"model": "tiny-chat", "messages": [{"role": "user", "content": '
     b'"\\ud800"}]}', 400, "invalid_value", "surrogate"),
    ("model-type", CHAT, _chat(model=3), 400, "invalid_type", "'model'"),
    ("no-model", CHAT, {"messages": MESSAGES}, 400, "missing_field", "'model'"),
    ("unknown-model", CHAT, _chat(model="gpt-4"), 404, "model_not_found", "gpt-4"),
    ("messages-type", CHAT, _chat(messages="hi"), 400, "invalid_type", "messages"),
    ("messages-empty", CHAT, _chat(messages=[]), 400, "invalid_type", "messages"),
    ("message-type", CHAT, _chat(messages=["hi"]), 400, "invalid_type", "messages[0]"),
    ("no-role", CHAT, _chat(messages=[{"content": "x"}]), 400, "invalid_type", "role"),
    ("unknown-role", CHAT, _msg(role="wizard", content="x"), 400, "invalid_value", "wizard"),
    ("no-content", CHAT, _msg(role="user"), 400, "missing_field", "no content"),
    ("null-content", CHAT, _msg(role="user", content=None), 400, "missing_field", "no content"),
    ("content-number", CHAT, _msg(role="user", content=5), 400, "invalid_type", "content"),
    ("content-object", CHAT, _msg(role="user", content={"text": "x"}), 400, "invalid_type",
     "content"),
    ("image-part", CHAT, _msg(role="user", content=[{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]), 400, "invalid_type", "image_url"),
    ("part-text-type", CHAT, _msg(role="user", content=[{"type": "text", "text": 5}]), 400,
     "invalid_type", "text"),
    ("temperature-low", CHAT, _chat(temperature=-0.5), 400, "invalid_value", "temperature"),
    ("temperature-high", CHAT, _chat(temperature=2.5), 400, "invalid_value", "temperature"),
    ("temperature-type", CHAT, _chat(temperature="hot"), 400, "invalid_type", "temperature"),
    ("temperature-bool", CHAT, _chat(temperature=True), 400, "invalid_type", "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), 400, "invalid_value", "top_p"),
    ("top-p-high", CHAT, _chat(top_p=1.5), 400, "invalid_value", "top_p"),
    ("top-k-negative", CHAT, _chat(top_k=-1), 400, "invalid_value", "top_k"),
    ("top-k-type", CHAT, _chat(top_k=2.5), 400, "invalid_type", "top_k"),
    ("min-p-low", CHAT, _chat(min_p=-0.1), 400, "invalid_value", "min_p"),
    ("min-p-high", CHAT, _chat(min_p=1.1), 400, "invalid_value", "min_p"),
    ("frequency-penalty", CHAT, _chat(frequency_penalty=3), 400, "invalid_value",
     "frequency_penalty"),
    ("presence-penalty", CHAT, _chat(presence_penalty=-2.5), 400, "invalid_value",
     "presence_penalty"),
    ("repeat-penalty-zero", CHAT, _chat(repeat_penalty=0), 400, "invalid_value",
     "repeat_penalty"),
    ("repeat-last-n", CHAT, _chat(repeat_last_n=-2), 400, "invalid_value", "repeat_last_n"),
    ("seed-negative", CHAT, _chat(seed=-1), 400, "invalid_value", "seed"),
    ("seed-type", CHAT, _chat(seed="x"), 400, "invalid_type", "seed"),
    ("n-two", CHAT, _chat(n=2), 400, "invalid_value", "n = 1"),
    ("n-zero", CHAT, _chat(n=0), 400, "invalid_value", "n = 1"),
    ("max-tokens-zero", CHAT, _chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max-tokens-negative", CHAT, _chat(max_tokens=-5), 400, "invalid_value", "max_tokens"),
    ("max-tokens-float", CHAT, _chat(max_tokens=2.5), 400, "invalid_type", "max_tokens"),
    ("max-tokens-string", CHAT, _chat(max_tokens="10"), 400, "invalid_type", "max_tokens"),
    ("max-tokens-beyond-context", CHAT, _chat(max_tokens=1000), 400, "context_length_exceeded",
     "max_tokens is 1000"),
    ("prompt-beyond-context", CHAT, _msg(role="user", content="the cat " * 200), 400,
     "context_length_exceeded", f"context length of {CONTEXT}"),
    ("stop-type", CHAT, _chat(stop=5), 400, "invalid_type", "stop"),
    ("stop-too-many", CHAT, _chat(stop=list("abcde")), 400, "invalid_type", "stop"),
    ("stream-type", CHAT, _chat(stream="yes"), 400, "invalid_type", "stream"),
    ("stream-options-type", CHAT, _chat(stream=True, stream_options="x"), 400, "invalid_type",
     "stream_options"),
    ("include-usage-type", CHAT, _chat(stream=True, stream_options={"include_usage": "yes"}),
     400, "invalid_type", "include_usage"),
    ("logprobs-type", CHAT, _chat(logprobs="yes"), 400, "invalid_type", "logprobs"),
    ("top-logprobs-high", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "invalid_value",
     "top_logprobs"),
    ("top-logprobs-alone", CHAT, _chat(top_logprobs=3), 400, "invalid_value", "logprobs"),
    ("logit-bias", CHAT, _chat(logit_bias={"5": 10}), 400, "unsupported_parameter",
     "logit_bias"),
    ("tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "unsupported_parameter", "tools"),
    ("json-format", CHAT, _chat(response_format={"type": "json_object"}), 400,
     "unsupported_parameter", "response_format"),
    ("no-prompt", TEXT, {"model": NAME}, 400, "missing_field", "prompt"),
    ("prompt-type", TEXT, _text(prompt=5), 400, "invalid_type", "prompt"),
    ("prompt-empty-list", TEXT, _text(prompt=[]), 400, "invalid_type", "prompt"),
    ("two-prompts", TEXT, _text(prompt=["a", "b"]), 400, "invalid_type", "one prompt"),
    ("prompt-ids-outside", TEXT, _text(prompt=[1, 99999]), 400, "invalid_value", "must lie in"),
    ("text-beyond-context", TEXT, _text(prompt=list(range(3, 103)), max_tokens=40), 400,
     "context_length_exceeded", "the prompt has 100 tokens"),
    ("text-logprobs-high", TEXT, _text(logprobs=21), 400, "invalid_value", "logprobs"),
    ("text-logprobs-bool", TEXT, _text(logprobs=True), 400, "invalid_type", "logprobs"),
    ("echo", TEXT, _text(echo=True), 400, "unsupported_parameter", "echo"),
    ("best-of", TEXT, _text(best_of=2), 400, "invalid_value", "best_of"),
    ("too-large", TEXT, b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413, "body_too_large",
     "exceeds"),
    ("no-route", "/v1/nothing", {}, 404, "not_found", ""),
]

#: well-formed requests near the faults: each gets a 200
GOOD = [
    ("text-parts", CHAT, _msg(role="user", content=[{"type": "text", "text": "the "},
                                                    {"type": "text", "text": "cat"}])),
    ("empty-content", CHAT, _chat(messages=[{"role": "user", "content": ""}])),
    ("all-settings", CHAT, _chat(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3,
                                 repeat_penalty=1.1, repeat_last_n=-1, frequency_penalty=0.5,
                                 presence_penalty=-0.5, stop=["zz"], n=1, logprobs=False,
                                 user="someone", max_completion_tokens=4)),
    ("fills-the-context", TEXT, _text(prompt=list(range(3, 103)), max_tokens=CONTEXT - 100)),
    ("prompt-ids-nested", TEXT, _text(prompt=[[5, 6, 7]])),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny chat model in 3 slots of 128 positions, a queue of 8, no API key."""
    model, tok = make_chat_model(tmp_path_factory.mktemp("faults_model"))
    engine = Engine(model, max_batch=3, max_seq_len=CONTEXT, max_queue=8)
    srv = _Server(build_app(engine, tok, NAME), engine, tok, NAME)
    yield srv
    srv.close()


def _send(c: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return c.post(path, content=body, headers={"content-type": "application/json"})
    return c.post(path, json=body)


def _check_fault(r: httpx.Response, status: int, code: str, words: str) -> None:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and words in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,status,code,words", [f[1:] for f in FAULTS],
                         ids=[f[0] for f in FAULTS])
def test_a_fault_gets_its_4xx(served, path, body, status, code, words):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        _check_fault(_send(c, path, body), status, code, words)


@pytest.mark.parametrize("path,body", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_well_formed_requests_near_the_faults_are_served(served, path, body):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = _send(c, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_context_error_names_the_limits(served):
    prompt = encode_rendered(served.tok, render_chat(served.tok, MESSAGES))
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = _send(c, CHAT, _chat(max_tokens=CONTEXT))
    msg = r.json()["error"]["message"]
    assert r.status_code == 400
    for words in (f"prompt has {len(prompt)} tokens", f"max_tokens is {CONTEXT}",
                  f"context length of {CONTEXT} tokens"):
        assert words in msg, msg


def _stream(url, body, out, key, hang_up=False):
    """Stream a chat completion: ``out[key]`` = its text; with ``hang_up``, close the connection
    at the first chunk that carries a token's logprobs and set ``out[key] = "hung up"``."""
    text = []
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", CHAT, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    text.append(ch["delta"].get("content") or "")
                    if hang_up and ch.get("logprobs"):
                        out[key] = "hung up"
                        return  # leaving the blocks closes the connection mid-stream
    out[key] = "".join(text)


def _hold_after_first_token(engine, submitted: list):
    """A stand-in for ``engine.submit`` that records each request and, for the one asking for
    logprobs, holds the scheduler after that request's first token until it is cancelled (at
    most 10 s): its client's hang-up then surely lands while it runs."""
    submit = engine.submit

    def spy(*a, on_event=None, logprobs=None, **kw):
        box: list = []

        def held(ev):
            on_event(ev)
            if ev[0] == "token":
                t0 = time.time()
                while (not box or len(box[0].tokens) == 1 and not box[0].cancelled) \
                        and time.time() - t0 < 10:
                    time.sleep(0.002)

        box.append(submit(*a, on_event=held if logprobs is not None else on_event,
                          logprobs=logprobs, **kw))
        submitted.append(box[0])
        return box[0]

    return spy


def test_load_with_faults_and_a_client_that_hangs_up(served):
    """Four greedy streaming clients, one that hangs up mid-stream, and every fault of the table
    at once on 3 slots: the four texts equal each prompt's reply alone, the faults get their
    4xx, the hung-up request leaves within one decode step, nothing answers 5xx, and the engine
    ends idle."""
    engine, tok = served.engine, served.tok
    users = ["the cat", "the dog ran", "be brief", "sat on the mat"]
    bodies = [_chat(messages=[{"role": "user", "content": u}], max_tokens=40, temperature=0)
              for u in users]
    want = []
    for b in bodies:
        ids = encode_rendered(tok, render_chat(tok, b["messages"]))
        want.append(_text_of(tok, ids, engine.generate(ids, max_tokens=40,
                                                       stop_ids=_stops(tok))[0]))
    submitted: list = []
    engine.submit = _hold_after_first_token(engine, submitted)
    before = scrape(served.url)
    out: dict = {}
    faults: dict = {}

    def fire():
        with httpx.Client(base_url=served.url, timeout=60) as c:
            for name, path, body, *_ in FAULTS:
                faults[name] = _send(c, path, body)

    leaver = _chat(messages=[{"role": "user", "content": "the mat"}], max_tokens=100,
                   temperature=0, logprobs=True)
    threads = [threading.Thread(target=_stream, args=(served.url, b, out, i))
               for i, b in enumerate(bodies)]
    threads += [threading.Thread(target=_stream, args=(served.url, leaver, out, "left", True)),
                threading.Thread(target=fire)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    finally:
        del engine.submit  # the method again
    assert [out[i] for i in range(4)] == want
    for name, _, _, status, code, words in FAULTS:
        _check_fault(faults[name], status, code, words)
    t0 = time.time()
    while engine.active and time.time() - t0 < 30:
        time.sleep(0.01)
    assert engine.active == 0 and engine.waiting == 0
    gone = [r for r in submitted if r.finish_reason == "cancelled"]
    assert out["left"] == "hung up" and len(gone) == 1 and len(gone[0].tokens) >= 1
    assert gone[0].end_step - gone[0].cancel_step <= 1
    after = scrape(served.url)
    codes = {k[1]: v - before.get(k, 0) for k, v in after.items()
             if k[0] == "minillama_requests_total"}
    assert not any('code="5' in labels and n for labels, n in codes.items()), codes
    assert codes['route="/v1/chat/completions",code="200"'] == 5


def test_a_full_queue_answers_503_with_retry_after(tmp_path):
    """One slot and a queue of one: with one request running and one waiting (the scheduler
    held between two steps), a third is refused with 503, Retry-After and the error object; once
    the two hang up, the server serves again."""
    model, tok = make_chat_model(tmp_path)
    engine = Engine(model, max_batch=1, max_seq_len=CONTEXT, max_queue=1)
    srv = _Server(build_app(engine, tok, NAME), engine, tok, NAME)
    gate, held = threading.Event(), []
    gate.set()
    step = engine.batch.step

    def gated_step(new, more=None):  # after the first step with a request running, wait for
        assert gate.wait(30)  # the gate
        step(new, more)
        if engine.active and not held:
            held.append(True)
            gate.clear()

    engine.batch.step = gated_step
    long = _chat(max_tokens=90, temperature=0, stream=True)

    def until(cond):
        t0 = time.time()
        while not cond():
            assert time.time() - t0 < 30
            time.sleep(0.005)

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c1, \
                httpx.Client(base_url=srv.url, timeout=60) as c2:
            with c1.stream("POST", CHAT, json=long) as r1:
                assert r1.status_code == 200
                until(lambda: held and engine.active == 1)  # running, the scheduler held
                with c2.stream("POST", CHAT, json=long) as r2:
                    assert r2.status_code == 200
                    until(lambda: engine.waiting == 1)
                    r3 = httpx.post(srv.url + CHAT, json=_chat(), timeout=30)
                    assert r3.status_code == 503 and r3.headers["retry-after"] == "1"
                    err = r3.json()["error"]
                    assert err["code"] == "server_busy" and err["type"] == "server_error"
                    assert "retry" in err["message"]
                    gate.set()
        until(lambda: not (engine.active or engine.waiting))
        r = httpx.post(srv.url + CHAT, json=_chat(), timeout=30)
        assert r.status_code == 200
        assert scrape(srv.url)[("minillama_requests_total",
                                'route="/v1/chat/completions",code="503"')] == 1
    finally:
        gate.set()
        srv.close()
        engine.close()


def test_memory_stays_flat_across_a_thousand_requests():
    """1,000 requests through the server's engine (distinct prompts, so the prefix cache turns
    over): after the first 200 the process grows by less than 8 MiB and no finished request is
    held (the KV cache and the prefix rows are allocated once and bounded)."""
    import numpy as np

    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, hidden_dim=64,
                      max_seq_len=64)
    model = Transformer(cfg, backend="reference", dtype=np.float32, seed=0)
    engine = Engine(model, max_batch=4, max_seq_len=64, prefix_rows=2)
    engine.start()
    rng = np.random.default_rng(0)

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    import gc
    import weakref

    alive = weakref.WeakSet()
    try:
        reqs = []
        for i in range(1000):
            reqs.append(engine.submit(rng.integers(3, 250, int(rng.integers(2, 20))).tolist(),
                                      max_tokens=4))
            alive.add(reqs[-1])
            if len(reqs) == 4:
                for r in reqs:
                    list(r.events(timeout=60))
                reqs = []
            if i == 199:
                base = rss_mib()
        grown = rss_mib() - base
    finally:
        engine.close()
    gc.collect()
    assert len(alive) <= 8, f"{len(alive)} finished requests still held"
    assert grown < 8, f"grew {grown:.1f} MiB over 800 requests"
    assert engine.active == 0 and engine.waiting == 0
