"""minillama's own BPE (byte-level and SentencePiece-style with byte fallback) gives the ids of the
`tokenizers` library on random unicode text, and decodes them back."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.io.bpe import BPETokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

CORPUS = ["the cat sat on the mat, didn't it? 42 cats!",
          "\u00e9t\u00e9 \u00e0 Paris \u2014 caf\u00e9",
          "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "naive  spaces\tand\nlines  "] * 30
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>"]


def gpt2_kind():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, pre_tokenizers.ByteLevel.alphabet()


def llama3_kind():
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre_tokenizers.ByteLevel.alphabet()


def sentencepiece_kind():
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok, []


@pytest.fixture(scope="module", params=["gpt2", "llama3", "sentencepiece"])
def trained(request, tmp_path_factory):
    tok, alphabet = {"gpt2": gpt2_kind, "llama3": llama3_kind,
                     "sentencepiece": sentencepiece_kind}[request.param]()
    specials = SPECIALS + ([f"<0x{b:02X}>" for b in range(256)]
                           if request.param == "sentencepiece" else [])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    tok.save(str(path))
    return request.param, tok, BPETokenizer(path)


def random_texts(n=60, seed=0):
    """Random strings mixing ASCII words, spaces, punctuation, Latin-1, CJK, emoji, specials."""
    rng = np.random.default_rng(seed)
    pools = ["the cat sat ", " ", "  ", "\n", "'s", "didn't", "42", "1234567", "!?,.", "\u00e9",
             "caf\u00e9", "\u65e5\u672c", "\U0001f600", "\u0416\u0438", "<s>", "<|im_start|>",
             "\t", "x"]
    texts = []
    for _ in range(n):
        parts = [pools[i] for i in rng.integers(0, len(pools), rng.integers(1, 12))]
        parts += ["".join(chr(int(c)) for c in rng.integers(0x20, 0x3000, rng.integers(0, 5)))]
        texts.append("".join(parts))
    return texts


def test_ids_equal_the_tokenizers_library(trained):
    kind, ref, ours = trained
    assert ours.byte_level == (kind != "sentencepiece")
    for text in random_texts():
        want = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == want, (kind, text)
        assert ours.decode(want) == ref.decode(want), (kind, text)


def test_decode_round_trips(trained):
    """Byte-level BPE is lossless (special tokens are dropped by decode). The SentencePiece kind
    is lossless on text without added tokens (it prepends U+2581 to every segment between them);
    its byte pieces are special tokens in this trained vocabulary, so they are kept here."""
    kind, _, ours = trained
    for text in random_texts(seed=1):
        plain = text.replace("<s>", "").replace("<|im_start|>", "")
        if kind == "sentencepiece":
            got = ours.decode_bytes(ours.encode(plain), skip_special=False).decode("utf-8")
            assert got == plain
        else:
            assert ours.decode(ours.encode(text)) == plain


def test_hf_tokenizer_runs_without_the_library(trained, monkeypatch):
    """With `tokenizers` not installed, HFTokenizer reads tokenizer.json with minillama's BPE."""
    import sys

    from minillama.io.tokenizer import HFTokenizer

    kind, ref, ours = trained
    with_lib = HFTokenizer(ours.path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    without = HFTokenizer(ours.path)
    assert type(without._tok).__name__ == "LibraryShim"
    assert (without.bos_id, without.eos_id, without.vocab_size) == \
        (with_lib.bos_id, with_lib.eos_id, with_lib.vocab_size)
    for text in random_texts(20, seed=2):
        assert without.encode(text, bos=True) == with_lib.encode(text, bos=True), (kind, text)
