"""`minillama serve`: the OpenAI-compatible server, driven over loopback by the real `openai`
client (and httpx for raw requests). Greedy answers equal the engine's own greedy decode and
`minillama generate --temperature 0`; concurrent clients each get their own text; a client that
goes away frees its slot; bad requests get a 4xx in OpenAI's shape and the server goes on;
logprobs are the model's log-softmax; a conversation's second turn reuses the cached first;
/metrics parses as Prometheus text and its counts move (faults under load:
tests/infer/test_serve_faults.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from minillama.cli import main as cli  # noqa: E402
from minillama.infer.engine import Engine  # noqa: E402
from minillama.infer.generate import generate  # noqa: E402
from minillama.infer.serve import build_app  # noqa: E402
from minillama.io.chat_template import encode_rendered, render_chat  # noqa: E402
from minillama.io.chat_template import stop_ids as _stops  # noqa: E402
from minillama.io.load import DEFAULT_CHECKPOINT, load_model  # noqa: E402

KEY = "sekret"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat?"}]


class _Server:
    """uvicorn serving ``app`` from a thread on a free loopback port."""

    def __init__(self, app, engine, tok, name):
        self.engine, self.tok, self.name = engine, tok, name
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 30, "the server did not start"
            time.sleep(0.02)

    def client(self, key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def shakespeare():
    """The shipped byte-level model (no chat template), 4 slots, no API key."""
    model, tok = load_model(DEFAULT_CHECKPOINT)
    engine = Engine(model, max_batch=4)
    srv = _Server(build_app(engine, tok, "shakespeare"), engine, tok, "shakespeare")
    yield srv
    srv.close()


def make_chat_model(d):
    """A tiny random Hugging Face folder in ``d`` (config.json + safetensors, a byte-level BPE
    tokenizer.json with a ChatML chat_template, 1024 positions): (model, tokenizer)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from minillama.core.config import ModelConfig
    from minillama.io.load import save_hf
    from minillama.model.transformer import init_params

    t = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["the cat sat on the mat", "be brief, the dog ran"] * 50, trainer)
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    V = t.get_vocab_size()
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, hidden_dim=64,
                      max_seq_len=1024)
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(3)
    params["tok_embeddings.weight"][...] = rng.normal(0, 1.0, (V, 32))  # a peaked next token
    save_hf(d, cfg, params)
    return load_model(d)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The tiny chat model (:func:`make_chat_model`), 4 slots, served with an API key."""
    model, tok = make_chat_model(tmp_path_factory.mktemp("chat_model"))
    engine = Engine(model, max_batch=4)
    srv = _Server(build_app(engine, tok, "tiny-chat", api_key=KEY), engine, tok, "tiny-chat")
    yield srv
    srv.close()


def _text_of(tok, prompt_ids, ids):
    """What the server streams for ``ids`` after ``prompt_ids``: the decoded continuation."""
    tail = list(prompt_ids[-16:])
    full, base = tok.decode(tail + list(ids)), tok.decode(tail)
    assert full.startswith(base)
    return full[len(base):]


def _stream_text(chunks, chat):
    text, reasons, usage = [], [], None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            piece = ch.delta.content if chat else ch.text
            text.append(piece or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    return "".join(text), reasons, usage


# ---------------------------------------------------------------------------------------------
def test_completions_equal_generate_and_the_engine(shakespeare, capsys):
    assert cli.main(["generate", "--prompt", "ROMEO.", "-n", "40", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    tok, engine = shakespeare.tok, shakespeare.engine
    prompt = tok.encode("ROMEO.", bos=True)
    ids, reason = engine.generate(prompt, max_tokens=40, stop_ids=_stops(tok))
    client = shakespeare.client()
    r = client.completions.create(model="shakespeare", prompt="ROMEO.", max_tokens=40,
                                  temperature=0)
    text = r.choices[0].text
    assert printed == "ROMEO." + text + "\n"
    assert text == _text_of(tok, prompt, ids) and len(text) > 20
    assert r.choices[0].finish_reason == reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 40)
    chunks = client.completions.create(model="shakespeare", prompt="ROMEO.", max_tokens=40,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    got, reasons, usage = _stream_text(chunks, chat=False)
    assert got == text and reasons == ["length"] and usage.completion_tokens == 40
    # a stop string cuts the text before it, streamed or not, and ends the generation
    cut = text[5:9]
    want = text[:text.find(cut)]
    r = client.completions.create(model="shakespeare", prompt="ROMEO.", max_tokens=40,
                                  temperature=0, stop=[cut, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    got, reasons, _ = _stream_text(client.completions.create(
        model="shakespeare", prompt="ROMEO.", max_tokens=40, temperature=0, stop=cut,
        stream=True), chat=False)
    assert got == want and reasons == ["stop"]


def test_chat_equals_the_engine_greedy_decode(chat):
    tok, engine = chat.tok, chat.engine
    prompt = encode_rendered(tok, render_chat(tok, MESSAGES))
    assert prompt[0] == tok._tok.token_to_id("<|im_start|>")
    ids, reason = engine.generate(prompt, max_tokens=30, stop_ids=_stops(tok))
    want = _text_of(tok, prompt, ids)
    client = chat.client(KEY)
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=30,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and len(want) > 0
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    got, reasons, usage = _stream_text(client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=True)
    assert got == want and reasons == [reason] and usage.completion_tokens == len(ids)
    # seeded sampling is reproducible, request by request
    a, b = (client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=20,
                                           temperature=1.0, top_p=0.9, seed=5)
            .choices[0].message.content for _ in range(2))
    assert a == b


def test_concurrent_clients_each_get_their_own_text(shakespeare):
    """8 streaming clients at once on 4 slots: each text equals that prompt's greedy decode
    alone, and the requests did share decode steps."""
    tok, engine = shakespeare.tok, shakespeare.engine
    prompts = ["ROMEO.", "KING.\nWhat", "First Citizen:\nBefore we proceed", "\n", "JULIET.\n",
               "To be", "HAMLET.\nO", "My lord,"]
    want = [_text_of(tok, tok.encode(p, bos=True),
                     generate(engine.model, tok.encode(p, bos=True), max_new_tokens=60,
                              temperature=0, stop_ids=_stops(tok))) for p in prompts]
    assert len(set(want)) == len(want)
    engine.max_active = 0
    got = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def run(i):
        client = shakespeare.client()
        gate.wait()
        got[i] = _stream_text(client.completions.create(
            model="shakespeare", prompt=prompts[i], max_tokens=60, temperature=0, stream=True),
            chat=False)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want
    assert engine.max_active >= 2


def _wait_idle(engine, timeout=120.0):
    """Wait until no request holds a slot (``timeout`` only ends a hang); returns how many do."""
    t0 = time.monotonic()
    while engine.active and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return engine.active


def _delta_text(line: str) -> str:
    """The reply text a server-sent event line of a chat stream carries ('' for none)."""
    if not line.startswith("data: {"):
        return ""
    return "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])


class _Hold:
    """Stops ``engine``'s scheduler after a step that leaves a running request holding tokens,
    until :meth:`release`: no request can finish, however fast the machine, while the test makes
    its client go away. :meth:`wait_cancelled` waits until the server has cancelled every request
    submitted since :meth:`arm`."""

    def __init__(self, engine, monkeypatch):
        self.submitted, self.gate = [], threading.Event()
        step, submit = engine.batch.step, engine.submit

        def held_step(new, more=None):
            step(new, more=more)
            if any(s.req.tokens for s in engine.batch.slots) and not self.gate.is_set():
                self.gate.wait(300)  # released by the test; the bound only ends a hang

        def recorded_submit(*args, **kw):
            self.submitted.append(submit(*args, **kw))
            return self.submitted[-1]

        monkeypatch.setattr(engine.batch, "step", held_step)
        monkeypatch.setattr(engine, "submit", recorded_submit)

    def arm(self):
        self.submitted = []
        self.gate.clear()

    def wait_cancelled(self, timeout=120.0):
        t0 = time.monotonic()
        while not (self.submitted and all(r.cancelled for r in self.submitted)):
            assert time.monotonic() - t0 < timeout, "the server never cancelled the request"
            time.sleep(0.01)

    def release(self):
        self.gate.set()


def test_a_client_that_goes_away_frees_its_slot(chat, monkeypatch):
    engine = chat.engine
    head = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 900, "temperature": 0,
            "stream": True}
    hold = _Hold(engine, monkeypatch)
    hold.arm()
    try:
        _leave_twice(chat, engine, head, body, hold)
    finally:
        hold.release()  # the server must be able to shut down whatever failed
    r = chat.client(KEY).chat.completions.create(model="tiny-chat", messages=MESSAGES,
                                                 max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def _leave_twice(chat, engine, head, body, hold):
    """A streaming client, then a non-streaming one, leave while their request runs."""
    before = engine.finished["cancelled"]
    with httpx.Client(base_url=chat.url, headers=head, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not _delta_text(next(lines)):  # the first chunk holds only the role
                pass
            assert engine.active == 1  # held: it cannot have finished
    hold.wait_cancelled()
    hold.release()
    assert _wait_idle(engine) == 0
    assert engine.finished["cancelled"] == before + 1
    # a non-streaming client that gives up (its read timeout) frees its slot too: held, the
    # server cannot answer before the timeout
    hold.arm()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(chat.url + "/v1/chat/completions", headers=head, timeout=0.3,
                   json={**body, "stream": False})
    hold.wait_cancelled()
    hold.release()
    assert _wait_idle(engine) == 0
    assert engine.finished["cancelled"] == before + 2


BAD = [  # (path, body, status, code)
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found"),
    ("/v1/completions", b'{"model": "shakespeare", "prompt": "a"', 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", {"prompt": "a"}, 400, "missing_field"),
    ("/v1/completions", {"model": "shakespeare"}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "shakespeare"}, 400, "missing_field"),
    ("/v1/chat/completions", {"model": "shakespeare", "messages": []}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "shakespeare", "messages": [{"content": "x"}]}, 400,
     "invalid_type"),
    ("/v1/chat/completions", {"model": "shakespeare", "messages": MESSAGES}, 400,
     "no_chat_template"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "x" * 300}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"model": "shakespeare", "prompt": [1, 2, 999]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "max_tokens": -1}, 400,
     "invalid_value"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "max_tokens": 2.5}, 400,
     "invalid_type"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "temperature": "hot"}, 400,
     "invalid_type"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "temperature": -1}, 400,
     "invalid_value"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "top_p": [1]}, 400,
     "invalid_type"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "seed": -1}, 400,
     "invalid_value"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "stop": 3}, 400, "invalid_type"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "stream": "yes"}, 400,
     "invalid_type"),
    ("/v1/completions", {"model": "shakespeare", "prompt": "a", "n": 2}, 400, "invalid_value"),
    ("/v1/nothing", {}, 404, "not_found"),
]


def test_bad_requests_get_a_4xx_and_the_server_goes_on(shakespeare):
    with httpx.Client(base_url=shakespeare.url, timeout=30) as c:
        for path, body, status, code in BAD:
            r = (c.post(path, content=body) if isinstance(body, bytes)
                 else c.post(path, json=body))
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["code"] == code and isinstance(err["message"], str), (body, err)
            assert err["type"] == "invalid_request_error"
        r = c.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    client = shakespeare.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="a", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="shakespeare", messages=MESSAGES)
    r = client.completions.create(model="shakespeare", prompt="KING.", max_tokens=5,
                                  temperature=0)
    assert len(r.choices[0].text) > 0 and r.usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == ["shakespeare"]
    assert client.models.retrieve("shakespeare").id == "shakespeare"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(shakespeare.url + "/health").json()["status"] == "ok"


def test_api_key(chat):
    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 2}
    for head in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
                             ("/v1/models", "GET")):
            r = httpx.request(method, chat.url + path, headers=head, json=body, timeout=30)
            assert r.status_code == 401, (head, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        chat.client("wrong").chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert httpx.get(chat.url + "/health").status_code == 200  # health checks need no key
    assert [m.id for m in chat.client(KEY).models.list()] == ["tiny-chat"]


def test_importing_minillama_loads_no_server_stack():
    code = ("import sys, minillama, minillama.cli.main, minillama.cli.serve, "
            "minillama.infer.serve, minillama.infer.engine\n"
            "minillama.cli.main.build_parser()\n"
            "stack = ('starlette', 'uvicorn', 'anyio', 'httpx', 'openai', 'asyncio')\n"
            "print(sorted(m for m in stack if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_command_listens_on_loopback_with_a_key():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillama", "serve", "--port", "0",
                             "--api-key", KEY, "--max-batch", "2"], stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "serving 'shakespeare' on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split()[0]
        for _ in range(200):  # the banner comes just before uvicorn starts accepting
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        r = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="shakespeare", prompt="ROMEO.", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
    finally:
        proc.terminate()
        proc.wait(20)


def test_bad_serve_invocations_are_one_error_line(capsys, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    rows = [(["--port", "70000"], "--port must lie in"),
            (["--port", port], "cannot listen on 127.0.0.1:" + port),
            (["--host", "no.such.host.invalid", "--port", "0"], "cannot listen on"),
            (["--port", "0", "--max-batch", "0"], "expected a positive integer"),
            (["--port", "0", "--max-context", "-5"], "expected a positive integer"),
            (["--port", "0", "--max-queue", "-1"], "expected an integer >= 0"),
            (["--port", "0", "--prefix-cache", "x"], "expected an integer >= 0"),
            (["--port", "0", "-c", str(tmp_path / "missing.safetensors")], "missing"),
            (["--port", "0", "--backend", "tpu"], "unknown backend")]
    try:
        for argv, words in rows:
            try:
                rc = cli.main(["serve", *argv])
            except SystemExit as e:  # argparse
                rc = e.code
            err = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(err) == 1, (argv, err)
            assert err[0].startswith("minillama: error: ") and words in err[0], (argv, err)
    finally:
        busy.close()


#: one row per sampling setting (with what makes it matter: sampling for the filters, greedy for
#: the penalties); each must reach generate, the CLI, chat, the engine and the server alike
SETTINGS = [
    {"temperature": 0.9, "seed": 11},
    {"temperature": 0.9, "seed": 3, "top_k": 3},
    {"temperature": 0.9, "seed": 3, "top_p": 0.5},
    {"temperature": 0.9, "seed": 3, "min_p": 0.3},
    {"temperature": 0.0, "repeat_penalty": 3.0},
    {"temperature": 0.0, "repeat_penalty": 3.0, "repeat_last_n": 2},
    {"temperature": 0.0, "frequency_penalty": 2.0},
    {"temperature": 0.0, "presence_penalty": 2.0},
]
_FLAG = {"temperature": "--temperature", "seed": "--seed", "top_k": "--top-k", "top_p": "--top-p",
         "min_p": "--min-p", "repeat_penalty": "--repeat-penalty",
         "repeat_last_n": "--repeat-last-n", "frequency_penalty": "--frequency-penalty",
         "presence_penalty": "--presence-penalty"}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(s)[12:] or "seed")
def test_every_sampling_setting_reaches_every_front_end(shakespeare, capsys, setting):
    """The same SamplingParams give the same tokens through generate(), `minillama generate`,
    the engine and the server (OpenAI fields, llama-server's names for the rest); each setting
    changes the text compared with the same run without it."""
    from minillama.core.sampling import SamplingParams

    tok, engine, model = shakespeare.tok, shakespeare.engine, shakespeare.engine.model
    prompt, stops, n = tok.encode("ROMEO.", bos=True), _stops(tok), 24
    params = SamplingParams(**setting)
    want = generate(model, prompt, n, params, stop_ids=stops)
    base = {k: v for k, v in setting.items() if k in ("temperature", "seed")}
    if setting != base:
        assert want != generate(model, prompt, n, stop_ids=stops, **base), "no effect"
    assert engine.generate(prompt, params, stop_ids=stops, max_tokens=n)[0] == want
    flags = [str(x) for k, v in setting.items() for x in (_FLAG[k], v)]
    defaults = ["--top-p", "1", "--temperature", "0"]  # generate's own defaults off
    assert cli.main(["generate", "--prompt", "ROMEO.", "-n", str(n), *defaults, *flags]) == 0
    text = _text_of(tok, prompt, want)
    assert capsys.readouterr().out == "ROMEO." + text + "\n"
    openai_names = ("temperature", "seed", "top_p", "frequency_penalty", "presence_penalty")
    r = shakespeare.client().completions.create(
        model="shakespeare", prompt="ROMEO.", max_tokens=n,
        **{k: v for k, v in setting.items() if k in openai_names},
        extra_body={k: v for k, v in setting.items() if k not in openai_names})
    assert r.choices[0].text == text


@pytest.mark.parametrize("setting", SETTINGS[1:], ids=lambda s: "-".join(s)[12:])
def test_every_sampling_setting_reaches_a_chat_session(chat, setting):
    """A chat turn under each setting gives the engine's tokens for the rendered prompt."""
    from minillama.infer.chat import ChatSession

    tok, engine = chat.tok, chat.engine
    session = ChatSession(engine.model, tok, max_new_tokens=12, **setting)
    got = list(session.reply("the cat"))
    ids = encode_rendered(tok, render_chat(tok, [{"role": "user", "content": "the cat"}]))
    want, _ = engine.generate(ids, stop_ids=_stops(tok), max_tokens=12, **setting)
    assert got == want


def _log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def test_logprobs_in_openais_shapes_equal_the_models_log_softmax(chat):
    """Chat (`logprobs`, `top_logprobs`) and completions (`logprobs` k), streamed and not: each
    token's log-probability and its alternatives are the log-softmax of the model's own forward
    over prompt + reply (the raw logits, whatever the temperature)."""
    from minillama.infer.serve_logprobs import TokenText

    tok, engine, model = chat.tok, chat.engine, chat.engine.model
    texts = TokenText(tok)
    client = chat.client(KEY)
    prompt = encode_rendered(tok, render_chat(tok, MESSAGES))
    ids, _ = engine.generate(prompt, max_tokens=12, stop_ids=_stops(tok))
    lsm = _log_softmax(model.forward([prompt + ids])[0])[len(prompt) - 1:]

    def check(entries, merged=False):  # [(token text, logprob, [(alt text, alt logprob)])]
        assert len(entries) == len(ids)
        for j, (text, lp, top) in enumerate(entries):
            assert text == texts(ids[j])[0]
            assert lp == pytest.approx(lsm[j, ids[j]], abs=1e-4)
            want = [(texts(int(i))[0], lsm[j, i]) for i in np.argsort(-lsm[j], kind="stable")[:3]]
            if merged:  # completions: a {text: logprob} map keeps the likelier of equal texts
                first: dict = {}
                for t, v in want:
                    first.setdefault(t, v)
                want = list(first.items())
            assert [t for t, _ in top] == [t for t, _ in want]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in want], atol=1e-4)

    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12,
                                       temperature=0.7, seed=1, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 for c in content)
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=3)
    check([(c.token, c.logprob, [(a.token, a.logprob) for a in c.top_logprobs])
           for c in r.choices[0].logprobs.content])
    streamed = [c for chunk in client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) for ch in chunk.choices if ch.logprobs
        for c in ch.logprobs.content]
    check([(c.token, c.logprob, [(a.token, a.logprob) for a in c.top_logprobs])
           for c in streamed])
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=5,
                                       temperature=0)
    assert r.choices[0].logprobs is None  # not asked: null
    # the completions endpoint, on the rendered prompt as token ids
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check([(t, v, list(top.items())) for t, v, top in
           zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)], merged=True)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                            temperature=0, logprobs=3, stream=True))
    got = [(t, v, list(top.items())) for c in chunks for ch in c.choices if ch.logprobs
           for t, v, top in zip(ch.logprobs.tokens, ch.logprobs.token_logprobs,
                                ch.logprobs.top_logprobs)]
    check(got, merged=True)


def test_a_conversations_second_turn_reuses_the_cache(chat):
    """The second turn's usage reports the prompt tokens taken from the cache (all the first
    turn's prompt at least); the reply is the greedy reply of an engine that reuses nothing."""
    tok, model = chat.tok, chat.engine.model
    client = chat.client(KEY)
    turn1 = [{"role": "system", "content": "be brief, the cat sat on the mat " * 3},
             {"role": "user", "content": "the dog?"}]
    r1 = client.chat.completions.create(model="tiny-chat", messages=turn1, max_tokens=8,
                                        temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "the cat ran"}]
    r2 = client.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=10,
                                        temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens
    cold = Engine(model, max_batch=1, prefix_reuse=False)
    try:
        p2 = encode_rendered(tok, render_chat(tok, turn2))
        ids, _ = cold.generate(p2, max_tokens=10, stop_ids=_stops(tok))
    finally:
        cold.close()
    assert r2.choices[0].message.content == _text_of(tok, p2, ids)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*)?\})? '
                     r'(-?[0-9.]+(e[+-]?[0-9]+)?|\+Inf)$')


def scrape(url, key=None) -> dict:
    """/metrics parsed: {(name, labels text): value}; every line is a comment or a sample."""
    head = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/metrics", headers=head, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out[(m.group(1), m.group(3) or "")] = float(m.group(5))
    return out


def test_metrics_parse_and_move(chat):
    client = chat.client(KEY)
    assert httpx.get(chat.url + "/metrics", timeout=30).status_code == 401  # needs the key
    before = scrape(chat.url, KEY)
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6,
                                       temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=-1)
    after = scrape(chat.url, KEY)

    def moved(name, labels=""):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    route = 'route="/v1/chat/completions",code='
    assert moved("minillama_requests_total", route + '"200"') == 1
    assert moved("minillama_requests_total", route + '"400"') == 1
    assert moved("minillama_requests_total", 'route="/metrics",code="401"') == 0  # before
    assert after[("minillama_requests_total", 'route="/metrics",code="401"')] >= 1
    assert moved("minillama_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("minillama_completion_tokens_total") == r.usage.completion_tokens
    assert moved("minillama_prefill_tokens_total") + moved(
        "minillama_prompt_tokens_cached_total") == r.usage.prompt_tokens
    assert moved("minillama_time_to_first_token_seconds_count") == 1
    samples = r.usage.completion_tokens + (r.choices[0].finish_reason == "stop")
    assert moved("minillama_time_per_output_token_seconds_count") == samples - 1
    for name in ("minillama_time_to_first_token_seconds",
                 "minillama_time_per_output_token_seconds"):
        assert after[(name + "_bucket", 'le="+Inf"')] == after[(name + "_count", "")]
    assert after[("minillama_queue_depth", "")] == 0
    assert after[("minillama_active_slots", "")] == 0
    assert after[("minillama_slots", "")] == 4


def test_sigterm_ends_streams_in_flight_cleanly(tmp_path):
    """SIGTERM while a long completion streams: the stream ends with a last chunk
    (finish_reason ``length``, fewer tokens than asked) and ``[DONE]``, then the process ends."""
    import signal

    from minillama.core.config import ModelConfig
    from minillama.io.checkpoint import save_checkpoint
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=258, hidden_dim=128,
                      max_seq_len=4096)  # the byte tokenizer's 258 ids
    ckpt = tmp_path / "long.safetensors"
    save_checkpoint(ckpt, cfg, init_params(cfg, seed=0))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillama", "serve", "--port", "0", "-c",
                             str(ckpt), "--backend", "reference", "--tokenizer", "byte",
                             "--max-context", "4096"], stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stderr.readline()
        url = line.split(" on ")[1].split()[0]
        host, port = url.split("//")[1].split(":")
        for _ in range(200):
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        body = json.dumps({"model": "long", "prompt": "a", "max_tokens": 4000,
                           "temperature": 0, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            raw = sock.recv(1 << 16)
            while b'"text"' not in raw:
                data = sock.recv(1 << 16)
                assert data, raw  # the stream started
                raw += data
            proc.send_signal(signal.SIGTERM)  # mid-stream
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                raw += data
        # uvicorn shuts down, then re-raises the signal it caught: the exit is SIGTERM's
        assert proc.wait(30) in (0, -signal.SIGTERM)
        events = [json.loads(e[6:]) for e in raw.decode().split("\n")
                  if e.startswith("data: {")]
        assert b"data: [DONE]" in raw
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        n = sum(1 for e in events if e["choices"] and e["choices"][0]["text"])
        assert 0 < n < 4000  # cut short, not run to max_tokens
        assert "shutting down: 1 generation cut short" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
