"""BOS/EOS as each tokenizer's source says: Hugging Face folders of several families (compared
with transformers' AutoTokenizer on the same folder), GGUF metadata with llama.cpp's defaults,
llama2.c's tokenizer.bin; and no import circle between the tokenizers and minillama.io.load."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.io.tokenizer import HFTokenizer, Llama2cTokenizer, load_gguf_tokenizer
from tests.support.tokenizer_families import build_family  # noqa: E402

#: (no text starts with a space: transformers 5 rebuilds the SentencePiece-style pipeline of Llama
#: tokenizers and drops one of the two marks SentencePiece writes there, which is not what this
#: file tests; tests/io/test_tokenizer.py holds the encoding against sentencepiece itself)
TEXTS = ["the cat sat on the mat", "def fibonacci(n):", "two  spaces", "héllo 🦙", "1234!"]
#: family -> (adds BOS, adds EOS) in the real models' configs
FAMILIES = {"llama2": (True, False), "gemma": (True, False), "llama3": (True, False),
            "smollm2": (False, False), "qwen2": (False, False)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_matches_transformers(tmp_path, family):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    folder = build_family(tmp_path / family, family)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = HFTokenizer(folder)
    assert (tok.add_bos, tok.add_eos) == FAMILIES[family]
    for text in TEXTS:
        want = ref(text).input_ids
        assert tok.encode(text) == want, (family, text)
        # an explicit choice overrides the source's
        plain = ref(text, add_special_tokens=False).input_ids
        assert tok.encode(text, bos=False, eos=False) == plain
    if tok.bos_id is not None:
        assert tok.encode("the cat", bos=True)[0] == tok.bos_id
        assert tok.encode("the cat", eos=True)[-1] == tok.eos_id


def test_template_wins_over_config_flags(tmp_path):
    """The post-processor is what the fast tokenizer runs; transformers (5.x) follows it even
    when tokenizer_config.json says otherwise, and so does minillama."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    folder = build_family(tmp_path / "l3", "llama3", {"add_bos_token": False})
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = HFTokenizer(folder)
    assert tok.add_bos and tok.encode("the cat") == ref("the cat").input_ids


def test_config_flags_without_a_template(tmp_path):
    """No TemplateProcessing in tokenizer.json: tokenizer_config.json's add_bos_token /
    add_eos_token decide (what llama.cpp's converter and transformers 4's Llama tokenizers
    read)."""
    pytest.importorskip("tokenizers")
    folder = build_family(tmp_path / "l2", "llama2", {"add_bos_token": True,
                                                      "add_eos_token": True})
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    tok = HFTokenizer(folder)
    ids = tok.encode("the cat")
    assert (ids[0], ids[-1]) == (tok.bos_id, tok.eos_id) == (1, 2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert HFTokenizer(folder).encode("the cat")[0] != 1


def test_llama2c_tokenizer_bin_always_adds_bos(shared_data):
    tok = Llama2cTokenizer(shared_data / "tokenizer.bin")
    assert (tok.add_bos, tok.add_eos) == (True, False)
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1 and ids.count(1) == 1 and ids[-1] != 2
    assert tok.encode("Once upon a time", bos=False) == ids[1:]


def _write_vocab_gguf(path, model: str, pre: str | None = None, **flags) -> Path:
    """A GGUF file holding only a tokenizer: ``llama`` (SentencePiece pieces with scores) or
    ``gpt2`` (the 256 byte symbols and "ab") with BOS 1 and EOS 2."""
    gguf = pytest.importorskip("gguf")
    from minillama.io.bpe import byte_alphabet

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if model == "llama":
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
            ["\u2581", "a", "b", "\u2581a"]
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0, -0.5])
    else:
        tokens = ["<unk>", "<s>", "</s>"] + list(byte_alphabet().values()) + ["ab"]
        w.add_token_list(tokens)
        w.add_token_merges(["a b"])
        w.add_token_types([3, 3, 3] + [1] * 257)
        if pre is not None:
            w.add_tokenizer_pre(pre)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model,pre,flags,want", [
    ("llama", None, {}, (True, False)),  # SentencePiece: BOS by default
    ("llama", None, {"add_bos_token": False}, (False, False)),
    ("llama", None, {"add_eos_token": True}, (True, True)),
    ("gpt2", "smollm", {}, (False, False)),  # byte-level BPE: no BOS by default...
    ("gpt2", "qwen2", {}, (False, False)),
    ("gpt2", "llama-bpe", {}, (True, False)),  # ...except the Llama 3 family
    ("gpt2", "llama-bpe", {"add_bos_token": False}, (False, False)),
    ("gpt2", "default", {"add_bos_token": True}, (True, False)),
])
def test_gguf_flags_and_llama_cpp_defaults(tmp_path, model, pre, flags, want):
    tok = load_gguf_tokenizer(str(_write_vocab_gguf(tmp_path / "v.gguf", model, pre, **flags)))
    assert (tok.add_bos, tok.add_eos) == want
    ids = tok.encode("ab")
    assert (ids[0] == 1) == want[0] and (ids[-1] == 2) == want[1]
    assert tok.encode("ab", bos=True, eos=False)[0] == 1
    assert 1 not in tok.encode("ab", bos=False)


def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_gguf):
    """SmolLM2's GGUF says add_bos_token = false (and its BOS id 1 is <|im_start|>): a prompt
    is encoded without it, as transformers encodes it from the same file."""
    transformers = pytest.importorskip("transformers")
    tok = load_gguf_tokenizer(str(smollm2_gguf))
    assert (tok.add_bos, tok.add_eos, tok.bos_id) == (False, False, 1)
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent),
                                                     gguf_file=smollm2_gguf.name)
    for text in TEXTS:
        assert tok.encode(text) == ref(text).input_ids, text


def test_tokenizers_do_not_import_formats():
    """minillama.io.tokenizer and minillama.io.bpe sit below minillama.io.load: they never import it
    (no circle with formats/gguf.py); importing them, or the chat helpers the server uses,
    does not load it (the chat command itself loads models through it when it runs)."""
    root = Path(__file__).resolve().parents[2] / "minillama"
    for name in ("io/tokenizer.py", "io/bpe.py", "io/families.py", "core/sampling.py"):
        tree = ast.parse((root / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("formats"), (name, node.module)
                assert "formats" not in (node.module or ""), (name, node.module)
    code = ("import sys, minillama.io.tokenizer, minillama.infer.chat; "
            "assert not [m for m in sys.modules if m.startswith('minillama.io.load')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gguf_export_keeps_flags_and_template(tmp_path):
    """save_gguf writes add_bos_token / add_eos_token and the chat template; reading the file
    back gives the same tokenizer behaviour."""
    pytest.importorskip("gguf")
    from minillama.core.config import ModelConfig
    from minillama.io.gguf import save_gguf
    from minillama.model.transformer import init_params

    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % b for b in range(256)] + \
        [b" ", b"a", b"b", b" a"]
    for add_bos, add_eos in ((False, True), (True, False)):
        tok = Llama2cTokenizer(pieces=pieces, scores=[0.0] * 259 + [-1.0, -2.0, -3.0, -0.5],
                               spec={"type": "test"}, add_bos=add_bos, add_eos=add_eos)
        tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
        cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=len(pieces), hidden_dim=32,
                          max_seq_len=32)
        path = save_gguf(tmp_path / f"t{add_bos}.gguf", cfg, init_params(cfg, seed=0), tok)
        again = load_gguf_tokenizer(str(path))
        assert (again.add_bos, again.add_eos) == (add_bos, add_eos)
        assert again.encode("ab") == tok.encode("ab")
        assert again.chat_template == tok.chat_template
