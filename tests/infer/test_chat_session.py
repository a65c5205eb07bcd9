"""`minillama chat`: the conversation keeps its KV cache (a turn prefills only what is new and
decodes exactly what a fresh prefill of the whole conversation would), /reset, /exit, Ctrl-C,
the context running full, piped stdin; and on SmolLM2, replies equal to transformers' greedy
replies on the same GGUF file."""

from __future__ import annotations

import io
import json

import pytest

from minillama.cli import main as cli
from minillama.core.errors import MinillamaError
from minillama.infer.chat import ChatSession
from minillama.infer.generate import generate
from minillama.io.chat_template import encode_rendered, render_chat, stop_ids

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A random 2-layer model saved as a Hugging Face folder with a SmolLM2-style tokenizer and
    a ChatML template; (folder, model, tokenizer)."""
    pytest.importorskip("tokenizers")
    from minillama.core.config import ModelConfig
    from minillama.io.load import load_model, save_hf
    from minillama.model.transformer import init_params
    from tests.support.tokenizer_families import build_family

    folder = build_family(tmp_path_factory.mktemp("tiny") / "m", "smollm2",
                          chat_template=CHATML)
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=400,
                      hidden_dim=64, max_seq_len=256, tie_embeddings=True)
    save_hf(folder, cfg, init_params(cfg, seed=3))
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    model, tok = load_model(folder)
    return folder, model, tok


def _chat(argv, lines: str):
    """Run `minillama chat` in-process with ``lines`` as piped stdin: (rc, stdout)."""
    args = cli.build_parser().parse_args(["chat", *argv])
    out = io.StringIO()
    rc = args.func(args, stdin=io.StringIO(lines), stdout=out)
    return rc, out.getvalue()


def test_each_turn_equals_a_fresh_prefill_and_prefills_only_new_tokens(tiny_chat):
    """Greedy replies with the cache kept across turns equal generate() on the whole rendered
    conversation from an empty cache; the second turn prefills only the tokens past the cached
    common prefix."""
    _, model, tok = tiny_chat
    s = ChatSession(model, tok, system="be brief", max_new_tokens=8, temperature=0.0,
                    repeat_penalty=1.3)
    turns = ["the cat sat", "on the mat?", "def fibonacci(n)"]
    for i, text in enumerate(turns):
        before = list(s.messages)
        got = list(s.reply(text))
        ids = encode_rendered(tok, render_chat(tok, before + [{"role": "user",
                                                                "content": text}]))
        want = generate(model, ids, 8, temperature=0.0, stop_ids=stop_ids(tok),
                        repeat_penalty=1.3)
        assert got == want, i
        if i:
            assert s.last_prefill < len(ids) // 2, (s.last_prefill, len(ids))
        assert s.messages[-1] == {"role": "assistant", "content": tok.decode(got)}


def test_a_template_that_rewrites_history_is_handled(tiny_chat):
    """Templates are not prefix-stable in general (this one marks only the last user turn):
    the cache is rolled back to the common prefix, the rest prefilled, and the reply is still
    exactly the fresh one."""
    _, model, tok = tiny_chat
    tok2 = type(tok).__new__(type(tok))
    tok2.__dict__.update(tok.__dict__)
    tok2.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}"
                          "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    s = ChatSession(model, tok2, max_new_tokens=6, temperature=0.0)
    for text in ["the cat", "the mat"]:
        before = list(s.messages)
        got = list(s.reply(text))
        ids = encode_rendered(tok2, render_chat(tok2, before + [{"role": "user",
                                                                  "content": text}]))
        assert got == generate(model, ids, 6, temperature=0.0, stop_ids=stop_ids(tok2))


def test_piped_turns_reset_and_exit(tiny_chat):
    folder, model, tok = tiny_chat
    rc, out = _chat(["-c", str(folder), "--temperature", "0", "-n", "5"],
                    "the cat\n\n/reset\nthe cat\n/exit\nnever read\n")
    assert rc == 0
    one = ChatSession(model, tok, max_new_tokens=5, temperature=0.0)
    first = tok.decode(list(one.reply("the cat")))
    assert out == first + "\n" + first + "\n"  # /reset: the same first turn again


def test_context_full_drops_the_oldest_turns(tiny_chat, capsys):
    _, model, tok = tiny_chat
    s = ChatSession(model, tok, system="sys", max_new_tokens=4, context=48, temperature=0.0)
    notices = []
    s.notice = notices.append
    for i in range(6):
        list(s.reply(f"the cat sat on the mat {i}"))
        assert len(s.cached) <= 48
    assert notices and "context full" in notices[0]
    assert s.messages[0] == {"role": "system", "content": "sys"}  # the system message stays
    assert s.messages[1]["role"] == "user"  # whole turns are dropped, oldest first
    assert not any("mat 0" in m["content"] for m in s.messages)
    assert s.messages[-2] == {"role": "user", "content": "the cat sat on the mat 5"}
    with pytest.raises(MinillamaError, match="longer than the context"):
        list(s.reply("the cat " * 40))
    assert s.messages[-1]["role"] == "assistant"  # the refused message left no trace


def test_ctrl_c_stops_the_reply_not_the_chat(tiny_chat, capsys):
    folder, _, _ = tiny_chat

    class Interrupting(io.StringIO):
        """stdout that raises KeyboardInterrupt on its 2nd write (Ctrl-C mid-reply)."""
        n = 0

        def write(self, s):
            self.n += 1
            if self.n == 2:
                raise KeyboardInterrupt
            return super().write(s)

    args = cli.build_parser().parse_args(["chat", "-c", str(folder), "--temperature", "0",
                                          "-n", "6"])
    out = Interrupting()
    rc = args.func(args, stdin=io.StringIO("the cat\nthe mat\n"), stdout=out)
    assert rc == 0
    assert "[reply stopped]" in capsys.readouterr().err
    assert out.n > 3  # the second turn was answered after the first was stopped


def test_a_refused_turn_is_one_line_and_the_chat_goes_on(tiny_chat, capsys):
    folder, model, tok = tiny_chat
    rc, out = _chat(["-c", str(folder), "--temperature", "0", "-n", "4", "--context", "40"],
                    "the cat " * 30 + "\nthe cat\n")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("minillama: error:") == 1 and "longer than" in err
    one = ChatSession(model, tok, max_new_tokens=4, context=40, temperature=0.0)
    assert out == tok.decode(list(one.reply("the cat"))) + "\n"  # as if it never came


def test_bad_flags_are_one_line(tiny_chat, capsys):
    folder, _, _ = tiny_chat
    for flags, msg in ((["--min-p", "2"], "min_p"), (["--repeat-penalty", "0"], "repeat_penalty"),
                       (["--context", "1"], "--context")):
        assert cli.main(["chat", "-c", str(folder), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("minillama: error:") and msg in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct against transformers on the same GGUF file
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_ref(request):
    """(transformers tokenizer, transformers model) of the SmolLM2 GGUF file."""
    path = request.getfixturevalue("smollm2_gguf")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = {"gguf_file": path.name}
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32,
                                                              **kw)
    return tok, model.eval()


@pytest.fixture(autouse=True)
def _float_products(monkeypatch):
    """These tests hold replies to transformers' exact greedy tokens: the quantized SmolLM2 file
    loads on numba under auto, whose default 8-bit activation products (docs/MATH.md, "Quantized
    products") may break a near-tie either way; its float32 products keep the exact math."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")


@pytest.fixture(scope="module")
def smol_ours(request):
    from minillama.io.load import load_model

    return load_model(request.getfixturevalue("smollm2_gguf"))


def _ref_reply(smol_ref, messages, n, stops) -> list[int]:
    import torch

    tok, model = smol_ref
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=sorted(stops))
    new = out[0, ids.shape[1]:].tolist()
    cut = next((i for i, t in enumerate(new) if t in stops), len(new))
    return new[:cut]


def test_smollm2_renders_as_transformers(smollm2_gguf, smol_ref, smol_ours):
    _, tok = smol_ours
    ref_tok, _ = smol_ref
    for messages in ([{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user",
                                                                  "content": "Hi!"},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "caf\u00e9?"}]):
        for gen in (True, False):
            want = ref_tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=gen)
            got = render_chat(tok, messages, add_generation_prompt=gen)
            assert got == want
            assert encode_rendered(tok, got) == ref_tok(want, add_special_tokens=False).input_ids
    assert {tok.token_id("<|im_end|>"), tok.eos_id} <= stop_ids(tok)


def test_smollm2_two_turn_chat_equals_transformers(smol_ref, smol_ours):
    """The greedy reply to one turn, then the second reply given the whole history, equal
    transformers' greedy replies to apply_chat_template(add_generation_prompt=True)."""
    model, tok = smol_ours
    stops = stop_ids(tok)
    s = ChatSession(model, tok, max_new_tokens=16, temperature=0.0)
    first = list(s.reply("What is the capital of France?"))
    history = [{"role": "user", "content": "What is the capital of France?"}]
    ids1 = encode_rendered(tok, render_chat(tok, history))
    assert first == _ref_reply(smol_ref, history, 16, stops)
    assert first  # a real reply
    second = list(s.reply("And of Germany?"))
    history += [{"role": "assistant", "content": tok.decode(first)},
                {"role": "user", "content": "And of Germany?"}]
    assert second == _ref_reply(smol_ref, history, 16, stops)
    # the second turn reused the cached prompt and reply and prefilled only what follows them
    ids2 = encode_rendered(tok, render_chat(tok, history))
    assert ids2[:len(ids1) + len(first)] == ids1 + first
    assert s.last_prefill == len(ids2) - len(ids1) - len(first)


def test_smollm2_generate_and_chat_commands(smollm2_gguf, smol_ref, smol_ours, capsys):
    """`generate --prompt "def fibonacci(n):" --temperature 0 -n 12` prints transformers'
    greedy continuation (no BOS in front: the GGUF says add_bos_token = false);
    `generate --chat` and piped `chat` print transformers' greedy reply."""
    import torch

    ref_tok, ref_model = smol_ref
    _, tok = smol_ours
    ids = ref_tok("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = ref_model.generate(ids, max_new_tokens=12, do_sample=False)
    want = ref_tok.decode(out[0], skip_special_tokens=True)
    assert cli.main(["generate", "-c", str(smollm2_gguf), "--prompt", "def fibonacci(n):",
                     "--temperature", "0", "-n", "12"]) == 0
    got = capsys.readouterr().out
    assert got == want + "\n"

    msg = [{"role": "user", "content": "Name a color."}]
    reply = tok.decode(_ref_reply(smol_ref, msg, 8, stop_ids(tok)))
    rc, out = _chat(["-c", str(smollm2_gguf), "--temperature", "0", "-n", "8"],
                    "Name a color.\n")
    assert rc == 0 and out == reply + "\n"
    assert cli.main(["generate", "-c", str(smollm2_gguf), "--chat", "--prompt", "Name a color.",
                     "--temperature", "0", "-n", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed == reply + "\n"  # the reply only, as `chat` prints it


def test_smollm2_served_chat_equals_transformers(smol_ref, smol_ours):
    """`minillama serve`'s app on the SmolLM2 file answers a chat through the `openai` client,
    streamed and not, with transformers' greedy reply."""
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    import socket
    import threading
    import time

    from minillama.infer.engine import Engine
    from minillama.infer.serve import build_app

    model, tok = smol_ours
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = tok.decode(_ref_reply(smol_ref, messages, 16, stop_ids(tok)))
    engine = Engine(model, max_batch=2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, tok, "smol"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        t0 = time.time()
        while not server.started:
            assert time.time() - t0 < 30, "the server did not start"
            time.sleep(0.02)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                               api_key="none", max_retries=0)
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=16,
                                           temperature=0)
        assert r.choices[0].message.content == want and want
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smol", messages=messages, max_tokens=16, temperature=0, stream=True)
            if c.choices]
        assert "".join(parts) == want
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        engine.close()


def test_a_reply_cut_at_a_stop_text_is_what_the_next_turn_sees(tiny_chat):
    """cut_reply: the conversation goes on from the reply as shown (cut at a stop text), and
    the next turn's prompt equals that of a fresh session given the same history."""
    _, model, tok = tiny_chat
    s = ChatSession(model, tok, max_new_tokens=6, temperature=0.0)
    list(s.reply("hello"))
    s.cut_reply("cut")
    assert s.messages[-1] == {"role": "assistant", "content": "cut"}
    second = list(s.reply("again"))
    fresh = ChatSession(model, tok, max_new_tokens=6, temperature=0.0)
    fresh.messages += [{"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "cut"}]
    assert list(fresh.reply("again")) == second


def test_a_session_ends_its_reply_at_a_stop_text_and_keeps_it_cut(tiny_chat):
    """ChatSession itself applies params.stop: the reply ends at the token whose text completes
    a stop text, and the history holds the reply cut before it, as a streaming caller shows it;
    without stop texts the same session runs on."""
    _, model, tok = tiny_chat
    ids = list(ChatSession(model, tok, max_new_tokens=8, temperature=0.0).reply("hello"))
    stop = tok.decode(ids[:3])[1:]  # complete by the third token, after the reply's first char
    assert len(ids) == 8 and stop, ids
    n = next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j]))
    s = ChatSession(model, tok, max_new_tokens=8, temperature=0.0, stop=[stop])
    got = list(s.reply("hello"))
    assert got == ids[:n] and n < len(ids)
    said = tok.decode(got)
    assert s.messages[-1] == {"role": "assistant", "content": said[:said.index(stop)]}


def test_chat_with_a_draft_model_replies_as_without(tiny_chat, monkeypatch):
    """`minillama chat --draft` (here the model drafting for itself) drafts from it and gives
    the replies of plain greedy decoding, turn after turn on the reused cache."""
    from minillama.core import speculative

    folder, _, _ = tiny_chat
    base = ["-c", str(folder), "--backend", "numba", "--temperature", "0", "-n", "12"]
    lines = "the cat sat\non the mat?\nthe cat sat\n"
    rc, plain = _chat([*base, "--no-speculate"], lines)
    guesses = []
    real = speculative.ModelDraft.guess
    monkeypatch.setattr(speculative.ModelDraft, "guess",
                        lambda self, k: guesses.append(k) or real(self, k))
    rc2, drafted = _chat([*base, "--draft", str(folder)], lines)
    assert rc == rc2 == 0 and plain.count("\n") >= 3
    assert drafted == plain and guesses



def test_smollm2_next_turn_equals_the_conversation_sent_fresh_bit_for_bit(smollm2_gguf,
                                                                         monkeypatch):
    """SmolLM2's Q4_1 file on numba with its default 8-bit products, whose decode steps compute
    a position as a prefill does (blocks of 32): a turn keeps the rows of the prompt and of the
    reply the decode steps wrote, prefills the rest, and leaves the cache's K/V bit for bit those
    of the whole conversation sent to a fresh session."""
    import numpy as np

    from minillama.backends import available_backends
    from minillama.io.load import load_model

    if "numba" not in available_backends():
        pytest.skip("numba is not installed")
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS")  # the default 8-bit products
    model, tok = load_model(smollm2_gguf, backend="numba")
    s = ChatSession(model, tok, max_new_tokens=24, context=512, temperature=0.0)
    first = list(s.reply("Tell me about a violin."))
    ids1 = encode_rendered(tok, render_chat(tok, s.messages[:-1]))
    assert first and s.cached[:len(ids1)] == ids1 and len(s.cached) > len(ids1)  # and reply
    fresh = ChatSession(model, tok, max_new_tokens=24, context=512, temperature=0.0)
    fresh.messages = list(s.messages)
    assert list(s.reply("And a cello?")) == list(fresh.reply("And a cello?"))
    ids2 = encode_rendered(tok, render_chat(tok, s.messages[:-1]))
    assert s.last_prefill <= len(ids2) - len(ids1) and fresh.last_prefill == len(ids2)
    n = s.last_stats.positions
    assert n == fresh.last_stats.positions and n > len(ids2)
    for a, b in zip(s.cache.k + s.cache.v, fresh.cache.k + fresh.cache.v):
        assert np.array_equal(np.asarray(a)[:, :n], np.asarray(b)[:, :n])
