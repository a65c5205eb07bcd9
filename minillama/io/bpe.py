r"""Byte-pair-encoding tokenizers read from a Hugging Face ``tokenizer.json``, written here (the
``tokenizers`` package is the reference the tests hold them to):

* byte-level BPE (GPT-2, Llama 3, Qwen2): the text is split by a regex (GPT-2's, or the file's
  ``Split`` pattern), each piece's UTF-8 bytes are spelled with GPT-2's printable byte alphabet,
  then merged;
* SentencePiece-style BPE (Llama 2, TinyLlama, Mistral): spaces become U+2581 and one is prepended,
  the characters are merged, and a character without a piece falls back to its ``<0xXX>`` bytes.

Merging: repeatedly join the adjacent pair with the lowest merge rank (leftmost first) until no
pair has a rank. Added tokens (``added_tokens``: BOS, EOS, chat markers) are split out of the
text first and map to their ids directly. Anything else in the file (another model type,
normaliser or pre-tokenizer) is refused with one line naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from minillama.core.errors import MinillamaError
from minillama.core.extras import require

#: GPT-2's pre-tokenizer regex (``ByteLevel`` with ``use_regex``)
GPT2_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
#: Llama 3's split pattern (Qwen2's is the same with single digits)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPACE = "\u2581"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes for U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


#: the largest token id a tokenizer.json may use (bounds every id-indexed table)
MAX_ID = 1 << 24


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_ID


def split_on(text: str, names) -> list[tuple[str, bool]]:
    """``text`` cut into (segment, is one of ``names``), scanning left to right and taking the
    longest name that starts at each position (how added tokens are split out of a text)."""
    names = sorted(names, key=len, reverse=True)
    out: list[tuple[str, bool]] = []
    i = start = 0
    while i < len(text):
        hit = next((n for n in names if text.startswith(n, i)), None)
        if hit is None:
            i += 1
            continue
        if i > start:
            out.append((text[start:i], False))
        out.append((hit, True))
        i = start = i + len(hit)
    if start < len(text):
        out.append((text[start:], False))
    return out


class BPETokenizer:
    """A ``tokenizer.json`` with a ``BPE`` model, byte-level or SentencePiece-style."""

    def __init__(self, path, data: dict | None = None):
        """Read the ``tokenizer.json`` at ``path``, or take its parsed ``data`` (``path`` then only
        names it in messages)."""
        self.path = Path(path)
        try:
            if data is None:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            model = data["model"]
            kind = model.get("type")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise MinillamaError(f"not a tokenizer.json ({e})") from None
        if kind != "BPE":
            raise MinillamaError(f"tokenizer model {str(kind)[:30]!r} is not BPE (install "
                                 f"`tokenizers` for it)")
        try:
            self.vocab: dict[str, int] = dict(model["vocab"])
            merges = model["merges"]
        except (KeyError, TypeError, ValueError) as e:
            raise MinillamaError(f"BPE model without vocab/merges ({e})") from None
        added_tokens = data.get("added_tokens") or []
        if not (all(_is_id(i) for i in self.vocab.values()) and isinstance(merges, list)
                and all(isinstance(m, str) or (isinstance(m, list) and len(m) == 2
                                               and all(isinstance(x, str) for x in m))
                        for m in merges)
                and isinstance(added_tokens, list)
                and all(isinstance(t, dict) and isinstance(t.get("content"), str)
                        and _is_id(t.get("id")) for t in added_tokens)):
            raise MinillamaError(f"{self.path}: corrupt BPE model (vocab ids must be integers "
                                 f"in [0, {MAX_ID}), merges strings or pairs of strings, added "
                                 f"tokens objects with a content and an id)")
        self.ranks = {tuple(m.split(" ", 1) if isinstance(m, str) else m): i
                      for i, m in enumerate(merges)}
        self.byte_fallback = bool(model.get("byte_fallback"))
        self.ignore_merges = bool(model.get("ignore_merges"))
        unk = model.get("unk_token")
        self.unk_id = self.vocab.get(unk) if isinstance(unk, str) else None
        self.added = {t["content"]: t["id"] for t in added_tokens}
        self.special_ids = {t["id"] for t in added_tokens if t.get("special")}
        self._added_ids = set(self.added.values())
        self.pieces = {i: p for p, i in self.vocab.items()} | {i: p for p, i in self.added.items()}
        if not self.pieces:
            raise MinillamaError(f"{self.path}: the BPE vocabulary is empty")
        try:
            self._configure(data.get("normalizer"), data.get("pre_tokenizer"))
        except MinillamaError:
            raise
        except Exception as e:  # a malformed normalizer/pre-tokenizer/pattern
            raise MinillamaError(f"{self.path}: corrupt normalizer or pre-tokenizer "
                                 f"({type(e).__name__}: {str(e)[:80]})") from None
        self._cache: dict[str, list[int]] = {}
        #: special tokens spelled in the text stay text (``split_special_tokens``)
        self.encode_special_tokens = False

    # --- configuration -------------------------------------------------------------------------
    def _configure(self, normalizer, pre) -> None:
        """Recognise the two supported pipelines; set ``byte_level``, ``pattern``, ``prefix``."""
        steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
        kinds = [s.get("type") for s in steps]
        self.byte_level = "ByteLevel" in kinds
        self.spaces_marked = False
        if self.byte_level:
            if normalizer is not None and normalizer.get("type") != "NFC":
                raise MinillamaError(f"{self.path}: normalizer {normalizer.get('type')} is not "
                                     f"supported with byte-level BPE")
            bl = steps[kinds.index("ByteLevel")]
            patterns = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
            if bl.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
            if len(patterns) != 1 or set(kinds) - {"ByteLevel", "Split"}:
                raise MinillamaError(f"{self.path}: pre-tokenizer {kinds} is not supported")

            regex = require("regex", "byte-level BPE without the `tokenizers` package")
            self.pattern = regex.compile(patterns[0])
            self.prefix = " " if bl.get("add_prefix_space") else ""
            self.nfc = normalizer is not None
            self.bytes_to_char = byte_alphabet()
            self.char_to_byte = {c: b for b, c in self.bytes_to_char.items()}
            return
        norm = (normalizer or {}).get("normalizers", [normalizer] if normalizer else [])
        nkinds = [n.get("type") for n in norm]
        self.spaces_marked = bool(nkinds)  # SentencePiece-style: spaces become U+2581
        if not kinds and not nkinds:  # plain BPE: characters (or their bytes) as they are
            self.prefix = ""
            return
        if kinds or nkinds not in (["Prepend", "Replace"], ["Replace"]):
            raise MinillamaError(f"{self.path}: normalizer {nkinds} / pre-tokenizer {kinds} is "
                                 f"not a supported SentencePiece-style BPE")
        self.prefix = SPACE if nkinds[0] == "Prepend" else ""

    # --- encoding ------------------------------------------------------------------------------
    def _split_added(self, text: str) -> list[tuple[str, bool]]:
        """The text cut into (segment, is an added token), longest added token first."""
        return split_on(text, [n for n, i in self.added.items()
                               if not (self.encode_special_tokens and i in self.special_ids)])

    def _merge(self, symbols: list[str]) -> list[str]:
        """Join the lowest-ranked adjacent pair (leftmost on ties) until none has a rank."""
        while len(symbols) > 1:
            best = min(range(len(symbols) - 1),
                       key=lambda i: (self.ranks.get((symbols[i], symbols[i + 1]), 1 << 62), i))
            if (symbols[best], symbols[best + 1]) not in self.ranks:
                break
            symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
        return symbols

    def _word_ids(self, word: str) -> list[int]:
        """The ids of one pre-tokenized word (already in the vocabulary's alphabet)."""
        if word in self._cache:
            return self._cache[word]
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        ids: list[int] = []
        for sym in self._merge(list(word)):
            if sym in self.vocab:
                ids.append(self.vocab[sym])
            elif self.byte_fallback:
                ids += [self.vocab[f"<0x{b:02X}>"] for b in sym.encode("utf-8")]
            elif self.unk_id is not None:
                ids.append(self.unk_id)
        self._cache[word] = ids
        return ids

    def _segment_ids(self, seg: str) -> list[int]:
        if not self.byte_level:
            return self._word_ids(self.prefix + (seg.replace(" ", SPACE) if self.spaces_marked
                                                 else seg))
        if self.nfc:
            import unicodedata

            seg = unicodedata.normalize("NFC", seg)
        ids: list[int] = []
        for piece in self.pattern.findall(self.prefix + seg):
            ids += self._word_ids("".join(self.bytes_to_char[b] for b in piece.encode("utf-8")))
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        ids: list[int] = []
        for seg, is_added in self._split_added(text):
            ids += [self.added[seg]] if is_added else self._segment_ids(seg)
        return ids

    # --- decoding ------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True,
                     strip_prefix: bool = True) -> bytes:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i not in self.pieces:
                raise MinillamaError(f"token id {i} outside the vocabulary of {self.path}")
            if skip_special and i in self.special_ids:
                continue
            p = self.pieces[i]
            if self.byte_fallback and len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
                out += bytes([int(p[3:5], 16)])
            elif i in self._added_ids:
                out += p.encode("utf-8")
            elif self.byte_level:
                out += bytes(self.char_to_byte.get(c, 63) for c in p)
            else:
                out += (p.replace(SPACE, " ") if self.spaces_marked else p).encode("utf-8")
        if strip_prefix and not self.byte_level and self.prefix and out.startswith(b" "):
            del out[0]
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def info(self) -> dict[str, Any]:
        return {"byte_level": self.byte_level, "vocab": len(self.pieces)}


class LibraryShim:
    """:class:`BPETokenizer` behind the few ``tokenizers.Tokenizer`` methods that
    :class:`~minillama.io.tokenizer.HFTokenizer` calls, used when that package is not installed."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def __init__(self, bpe: BPETokenizer):
        self.bpe = bpe

    @classmethod
    def from_file(cls, path: str) -> LibraryShim:
        return cls(BPETokenizer(path))

    @property
    def encode_special_tokens(self) -> bool:
        return self.bpe.encode_special_tokens

    @encode_special_tokens.setter
    def encode_special_tokens(self, value: bool) -> None:
        self.bpe.encode_special_tokens = bool(value)

    def token_to_id(self, piece: str):
        return self.bpe.added.get(piece, self.bpe.vocab.get(piece))

    def id_to_token(self, i: int):
        return self.bpe.pieces.get(int(i))

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return max(self.bpe.pieces) + 1

    def encode(self, text: str, add_special_tokens: bool = False):
        return self._Encoding(self.bpe.encode(text))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.bpe.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")


def byte_level_json(tokens: list[str], merges: list[str], special: Iterable[int],
                    pattern: str = GPT2_PATTERN, ignore_merges: bool = False) -> dict:
    """A byte-level BPE ``tokenizer.json`` dict from a vocabulary in id order, its merges, the
    ids of its special tokens and the split pattern (how GGUF files store such tokenizers)."""
    special = set(special)
    return {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": list(merges), "ignore_merges": ignore_merges},
            "added_tokens": [{"id": i, "content": tokens[i], "special": True}
                             for i in sorted(special)],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}


class TextBPE:
    """A :class:`BPETokenizer` with the project's tokenizer interface (``encode(text, bos, eos)``,
    ``decode``, ``decode_bytes``, ``vocab_size``, ``bos_id``, ``eos_id``, ``add_bos``,
    ``add_eos``, ``token_id``, ``chat_template``, ``spec``)."""

    chat_template = None

    def __init__(self, bpe: BPETokenizer, bos_id, eos_id, spec: dict, add_bos: bool = False,
                 add_eos: bool = False):
        self.bpe, self.bos_id, self.eos_id, self._spec = bpe, bos_id, eos_id, spec
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos) and eos_id is not None

    @property
    def vocab_size(self) -> int:
        return max(self.bpe.pieces) + 1

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        bos = self.add_bos if bos is None else bos
        eos = self.add_eos if eos is None else eos
        pre = [self.bos_id] if bos and self.bos_id is not None else []
        post = [self.eos_id] if eos and self.eos_id is not None else []
        return pre + self.bpe.encode(text) + post

    def token_id(self, piece: str) -> int | None:
        """The id of a token by its text (an added/special token, or a vocabulary piece)."""
        i = self.bpe.added.get(piece)
        return i if i is not None else self.bpe.vocab.get(piece)

    def token_text(self, i) -> str:
        return self.bpe.pieces.get(int(i), "")

    def decode_bytes(self, ids) -> bytes:
        return self.bpe.decode_bytes(ids)

    def token_bytes(self, i) -> bytes:
        """The bytes token i stands for in a text, a special token's own text included."""
        return self.bpe.decode_bytes([i], skip_special=False, strip_prefix=False)

    def decode(self, ids) -> str:
        return self.bpe.decode(ids)

    def spec(self) -> dict:
        return dict(self._spec)
