"""Chat templates (`generate --chat`) rendered with jinja2 as transformers renders them, and
end-of-turn ids from generation_config.json."""

from __future__ import annotations

import json

import pytest

from minillama.cli import main as cli
from minillama.core.errors import MinillamaError
from minillama.io.chat_template import render_chat, stop_ids
from minillama.io.tokenizer import HFTokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
            "[SYS] {{ m['content'] | trim }}\n{% else %}<{{ m['role'] }}> {{ m['content'] }}"
            "{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant> "
            "{% endif %}")
MESSAGES = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "the cat?"},
            {"role": "assistant", "content": "sat."}, {"role": "user", "content": "\u00e9t\u00e9"}]


@pytest.fixture
def chat_folder(hf_tokenizer_json):
    d = hf_tokenizer_json.parent
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def test_chat_template_renders_as_transformers_does(chat_folder):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(chat_folder))
    tok = HFTokenizer(chat_folder)
    for gen in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert render_chat(tok, MESSAGES, add_generation_prompt=gen) == want
    assert stop_ids(tok) == {2, 0}


def test_no_template_is_one_clear_line(hf_tokenizer_json):
    with pytest.raises(MinillamaError, match="no chat template"):
        render_chat(HFTokenizer(hf_tokenizer_json.parent), MESSAGES)


def test_generate_chat_command(chat_folder, capsys):
    """--chat on a tiny random HF model folder holding that tokenizer: runs, greedy, one line of
    stderr statistics and no traceback."""
    from minillama.core.config import ModelConfig
    from minillama.io.load import save_hf
    from minillama.model.transformer import init_params

    tok = HFTokenizer(chat_folder)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=tok.vocab_size, hidden_dim=48,
                      max_seq_len=128, tie_embeddings=True)
    save_hf(chat_folder, cfg, init_params(cfg, seed=0))
    rc = cli.main(["generate", "-c", str(chat_folder), "--chat", "--prompt", "the cat?",
                   "-n", "5", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err
    from minillama.infer.generate import TextStreamer, generate
    from minillama.io.chat_template import encode_rendered
    from minillama.io.load import load_model

    model, _ = load_model(chat_folder, backend="reference")
    ids = encode_rendered(tok, render_chat(tok, [{"role": "user", "content": "the cat?"}]))
    streamer = TextStreamer(tok, ids)
    streamer.start()
    reply = "".join(streamer.put(t) for t in generate(model, ids, 5, stop_ids=stop_ids(tok)))
    assert out == reply + streamer.flush() + "\n"  # the reply only, as `chat` prints it
    assert "the cat?" not in out and "<user>" not in out


# ---------------------------------------------------------------------------------------------
# real templates of several families, rendered as transformers renders them
# ---------------------------------------------------------------------------------------------
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ "
    "'<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
#: Qwen2.5's shape: whitespace control, `tools` (None when not given), tojson, a loop variable
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. \
You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TURNS = [{"role": "user", "content": "  What is 2+2? "}, {"role": "assistant", "content": "4."},
         {"role": "user", "content": "And in caf\u00e9 \U0001f999 terms?"}]


@pytest.mark.parametrize("family,template,messages,stops", [
    ("llama3", LLAMA3_TEMPLATE, [{"role": "system", "content": "Be brief."}] + TURNS,
     {"<|eot_id|>", "<|end_of_text|>"}),
    ("gemma", GEMMA_TEMPLATE, TURNS, {"<eos>", "<end_of_turn>"}),
    ("qwen2", QWEN2_TEMPLATE, TURNS, {"<|im_end|>", "<|endoftext|>"}),
    ("qwen2", QWEN2_TEMPLATE, [{"role": "system", "content": "S"}] + TURNS,
     {"<|im_end|>", "<|endoftext|>"}),
])
def test_family_templates_render_as_transformers(tmp_path, family, template, messages, stops):
    transformers = pytest.importorskip("transformers")
    from minillama.io.chat_template import encode_rendered
    from tests.support.tokenizer_families import build_family

    folder = build_family(tmp_path / family, family, chat_template=template)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = HFTokenizer(folder)
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        got = render_chat(tok, messages, add_generation_prompt=gen)
        assert got == want
        assert encode_rendered(tok, got) == ref(want, add_special_tokens=False).input_ids
    assert stop_ids(tok) == {tok.token_id(s) for s in stops}


def test_template_errors_are_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.support.tokenizer_families import build_family

    tok = HFTokenizer(build_family(tmp_path / "g", "gemma", chat_template=GEMMA_TEMPLATE))
    with pytest.raises(MinillamaError, match="System role not supported"):
        render_chat(tok, [{"role": "system", "content": "x"}] + TURNS)
    tok.chat_template = "{% for m in messages %}{{ m.content"
    with pytest.raises(MinillamaError, match="does not parse"):
        render_chat(tok, TURNS)


def test_chat_template_jinja_file_wins(chat_folder):
    """transformers reads chat_template.jinja beside the tokenizer before the config's."""
    transformers = pytest.importorskip("transformers")
    (chat_folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}", encoding="utf-8")
    ref = transformers.AutoTokenizer.from_pretrained(str(chat_folder))
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render_chat(HFTokenizer(chat_folder), MESSAGES) == want
    assert "\u00e9t\u00e9" in want  # tojson keeps non-ASCII text


def test_sentencepiece_control_pieces_in_rendered_text(shared_data):
    """A SentencePiece vocabulary (tokenizer.bin, GGUF llama) does not split <s> out of text
    itself: encode_rendered does, and encodes the pieces between on their own."""
    from minillama.io.chat_template import encode_rendered
    from minillama.io.tokenizer import Llama2cTokenizer

    tok = Llama2cTokenizer(shared_data / "tokenizer.bin")
    ids = encode_rendered(tok, "<s>[INST] Once upon [/INST] a time</s>")
    assert ids == [1] + tok.encode("[INST] Once upon [/INST] a time", bos=False) + [2]


def _compiling(monkeypatch, module):
    """Make ``module``'s warm-up treat numpy as a compiling backend that is slow to start, so the
    notice a cold Numba cache prints shows without compiling anything."""
    import functools

    import minillama.infer.generate as gen

    monkeypatch.setattr(gen, "COMPILING_BACKENDS", ("numpy",))
    monkeypatch.setattr(module, "warm_up", functools.partial(gen.warm_up, note_after=0.0))


def test_chat_says_it_compiles_and_shows_backend_and_speed(chat_folder, capsys, monkeypatch):
    """Before the first prompt `chat` compiles (or loads) the kernels, saying so on a cold cache;
    stderr names the backend and each reply's speed; stdout holds the reply only."""
    import io

    import minillama.cli.chat as chat_cli
    from minillama.core.config import ModelConfig
    from minillama.io.load import save_hf
    from minillama.model.transformer import init_params

    tok = HFTokenizer(chat_folder)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=tok.vocab_size, hidden_dim=48,
                      max_seq_len=128, tie_embeddings=True)
    save_hf(chat_folder, cfg, init_params(cfg, seed=0))
    _compiling(monkeypatch, chat_cli)
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat?\n"))
    assert cli.main(["chat", "-c", str(chat_folder), "--backend", "numpy", "-n", "4",
                     "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "numpy: compiling kernels (once, cached) ... done in " in err
    assert "chat: backend numpy" in err and " tok/s" in err
    assert "compiling" not in out and "tok/s" not in out


def test_serve_compiles_before_it_listens(chat_folder, capsys, monkeypatch):
    """`serve` compiles (or loads) the kernels before the first request, saying so when slow."""

    import minillama.cli.serve as serve_cli
    from minillama.core.config import ModelConfig
    from minillama.io.load import save_hf
    from minillama.model.transformer import init_params

    tok = HFTokenizer(chat_folder)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=tok.vocab_size, hidden_dim=48,
                      max_seq_len=128, tie_embeddings=True)
    save_hf(chat_folder, cfg, init_params(cfg, seed=0))
    _compiling(monkeypatch, serve_cli)
    from minillama.cli.main import build_parser

    args = build_parser().parse_args(["serve", "-c", str(chat_folder), "--backend", "numpy",
                                      "--max-batch", "2"])  # every flag at its default
    engine, _, _ = serve_cli.load_engine(args)
    try:
        assert engine.decode_steps >= 1  # the warm-up ran through the engine
        assert "numpy: compiling kernels (once, cached) ... done in " in capsys.readouterr().err
    finally:
        engine.close()
