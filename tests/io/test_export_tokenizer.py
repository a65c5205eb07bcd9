"""Exports keep the tokenizer: a byte-level model exported as a Hugging Face folder carries a
tokenizer.json that transformers' AutoTokenizer reads to the same ids as minillama's byte
tokenizer; as GGUF it carries a llama (SentencePiece) vocabulary of byte pieces that minillama
reads back as the byte tokenizer; either export takes a text prompt with no --tokenizer. A
llama2.c export (a format without a tokenizer) names the flag that works: --tokenizer byte."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import save_checkpoint
from minillama.io.load import load_params
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer
from minillama.model.transformer import init_params

CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=ByteTokenizer.vocab_size,
                  hidden_dim=24, max_seq_len=64)
TEXTS = ["ROMEO. What, ho!", "", " leading and trailing ", "caf\u00e9 \u2581 \u00fc\u00df\n\t",
         "\U0001f600 emoji", "<s> not a special token </s>", "a" * 50]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("exports")
    ckpt = save_checkpoint(d / "m.safetensors", CFG, init_params(CFG, seed=1),
                           tokenizer=ByteTokenizer())
    out = {"ckpt": ckpt}
    for fmt, name in (("hf", "hf"), ("gguf", "m.gguf"), ("llama2c", "m.bin")):
        try:
            rc = cli.main(["export", str(ckpt), "--format", fmt, "--out", str(d / name)])
        except SystemExit as e:  # pragma: no cover
            rc = e.code
        if rc == 0:
            out[fmt] = d / name
    return out


def test_hf_export_writes_the_byte_tokenizer(exports):
    d = exports["hf"]
    assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()
    conf = json.loads((d / "config.json").read_text())
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (256, 257)
    _, _, _, tok = load_params(d)
    assert isinstance(tok, ByteTokenizer)


@pytest.mark.parametrize("library", ["tokenizers", "minillama.io.bpe"])
def test_hf_tokenizer_json_gives_the_byte_ids(exports, library, monkeypatch):
    if library == "tokenizers":
        pytest.importorskip("tokenizers")
    else:  # the package's own BPE, as without the hf extra
        monkeypatch.setitem(sys.modules, "tokenizers", None)
    tok = HFTokenizer(exports["hf"])
    assert tok.is_byte_tokenizer()
    ref = ByteTokenizer()
    for text in TEXTS:
        assert tok.encode(text, bos=True) == ref.encode(text, bos=True), text
        assert tok.decode(ref.encode(text, bos=True, eos=True)) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_transformers_autotokenizer_matches_the_byte_tokenizer(exports, text):
    transformers = pytest.importorskip("transformers")
    auto = _auto_tokenizer(transformers, exports["hf"])
    ids = ByteTokenizer().encode(text, bos=True)
    assert auto(text).input_ids == ids
    assert auto.decode(ids, skip_special_tokens=True) == text
    assert (auto.bos_token_id, auto.eos_token_id) == (256, 257)


_AUTO = {}


def _auto_tokenizer(transformers, path):
    if path not in _AUTO:
        _AUTO[path] = transformers.AutoTokenizer.from_pretrained(str(path))
    return _AUTO[path]


def test_gguf_export_round_trips_the_byte_tokenizer(exports):
    gguf = pytest.importorskip("gguf")
    path = exports["gguf"]
    _, _, _, tok = load_params(path)
    assert isinstance(tok, ByteTokenizer)
    reader = gguf.GGUFReader(str(path), "r")
    f = reader.fields
    assert bytes(f["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in f["tokenizer.ggml.tokens"].data]
    assert tokens[0x41] == "<0x41>" and tokens[0x20] == "\u2581" and tokens[256:] == ["<s>", "</s>"]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0])
             for i in f["tokenizer.ggml.token_type"].data]
    assert types[0x41] == gguf.TokenType.BYTE and types[256] == gguf.TokenType.CONTROL
    assert int(f["tokenizer.ggml.bos_token_id"].parts[-1][0]) == 256


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_an_export_takes_a_prompt(exports, fmt, capsys):
    if fmt not in exports:
        pytest.skip(f"no {fmt} export here (gguf needs the gguf package)")
    argv = ["generate", "-c", "{}", "--prompt", "ROMEO.", "-n", "5", "--temperature", "0"]
    argv[2] = str(exports[fmt])
    assert cli.main(argv) == 0
    out_export = capsys.readouterr().out
    argv[2] = str(exports["ckpt"])
    assert cli.main(argv) == 0
    assert out_export == capsys.readouterr().out
    assert out_export.startswith("ROMEO.")


def test_llama2c_export_names_the_byte_tokenizer(exports, capsys):
    rc = cli.main(["generate", "-c", str(exports["llama2c"]), "--prompt", "ROMEO.", "-n", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--tokenizer byte" in err[0]
    rc = cli.main(["generate", "-c", str(exports["llama2c"]), "--tokenizer", "byte", "--prompt",
                   "ROMEO.", "-n", "3", "--temperature", "0"])
    assert rc == 0 and capsys.readouterr().out.startswith("ROMEO.")


def _llama_simple():
    """llama.cpp's `llama-simple`: in $MINILLAMA_LLAMA_CPP_BIN (a build/bin folder) or on PATH."""
    import os
    import shutil
    from pathlib import Path

    folder = os.environ.get("MINILLAMA_LLAMA_CPP_BIN")
    exe = Path(folder) / "llama-simple" if folder else None
    if exe is not None and exe.is_file():
        return str(exe)
    return shutil.which("llama-simple")


def test_llama_cpp_reads_the_gguf_byte_vocabulary(tmp_path, capsys):
    """llama.cpp tokenizes a prompt of the GGUF export as minillama does (its greedy text from
    the shipped model is minillama's); skipped without llama.cpp's tools."""
    import subprocess

    pytest.importorskip("gguf")
    exe = _llama_simple()
    if exe is None:
        pytest.skip("llama.cpp's llama-simple not found (set MINILLAMA_LLAMA_CPP_BIN)")
    from minillama.io.load import DEFAULT_CHECKPOINT

    path = tmp_path / "shakespeare.gguf"
    assert cli.main(["export", str(DEFAULT_CHECKPOINT), "--format", "gguf", "--out",
                     str(path)]) == 0
    prompt = "ROMEO. What is"
    r = subprocess.run([exe, "-m", str(path), "-n", "40", prompt], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = r.stdout.removeprefix("<s>").strip()
    capsys.readouterr()
    assert cli.main(["generate", "-c", str(path), "--prompt", prompt, "-n", "40",
                     "--temperature", "0"]) == 0
    ours = capsys.readouterr().out.strip()
    assert "llama_model_load: error" not in r.stderr
    assert "15 tokens" in r.stderr  # BOS + the 14 bytes of the prompt
    assert theirs == ours and len(ours) > len(prompt)


def test_hf_to_hf_export_copies_the_tokenizer_files(exports, tmp_path):
    src = exports["hf"]
    conf = json.loads((src / "tokenizer_config.json").read_text())
    with_template = tmp_path / "src"
    with_template.mkdir()
    for f in src.iterdir():
        (with_template / f.name).write_bytes(f.read_bytes())
    (with_template / "tokenizer_config.json").write_text(
        json.dumps({**conf, "chat_template": "{{ messages[0].content }}"}))
    out = tmp_path / "again"
    assert cli.main(["export", str(with_template), "--format", "hf", "--out", str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (with_template / name).read_bytes()
    _, _, _, tok = load_params(out)
    assert isinstance(tok, HFTokenizer) and tok.chat_template  # kept: it has a chat template
    assert tok.encode("hi there", bos=True) == ByteTokenizer().encode("hi there", bos=True)
