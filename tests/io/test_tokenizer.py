"""Tokenizers: llama2.c tokenizer.bin against sentencepiece, lossless decode, HF tokenizer.json."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillama.core.errors import MinillamaError
from minillama.infer.generate import TextStreamer
from minillama.io.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Llama2cTokenizer,
    load_tokenizer,
    tokenizer_from_spec,
)

FIXED = [
    "", " ", "  ", "   ", "a", " a", "a ", "Hello world", " Hello", "Hello  world   x",
    "\n", "\n\n", "a\nb\n\n c", "\t tab\t", "a\r\nb", "12345 67.89 1,000,000 2024-01-01",
    "3.14159265358979", "héllo wörld", "naïve café résumé", "日本語のテキストです", "中文 测试",
    "emoji 🎉🦙 ok", "👨‍👩‍👧 family", "Ελληνικά και Русский", "עברית العربية", "\u200b zero width",
    "ǅ ﬁ ｆｕｌｌ ① ™", "\x00\x01\x7f", "I was there. It was sunny; was it?", "was", " was",
    "<s> </s> <unk> <0x0A> <0xFF>", "x" * 60, "   leading and trailing   ", "▁ literal mark",
    "Once upon a time, there was a little girl named Lily.", "def f(x):\n    return x ** 2\n",
    "tabs\t\tand  spaces    mixed \t\n", "ＡＢＣ full-width", "e\u0301 combining accent",
]


def _random_strings(n, seed=0):
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789   \n\t.,!?'\"-()éüßñ€日本語🎉🦙Ж")
    out = []
    for _ in range(n):
        k = int(rng.integers(0, 50))
        out.append("".join(alphabet[i] for i in rng.integers(0, len(alphabet), k)))
    return out


@pytest.fixture(scope="module")
def llama_tok():
    from tests.conftest import SHARED_DATA
    if not (SHARED_DATA / "tokenizer.bin").is_file():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return Llama2cTokenizer(SHARED_DATA / "tokenizer.bin")


@pytest.fixture(scope="module")
def spm():
    sentencepiece = pytest.importorskip("sentencepiece")
    from tests.conftest import SHARED_DATA
    if not (SHARED_DATA / "tokenizer.model").is_file():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return sentencepiece.SentencePieceProcessor(model_file=str(SHARED_DATA / "tokenizer.model"))


def test_vocab_and_specials(llama_tok, spm):
    assert llama_tok.vocab_size == spm.vocab_size() == 32000
    assert (llama_tok.bos_id, llama_tok.eos_id) == (spm.bos_id(), spm.eos_id())
    assert llama_tok.encode("hi", bos=True, eos=True)[0] == 1
    assert llama_tok.encode("hi", bos=True, eos=True)[-1] == 2


@pytest.mark.parametrize("text", FIXED + _random_strings(300))
def test_encode_matches_sentencepiece_and_round_trips(llama_tok, spm, text):
    ids = llama_tok.encode(text, bos=False)
    assert ids == spm.encode(text)
    # U+2581 is SentencePiece's space mark: it reads as a space (sentencepiece does the same)
    assert llama_tok.decode(ids) == text.replace("\u2581", " ")
    assert llama_tok.decode(ids) == spm.decode(ids)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=30))
def test_encode_matches_sentencepiece_on_any_text(llama_tok, spm, text):
    ids = llama_tok.encode(text, bos=False)
    assert ids == spm.encode(text)
    assert llama_tok.decode(ids) == text.replace("\u2581", " ")


def test_decode_keeps_every_character(llama_tok):
    """The known bug elsewhere strips characters (e.g. the s of "was") from pieces; pieces are
    concatenated untouched here, only the dummy-prefix space of the first piece is removed."""
    was = llama_tok.lookup[" was"]
    assert llama_tok.decode([was]) == "was"
    assert llama_tok.decode([1, was]) == "was"
    assert llama_tok.decode([llama_tok.lookup["It"], was]) == "It was"
    s_id = llama_tok.lookup["s"]
    assert llama_tok.decode([s_id, s_id]) == "ss"


def test_byte_fallback_and_streaming(llama_tok):
    text = " 🦙 ok"
    ids = llama_tok.encode(text, bos=False)
    pieces = [llama_tok.pieces[i] for i in ids]
    j = pieces.index(b"<0xF0>")  # the llama is not in the vocabulary: its 4 UTF-8 bytes are
    assert pieces[j:j + 4] == [b"<0xF0>", b"<0x9F>", b"<0xA6>", b"<0x99>"]
    s = TextStreamer(llama_tok, [1])
    pieces = [s.start()] + [s.put(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    data = llama_tok.decode_bytes(ids)
    for n in range(len(ids)):
        assert data.startswith(llama_tok.decode_bytes(ids[:n]))


def _write_tokenizer_bin(path, pieces, scores):
    out = [struct.pack("<i", max(len(p) for p in pieces))]
    for p, s in zip(pieces, scores):
        out.append(struct.pack("<fi", s, len(p)) + p)
    path.write_bytes(b"".join(out))


def test_small_tokenizer_merges_by_score(tmp_path):
    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)] + [
        b" ", b"a", b"b", b"ab", b"ba", b" a", b"aba"]
    scores = [0.0] * 259 + [-1, -2, -3, -5, -4, -1.5, -0.5]
    _write_tokenizer_bin(tmp_path / "t.bin", pieces, scores)
    tok = Llama2cTokenizer(tmp_path / "t.bin")
    idx = {p: i for i, p in enumerate(pieces)}
    # " aba": pairs " a"(-1.5) "ab"(-5) "ba"(-4): merge " a" -> [" a", "b", "a"]; then "ba" -> ...
    assert tok.encode("aba", bos=False) == [idx[b" a"], idx[b"ba"]]
    # "c" is not in the vocabulary: byte fallback
    assert tok.encode("c", bos=False) == [idx[b" "], 3 + ord("c")]
    assert tok.decode(tok.encode("abc ab")) == "abc ab"


def test_bad_tokenizer_files(tmp_path):
    p = tmp_path / "t.bin"
    p.write_bytes(b"\x01")
    with pytest.raises(MinillamaError, match="truncated"):
        Llama2cTokenizer(p)
    _write_tokenizer_bin(p, [b"<unk>", b"<s>", b"</s>", b"abc"], [0, 0, 0, -1])
    p.write_bytes(p.read_bytes()[:-2])
    with pytest.raises(MinillamaError, match="corrupt|truncated"):
        Llama2cTokenizer(p)
    p.write_bytes(struct.pack("<i", -5))
    with pytest.raises(MinillamaError, match="not a llama2.c tokenizer"):
        Llama2cTokenizer(p)
    with pytest.raises(MinillamaError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.bin"))
    (tmp_path / "x.model").write_bytes(b"x")
    with pytest.raises(MinillamaError, match="SentencePiece"):
        load_tokenizer(str(tmp_path / "x.model"))


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# ---------------------------------------------------------------------------------------------
def test_hf_tokenizer_round_trip(hf_tokenizer_json):
    tok = load_tokenizer(str(hf_tokenizer_json.parent))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    for text in ["the cat was here", "héllo 🦙", "", "  two  spaces"]:
        ids = tok.encode(text, bos=True)
        assert ids[0] == 1
        assert tok.decode(ids) == text
    assert tokenizer_from_spec(tok.spec()).encode("the cat") == tok.encode("the cat")
    s = TextStreamer(tok, tok.encode("the", bos=True))
    ids = tok.encode(" cat 🦙 sat", bos=False)
    assert s.start() + "".join(s.put(i) for i in ids) + s.flush() == "the cat 🦙 sat"


def test_hf_tokenizer_without_the_package(hf_tokenizer_json, tmp_path, monkeypatch):
    """Without `tokenizers`, minillama's own BPE reads the file (same ids); a model it does not
    implement is one clear line."""
    import tokenizers

    want = HFTokenizer(hf_tokenizer_json).encode("the cat sat", bos=True)
    wp = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    (tmp_path / "wp").mkdir()
    wp.save(str(tmp_path / "wp" / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert HFTokenizer(hf_tokenizer_json).encode("the cat sat", bos=True) == want
    with pytest.raises(MinillamaError, match="tokenizer model 'WordPiece' is not BPE"):
        HFTokenizer(tmp_path / "wp" / "tokenizer.json")


def test_byte_tokenizer_and_specs(llama_tok):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert tokenizer_from_spec({"type": "byte"}).vocab_size == 258
    again = tokenizer_from_spec(llama_tok.spec())
    assert again.encode("a spec") == llama_tok.encode("a spec")
    with pytest.raises(MinillamaError, match="unknown tokenizer type"):
        tokenizer_from_spec({"type": "nope"})


def test_long_text_matches_sentencepiece(llama_tok, spm):
    """A few thousand characters (the heap-based merge must agree with SentencePiece's order)."""
    text = "\n".join(FIXED + _random_strings(60, seed=7)) * 2
    assert len(text) > 3000
    ids = llama_tok.encode(text, bos=False)
    assert ids == spm.encode(text)
    assert llama_tok.decode(ids) == text.replace("\u2581", " ")
