"""The llama2.c tokenizer family: Llama 2's SentencePiece BPE vocabulary with scores, as stored
in llama2.c's ``tokenizer.bin`` or taken from a GGUF file's metadata. Re-exported by
:mod:`minillama.io.tokenizer`, where the other families and the loaders are."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from minillama.core.errors import MinillamaError


def _flags(tok, bos, eos) -> tuple[bool, bool]:
    """``encode``'s ``bos``/``eos``: None follows the tokenizer's ``add_bos``/``add_eos``."""
    return (tok.add_bos if bos is None else bool(bos)), (tok.add_eos if eos is None else bool(eos))


_SPECIAL_PIECES = (b"<unk>", b"<s>", b"</s>")


class Llama2cTokenizer:
    r"""The SentencePiece BPE tokenizer of Llama 2 as stored by llama2.c in ``tokenizer.bin``.

    File: int32 ``max_token_length``, then for each token id in order a float32 score, an int32
    byte length and the UTF-8 bytes of the piece (SentencePiece's word-boundary mark U+2581 is
    stored as a plain space; byte-fallback pieces are spelled ``<0xXX>``).

    Encoding (what SentencePiece does for Llama's model: no normalisation, spaces kept):

    1. a non-empty text gets the dummy prefix: a space in front (a literal U+2581 counts as a
       space, as in SentencePiece, so such text does not round-trip exactly);
    2. every character becomes its own piece if the vocabulary has it, else one byte-fallback
       token per UTF-8 byte;
    3. repeatedly merge the adjacent pair whose concatenation is a vocabulary piece of the
       highest score (the leftmost on ties), until no pair merges.

    Ids 0, 1, 2 are ``<unk>``, BOS and EOS (llama2.c stores them as ``<unk>``, ``\n<s>\n``,
    ``\n</s>\n``); these control pieces and byte pieces never result from merging and decode
    to nothing (control) or their byte.
    Decoding concatenates the pieces' bytes, removes the dummy-prefix space of the first piece
    and decodes UTF-8 as a whole (bytes of one character may come from several tokens).
    """

    unk_id = 0
    bos_id = 1
    eos_id = 2
    chat_template = None

    def __init__(self, path=None, pieces: list[bytes] | None = None,
                 scores: list[float] | None = None, spec: dict[str, Any] | None = None,
                 add_bos: bool = True, add_eos: bool = False):
        """Read ``path`` (a tokenizer.bin), or take ``pieces`` and ``scores`` as they are (the
        same vocabulary from elsewhere, e.g. a GGUF file's metadata, whose ``spec`` names it).
        ``add_bos``/``add_eos``: what ``encode`` adds by default (llama2.c: BOS only)."""
        from pathlib import Path

        self.path = Path(path) if path is not None else None
        self._spec = spec
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        if pieces is None:
            pieces, scores, self.max_token_length = read_tokenizer_bin(self.path)
        if scores is None or len(scores) != len(pieces) or len(pieces) < 3:
            raise MinillamaError(f"a SentencePiece vocabulary needs >= 3 pieces with one score "
                                 f"each, got {len(pieces)} pieces")
        self.pieces = list(pieces)
        self.scores = list(scores)
        self._index_pieces()

    # --- indexing --------------------------------------------------------------------------------
    def _index_pieces(self) -> None:
        """Build the lookups: ``byte_ids`` (byte -> its ``<0xXX>`` token), ``lookup`` (piece text
        -> id, for merging), ``piece_bytes`` (id -> the bytes it decodes to)."""
        self.byte_ids: dict[int, int] = {}
        self.lookup: dict[str, int] = {}
        self.piece_bytes: list[bytes] = []
        for i, p in enumerate(self.pieces):
            b = self._byte_piece(p)
            if b is not None:
                self.byte_ids.setdefault(b, i)
                self.piece_bytes.append(bytes([b]))
                continue
            if i in (self.unk_id, self.bos_id, self.eos_id) or p in _SPECIAL_PIECES:
                self.piece_bytes.append(b"")
                continue
            self.piece_bytes.append(p)
            try:
                self.lookup.setdefault(p.decode("utf-8"), i)
            except UnicodeDecodeError:
                pass
        self._byte_fallback = len(self.byte_ids) == 256
        self._byte_id_set = frozenset(self.byte_ids.values())

    @staticmethod
    def _byte_piece(p: bytes) -> int | None:
        """The byte a ``<0xXX>`` byte-fallback piece stands for, else None."""
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            try:
                return int(p[3:5], 16)
            except ValueError:
                return None
        return None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    # --- encoding --------------------------------------------------------------------------------
    def _char_ids(self, ch: str) -> list[int]:
        """The token(s) of one character: its piece, else its UTF-8 bytes' tokens, else unk."""
        i = self.lookup.get(ch)
        if i is not None:
            return [i]
        if self._byte_fallback:
            return [self.byte_ids[b] for b in ch.encode("utf-8")]
        return [self.unk_id]

    def _initial_symbols(self, text: str) -> tuple[list[str | None], list[int]]:
        """Steps 1-2: the dummy-prefixed text as one symbol per character (None for byte/unk
        tokens, which never merge) and their ids."""
        syms: list[str | None] = []
        ids: list[int] = []
        # SentencePiece escapes spaces as U+2581, so a literal U+2581 in the text is a space too
        text = text.replace("\u2581", " ")
        for ch in ((" " + text) if text else ""):
            tid = self._char_ids(ch)
            if len(tid) == 1 and self.piece_bytes[tid[0]] == ch.encode("utf-8"):
                syms.append(ch)
            else:
                syms.extend([None] * len(tid))
            ids.extend(tid)
        return syms, ids

    def _merge(self, syms: list[str | None], ids: list[int]) -> list[int]:
        """Step 3: merge adjacent symbols, best score first (leftmost on ties), until none
        merges. A heap holds candidate pairs keyed (-score, left index); entries made stale by an
        earlier merge are skipped when popped. Returns the final ids."""
        lookup, scores = self.lookup, self.scores
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(i: int) -> None:
            j = nxt[i] if 0 <= i < n else n
            if j >= n or syms[i] is None or syms[j] is None:
                return
            merged = syms[i] + syms[j]
            t = lookup.get(merged)
            if t is not None:
                heapq.heappush(heap, (-scores[t], i, j, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, j, merged = heapq.heappop(heap)
            if syms[i] is None or syms[j] is None or nxt[i] != j or syms[i] + syms[j] != merged:
                continue  # stale
            syms[i] = merged
            ids[i] = lookup[merged]
            syms[j] = None
            ids[j] = -1
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [t for t in ids if t >= 0]

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        bos, eos = _flags(self, bos, eos)
        ids = self._merge(*self._initial_symbols(text))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def token_id(self, piece: str) -> int | None:
        """The id of the piece spelled ``piece`` (a control piece like ``<s>`` included)."""
        if not hasattr(self, "_by_text"):
            self._by_text = {}
            for i, p in enumerate(self.pieces):
                self._by_text.setdefault(p.decode("utf-8", errors="replace").strip("\n"), i)
        return self._by_text.get(piece)

    def token_text(self, i) -> str:
        """The spelling of token ``i`` (``<s>`` for BOS), as a chat template writes it."""
        return self.pieces[int(i)].decode("utf-8", errors="replace").strip("\n")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids`` (control tokens dropped, the dummy-prefix space of the first
        piece removed). Prefix-stable: the bytes of ids[:n] start the bytes of ids."""
        out = bytearray()
        first = True
        V = len(self.pieces)
        for i in ids:
            i = int(i)
            if not 0 <= i < V:
                raise MinillamaError(f"token id {i} outside the vocabulary of {V}")
            b = self.piece_bytes[i]
            if not b:
                continue
            if first and b.startswith(b" ") and i not in self._byte_id_set:
                b = b[1:]
            first = False
            out += b
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        if self.path is None:
            if self._spec is None:
                raise MinillamaError("this tokenizer came from a model file, not a "
                                     "tokenizer.bin; it cannot be named in a checkpoint")
            return dict(self._spec)
        return {"type": "llama2c", "path": str(self.path.resolve())}


def read_tokenizer_bin(path) -> tuple[list[bytes], list[float], int]:
    """(pieces, scores, max_token_length) of a llama2.c tokenizer.bin (checked)."""
    import struct

    if not path.is_file():
        raise MinillamaError(f"tokenizer not found: {path}")
    data = path.read_bytes()
    if len(data) < 4:
        raise MinillamaError(f"truncated tokenizer file {path}")
    (max_token_length,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_token_length < 1 << 16:
        raise MinillamaError(f"{path} is not a llama2.c tokenizer.bin (bad "
                             f"max_token_length {max_token_length})")
    pieces: list[bytes] = []
    scores: list[float] = []
    pos = 0 + 4
    while pos < len(data):
        if pos + 8 > len(data):
            raise MinillamaError(f"truncated tokenizer file {path} at token {len(pieces)}")
        score, n = struct.unpack_from("<fi", data, pos)
        pos += 8
        if score != score or abs(score) == float("inf"):
            raise MinillamaError(f"corrupt tokenizer file {path}: token {len(pieces)} "
                                 f"has score {score}")
        if n < 0 or n > max_token_length or pos + n > len(data):
            raise MinillamaError(f"corrupt tokenizer file {path}: token {len(pieces)} "
                                 f"has length {n}")
        pieces.append(data[pos:pos + n])
        scores.append(score)
        pos += n
    if len(pieces) < 3:
        raise MinillamaError(f"tokenizer file {path} holds only {len(pieces)} tokens")
    return pieces, scores, max_token_length
