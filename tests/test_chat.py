"""Chat templates (`generate --chat`) rendered with jinja2 as transformers renders them, and
end-of-turn ids from generation_config.json."""

from __future__ import annotations

import json

import pytest

from minillama import cli
from minillama.chat import render_chat, stop_ids
from minillama.errors import MinillamaError
from minillama.tokenizer import HFTokenizer

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
    from minillama.config import ModelConfig
    from minillama.formats import save_hf
    from minillama.model import init_params

    tok = HFTokenizer(chat_folder)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=tok.vocab_size, hidden_dim=48,
                      max_seq_len=128, tie_embeddings=True)
    save_hf(chat_folder, cfg, init_params(cfg, seed=0))
    rc = cli.main(["generate", "-c", str(chat_folder), "--chat", "--prompt", "the cat?",
                   "-n", "5", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err
    assert out.startswith("<user> the cat?")  # the rendered prompt is echoed, then the reply
