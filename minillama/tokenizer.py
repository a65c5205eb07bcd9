"""Tokenizers. Every tokenizer has ``encode(text, bos=..., eos=...) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``bos_id``, ``eos_id`` and ``spec()`` (a JSON-able dict
stored in checkpoints so :func:`tokenizer_from_spec` can rebuild it)."""

from __future__ import annotations

import heapq
from typing import Any, Iterable

from .errors import MinillamaError


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is BOS, 257 is EOS (V = 258).

    Lossless for any string; used by the project's own models (the default Shakespeare model)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of ``ids`` (special tokens dropped); a streamer can decode them itself
        when a multi-byte character is split across tokens."""
        return bytes(i for i in ids if 0 <= i < 256)

    def spec(self) -> dict[str, Any]:
        return {"type": "byte"}

    # --- the same vocabulary in other formats ------------------------------------------------
    #: id -> piece as SentencePiece-style vocabularies spell it: byte b is ``<0xBB>``, then BOS/EOS
    PIECES = tuple(f"<0x{b:02X}>" for b in range(256)) + ("<s>", "</s>")

    @classmethod
    def matches(cls, pieces, bos_id, eos_id, space: str = "<0x20>") -> bool:
        """Whether a vocabulary (pieces in id order, BOS/EOS ids) is this tokenizer's; GGUF
        spells the space byte ``space`` (U+2581, see :meth:`gguf_pieces`)."""
        want = list(cls.PIECES)
        want[0x20] = space
        return (list(pieces) in (list(cls.PIECES), want) and bos_id == cls.bos_id
                and eos_id == cls.eos_id)

    @classmethod
    def gguf_pieces(cls) -> list[str]:
        """The vocabulary as a GGUF ``llama`` (SentencePiece) tokenizer: byte pieces, except the
        space, spelled U+2581 because llama.cpp turns every space of a prompt into that mark
        before it looks pieces up (so text without U+2581 gets the same ids)."""
        pieces = list(cls.PIECES)
        pieces[0x20] = "\u2581"
        return pieces

    @classmethod
    def hf_files(cls, model_max_length: int) -> dict[str, dict]:
        """``tokenizer.json`` and ``tokenizer_config.json`` of a Hugging Face folder holding this
        tokenizer: a BPE with byte fallback, no merges, no normalizer or pre-tokenizer, whose only
        pieces are the 256 bytes and the specials, so every character falls back to its UTF-8
        bytes: the ids of :meth:`encode` (BOS added by the post-processor, as ``bos=True``)."""
        bos, eos = cls.PIECES[cls.bos_id], cls.PIECES[cls.eos_id]
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for i, c in ((cls.bos_id, bos), (cls.eos_id, eos))],
            "normalizer": None, "pre_tokenizer": None,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [cls.bos_id], "tokens": [bos]}}},
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"},
                                                         {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                      "vocab": {p: i for i, p in enumerate(cls.PIECES)}, "merges": []}}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                  "eos_token": eos, "model_max_length": int(model_max_length),
                  "split_special_tokens": True,  # "<s>" in a text is its bytes, as in encode
                  "clean_up_tokenization_spaces": False}
        return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def tokenizer_from_spec(spec: dict[str, Any] | None):
    """Rebuild the tokenizer a checkpoint names (``{"type": "byte"}``, ...)."""
    if not spec:
        return None
    if not isinstance(spec, dict):
        raise MinillamaError(f"bad tokenizer spec in checkpoint: {str(spec)[:60]!r}")
    kind = spec.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gguf":
        from .formats.gguf import load_gguf_tokenizer  # noqa: PLC0415

        return load_gguf_tokenizer(spec.get("path"))
    if kind in ("llama2c", "hf"):
        path = spec.get("path")
        if not isinstance(path, str) or not path:
            raise MinillamaError(f"bad {kind} tokenizer spec in checkpoint: no path")
        return Llama2cTokenizer(path) if kind == "llama2c" else HFTokenizer(path)
    raise MinillamaError(f"unknown tokenizer type {str(kind)[:40]!r} in checkpoint")


# ---------------------------------------------------------------------------------------------
# llama2.c tokenizer.bin (a SentencePiece BPE vocabulary with scores)
# ---------------------------------------------------------------------------------------------
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

    def __init__(self, path=None, pieces: list[bytes] | None = None,
                 scores: list[float] | None = None, spec: dict[str, Any] | None = None):
        """Read ``path`` (a tokenizer.bin), or take ``pieces`` and ``scores`` as they are (the
        same vocabulary from elsewhere, e.g. a GGUF file's metadata, whose ``spec`` names it)."""
        from pathlib import Path  # noqa: PLC0415

        self.path = Path(path) if path is not None else None
        self._spec = spec
        if pieces is None:
            pieces, scores = self._read_file(self.path)
        if scores is None or len(scores) != len(pieces) or len(pieces) < 3:
            raise MinillamaError(f"a SentencePiece vocabulary needs >= 3 pieces with one score "
                                 f"each, got {len(pieces)} pieces")
        self.pieces = list(pieces)
        self.scores = list(scores)
        self._index_pieces()

    # --- reading ---------------------------------------------------------------------------------
    def _read_file(self, path) -> tuple[list[bytes], list[float]]:
        """(pieces, scores) of a llama2.c tokenizer.bin; sets ``max_token_length``."""
        import struct  # noqa: PLC0415

        if not path.is_file():
            raise MinillamaError(f"tokenizer not found: {path}")
        data = path.read_bytes()
        if len(data) < 4:
            raise MinillamaError(f"truncated tokenizer file {path}")
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        if not 0 < self.max_token_length < 1 << 16:
            raise MinillamaError(f"{path} is not a llama2.c tokenizer.bin (bad "
                                 f"max_token_length {self.max_token_length})")
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
            if n < 0 or n > self.max_token_length or pos + n > len(data):
                raise MinillamaError(f"corrupt tokenizer file {path}: token {len(pieces)} "
                                     f"has length {n}")
            pieces.append(data[pos:pos + n])
            scores.append(score)
            pos += n
        if len(pieces) < 3:
            raise MinillamaError(f"tokenizer file {path} holds only {len(pieces)} tokens")
        return pieces, scores

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

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._merge(*self._initial_symbols(text))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

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


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json (optional dependency: the `tokenizers` package)
# ---------------------------------------------------------------------------------------------
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|eot_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    BOS/EOS come from ``tokenizer_config.json`` beside the file when it names them, else from the
    usual spellings (``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``...);
    ``generation_config.json`` may add end-of-turn ids (``eos_token_id`` as a list, e.g. Llama 3's
    ``<|eot_id|>``), kept in ``stop_ids``. ``chat_template`` (from ``tokenizer_config.json``) is
    rendered by :meth:`render_chat`."""

    def __init__(self, path):
        from pathlib import Path  # noqa: PLC0415

        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise MinillamaError(f"tokenizer not found: {self.path}")
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415
        except ImportError:  # minillama's own BPE (byte-level or SentencePiece-style)
            from .bpe import LibraryShim  # noqa: PLC0415

            Tokenizer = LibraryShim  # noqa: N806
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - its own error types, and Rust panics
            msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise MinillamaError(f"cannot read tokenizer {self.path}: {msg}") from None
        names = {}
        cfg_path = self.path.parent / "tokenizer_config.json"
        self.chat_template = None
        if cfg_path.is_file():
            conf = _read_json_object(cfg_path)
            self.chat_template = _pick_chat_template(conf.get("chat_template"), cfg_path)
            if conf.get("split_special_tokens") is True:  # "<s>" in a text is text
                self._tok.encode_special_tokens = True
            for key in ("bos_token", "eos_token"):
                v = conf.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    names[key] = v
        self.bos_id = self._find(names.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._find(names.get("eos_token"), _EOS_NAMES)
        self.stop_ids = {i for i in (self.eos_id,) if i is not None}
        gen_path = self.path.parent / "generation_config.json"
        if gen_path.is_file():
            eos = _read_json_object(gen_path).get("eos_token_id")
            for i in eos if isinstance(eos, list) else [eos]:
                if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size:
                    self.stop_ids.add(i)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The folder's chat template rendered for ``messages`` (``[{"role", "content"}]``) by
        jinja2 in a sandbox, with ``bos_token``/``eos_token`` and ``add_generation_prompt`` as
        transformers passes them. A folder without a template is a clear error."""
        if not self.chat_template:
            raise MinillamaError(f"{self.path.parent} has no chat_template in "
                                 f"tokenizer_config.json; drop --chat")
        from .extras import require  # noqa: PLC0415

        jinja2 = require("jinja2", "--chat (rendering the chat template)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

        def raise_exception(message):
            raise MinillamaError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        tok = self._tok
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=tok.id_to_token(self.bos_id) if self.bos_id is not None else "",
                eos_token=tok.id_to_token(self.eos_id) if self.eos_id is not None else "")
        except jinja2.TemplateError as e:
            raise MinillamaError(f"chat template of {self.path.parent}: {e}") from None

    def _find(self, name, fallbacks):
        for n in ([name] if name else []) + list(fallbacks):
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._guard("encode", lambda: self._tok.encode(text, add_special_tokens=False).ids)
        pre = [self.bos_id] if bos and self.bos_id is not None else []
        post = [self.eos_id] if eos and self.eos_id is not None else []
        return pre + list(ids) + post

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._guard("decode", lambda: self._tok.decode(ids, skip_special_tokens=True))

    def _guard(self, what: str, call):
        """Run a call into the `tokenizers` package; its errors and Rust panics (a
        BaseException) on a malformed tokenizer.json become one MinillamaError."""
        try:
            return call()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise MinillamaError(f"tokenizer {self.path} failed to {what}: {msg}") from None

    def spec(self) -> dict[str, Any]:
        return {"type": "hf", "path": str(self.path.resolve())}

    def is_byte_tokenizer(self) -> bool:
        """Whether this is :class:`ByteTokenizer` written as a tokenizer.json (same ids for every
        text): its 258 pieces and BOS/EOS, and the plain byte-fallback pipeline."""
        if self.vocab_size != ByteTokenizer.vocab_size:
            return False
        pieces = [self._tok.id_to_token(i) for i in range(self.vocab_size)]
        if not ByteTokenizer.matches(pieces, self.bos_id, self.eos_id):
            return False
        probe = "a b\u00e9\u2581\n"
        return self.encode(probe, bos=True) == ByteTokenizer().encode(probe, bos=True)


def _read_json_object(path) -> dict:
    """A JSON object file beside a tokenizer.json; anything else is one clear error."""
    import json  # noqa: PLC0415

    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise MinillamaError(f"corrupt {path}: {str(e).splitlines()[0][:100]}") from None
    if not isinstance(conf, dict):
        raise MinillamaError(f"corrupt {path}: not a JSON object")
    return conf


def _pick_chat_template(value, where) -> str | None:
    """``chat_template``: a string, or a list of ``{"name", "template"}`` (the ``default`` one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        t = named.get("default")
        if isinstance(t, str):
            return t
    raise MinillamaError(f"{where}: chat_template must be a string or a list with a 'default'")


def load_tokenizer(spec: str):
    """A tokenizer from a command-line spec: ``byte``, a llama2.c ``tokenizer.bin``, a HF
    ``tokenizer.json`` or a folder holding one."""
    from pathlib import Path  # noqa: PLC0415

    if spec == "byte":
        return ByteTokenizer()
    p = Path(spec)
    if not p.exists():
        raise MinillamaError(f"tokenizer not found: {p}")
    if p.is_dir() or p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix == ".model":
        raise MinillamaError(f"{p}: SentencePiece .model files are not read; use the llama2.c "
                             f"tokenizer.bin or a Hugging Face tokenizer.json")
    return Llama2cTokenizer(p)
