"""Tokenizers. Every tokenizer has ``encode(text, bos=None, eos=None) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``bos_id``, ``eos_id``, ``add_bos``/``add_eos`` (whether
the model's authors want BOS in front of / EOS after a text: ``encode`` follows them unless ``bos``
or ``eos`` says otherwise), ``token_id(piece)`` (a special token's id by its text, or None),
``chat_template`` (None where the source has none) and ``spec()`` (a JSON-able dict stored in
checkpoints so :func:`tokenizer_from_spec` can rebuild it).

Where BOS/EOS come from:

* llama2.c ``tokenizer.bin``: always BOS, never EOS (as llama2.c's ``run.c``);
* GGUF metadata: ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` when present, else
  llama.cpp's defaults per tokenizer model: ``llama`` (SentencePiece) BOS, ``gpt2`` (byte-level
  BPE) BOS only for the Llama 3 family of pre-tokenizers (``llama3``, ``llama-bpe``...);
* Hugging Face folders: the ``TemplateProcessing`` post-processor of ``tokenizer.json`` (the
  special tokens before and after ``$A`` in its ``single`` template) when it has one, else
  ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json``, else neither;
* the byte tokenizer: BOS (its models are trained on BOS-prefixed documents).

Nothing here imports :mod:`minillama.io.load`: the GGUF metadata is read with the ``gguf``
package directly, and :mod:`minillama.io.gguf` imports :func:`tokenizer_from_gguf` from
here. The llama2.c family (:class:`Llama2cTokenizer`, SentencePiece BPE with scores) lives in
:mod:`minillama.io.tokenizer_llama2c` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minillama.core.errors import MinillamaError
from minillama.io.bpe import (
    BPETokenizer,
    LibraryShim,
    TextBPE,
    byte_level_json,
)
from minillama.io.families import pre_tokenizers
from minillama.io.gguf_file import meta as gguf_meta
from minillama.io.gguf_file import open_gguf as gguf_reader
from minillama.io.tokenizer_llama2c import Llama2cTokenizer, _flags  # noqa: F401 (re-exported)


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is BOS, 257 is EOS (V = 258).

    Lossless for any string; used by the project's own models (the default Shakespeare model)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    add_bos = True
    add_eos = False
    chat_template = None

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        bos, eos = _flags(self, bos, eos)
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def token_id(self, piece: str) -> int | None:
        return {"<s>": self.bos_id, "</s>": self.eos_id}.get(piece)

    def token_text(self, i) -> str:
        return {self.bos_id: "<s>", self.eos_id: "</s>"}.get(i, "")

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
        return load_gguf_tokenizer(spec.get("path"))
    if kind in ("llama2c", "hf"):
        path = spec.get("path")
        if not isinstance(path, str) or not path:
            raise MinillamaError(f"bad {kind} tokenizer spec in checkpoint: no path")
        return Llama2cTokenizer(path) if kind == "llama2c" else HFTokenizer(path)
    raise MinillamaError(f"unknown tokenizer type {str(kind)[:40]!r} in checkpoint")


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
    ``<|eot_id|>``), kept in ``stop_ids``. Whether ``encode`` adds BOS/EOS: the post-processor's
    ``TemplateProcessing`` when ``tokenizer.json`` has one (what the fast tokenizer does), else
    ``add_bos_token``/``add_eos_token`` of ``tokenizer_config.json``, else neither.
    ``chat_template``: ``chat_template.jinja`` beside the file, else ``tokenizer_config.json``'s
    (rendered by :func:`minillama.io.chat_template.render_chat`)."""

    def __init__(self, path):
        from pathlib import Path

        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise MinillamaError(f"tokenizer not found: {self.path}")
        try:
            from tokenizers import Tokenizer
        except ImportError:  # minillama's own BPE (byte-level or SentencePiece-style)

            Tokenizer = LibraryShim
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # its own error types, and Rust panics
            msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise MinillamaError(f"cannot read tokenizer {self.path}: {msg}") from None
        names = {}
        cfg_path = self.path.parent / "tokenizer_config.json"
        self.chat_template = None
        conf = {}
        if cfg_path.is_file():
            conf = _read_json_object(cfg_path)
            self.chat_template = _pick_chat_template(conf.get("chat_template"), cfg_path)
            if conf.get("split_special_tokens") is True:  # "<s>" in a text is text
                self._tok.encode_special_tokens = True
            for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
                v = conf.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    names[key] = v
        jinja = self.path.parent / "chat_template.jinja"
        if jinja.is_file():
            try:
                self.chat_template = jinja.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise MinillamaError(f"{jinja} is not UTF-8 text") from None
        # a config that names bos_token null (Qwen2) has none: no fallback spelling then
        self.bos_id = self._find(names.get("bos_token"), () if "bos_token" in conf
                                 and conf["bos_token"] is None else _BOS_NAMES)
        self.eos_id = self._find(names.get("eos_token"), _EOS_NAMES)
        self.special_names = {k: v for k, v in names.items()
                              if self._tok.token_to_id(v) is not None}
        self.add_bos, self.add_eos = self._special_flags(conf)
        self.stop_ids = {i for i in (self.eos_id,) if i is not None}
        gen_path = self.path.parent / "generation_config.json"
        if gen_path.is_file():
            eos = _read_json_object(gen_path).get("eos_token_id")
            for i in eos if isinstance(eos, list) else [eos]:
                if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size:
                    self.stop_ids.add(i)

    def _special_flags(self, conf: dict) -> tuple[bool, bool]:
        """(add_bos, add_eos): the ``single`` template of a ``TemplateProcessing`` post-processor
        (also inside a ``Sequence``) when there is one, else the config's flags."""
        import json

        try:
            post = json.loads(self.path.read_text(encoding="utf-8")).get("post_processor")
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
            post = None
        steps = post.get("processors", [post]) if isinstance(post, dict) else []
        for step in steps:
            if not isinstance(step, dict) or step.get("type") != "TemplateProcessing":
                continue
            single = step.get("single") or []
            where = [i for i, part in enumerate(single)
                     if isinstance(part, dict) and "Sequence" in part]
            if not where:
                continue
            specials = [i for i, part in enumerate(single)
                        if isinstance(part, dict) and "SpecialToken" in part]
            return (any(i < where[0] for i in specials), any(i > where[-1] for i in specials))
        flags = []
        for key, default in (("add_bos_token", False), ("add_eos_token", False)):
            v = conf.get(key, default)
            flags.append(bool(v) if isinstance(v, bool) else default)
        return flags[0] and self.bos_id is not None, flags[1] and self.eos_id is not None

    def token_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    def token_text(self, i) -> str:
        return self._tok.id_to_token(int(i)) or ""

    def _find(self, name, fallbacks):
        for n in ([name] if name else []) + list(fallbacks):
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        bos, eos = _flags(self, bos, eos)
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
        except BaseException as e:
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
    import json

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


#: every tokenizer ``--tokenizer`` (:func:`load_tokenizer`) accepts, as the commands name them
TOKENIZER_KINDS = ("a llama2.c tokenizer.bin, a Hugging Face tokenizer.json (or its folder), a "
                   "GGUF file (the tokenizer in its metadata), or 'byte'")


def load_tokenizer(spec: str):
    """A tokenizer from a command-line spec: ``byte``, a llama2.c ``tokenizer.bin``, a HF
    ``tokenizer.json`` or a folder holding one, or a GGUF file (the tokenizer in its metadata)."""
    from pathlib import Path

    if spec == "byte":
        return ByteTokenizer()
    p = Path(spec)
    if not p.exists():
        raise MinillamaError(f"tokenizer not found: {p} (a tokenizer is {TOKENIZER_KINDS})")
    if p.is_dir() or p.suffix == ".json":
        return HFTokenizer(p)
    if p.suffix == ".gguf":
        tok = load_gguf_tokenizer(str(p))
        if tok is None:
            raise MinillamaError(f"{p} holds no tokenizer")
        return tok
    if p.suffix == ".model":
        raise MinillamaError(f"{p}: SentencePiece .model files are not read; pass "
                             f"{TOKENIZER_KINDS}")
    return Llama2cTokenizer(p)


# ---------------------------------------------------------------------------------------------
# GGUF metadata (``tokenizer.ggml.*``), read with the `gguf` package
# ---------------------------------------------------------------------------------------------
#: pre-tokenizers of byte-level GGUF tokenizers after which llama.cpp adds BOS by default
GGUF_BOS_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                "lfm2", "tekken", "chameleon")


def _gguf_id(reader, key: str, n: int, where) -> int | None:
    v = gguf_meta(reader, f"tokenizer.ggml.{key}")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise MinillamaError(f"{where}: GGUF tokenizer.ggml.{key} {v} is outside its {n} tokens")
    return int(v)


def _gguf_flag(reader, key: str, default: bool, where) -> bool:
    v = gguf_meta(reader, f"tokenizer.ggml.{key}")
    if v is None:
        return default
    if not isinstance(v, (bool, int)):
        raise MinillamaError(f"{where}: GGUF tokenizer.ggml.{key} is not a boolean: {v!r}")
    return bool(v)


def tokenizer_from_gguf(reader, vocab_size: int, where):
    """The tokenizer of a GGUF file's metadata, or None when it has none.

    ``tokenizer.ggml.model`` ``llama``: SentencePiece pieces and scores (a
    :class:`Llama2cTokenizer`); ``gpt2``: byte-level BPE (tokens, merges, control tokens, the
    ``tokenizer.ggml.pre`` split pattern; a :class:`~minillama.io.bpe.TextBPE`). BOS/EOS ids, the
    add-BOS/EOS flags (with llama.cpp's defaults), end-of-turn ids (``eot_token_id``,
    ``eom_token_id``, kept in ``stop_ids``) and ``tokenizer.chat_template`` come along.
    Another tokenizer model is refused with one line."""
    from pathlib import Path

    model = gguf_meta(reader, "tokenizer.ggml.model")
    if model is None:
        return None
    spec = {"type": "gguf", "path": str(Path(where).resolve())}
    if model == "gpt2":
        tok = _gguf_byte_level(reader, vocab_size, where, spec)
    elif model == "llama":
        tokens = gguf_meta(reader, "tokenizer.ggml.tokens")
        scores = gguf_meta(reader, "tokenizer.ggml.scores")
        if not isinstance(tokens, list) or not isinstance(scores, list) \
                or len(tokens) != len(scores) or len(tokens) > vocab_size:
            raise MinillamaError(f"{where}: GGUF tokenizer needs tokens and scores of equal "
                                 f"length <= the vocabulary of {vocab_size}")
        special = [_gguf_id(reader, f"{k}_token_id", len(tokens), where) for k in ("bos", "eos")]
        if ByteTokenizer.matches(tokens, *special, space="\u2581"):
            return ByteTokenizer()  # minillama's byte tokenizer, as save_gguf writes it
        pieces = [str(t).replace("\u2581", " ").encode("utf-8") for t in tokens]
        tok = Llama2cTokenizer(pieces=pieces, scores=[float(s) for s in scores], spec=spec,
                               add_bos=_gguf_flag(reader, "add_bos_token", True, where),
                               add_eos=_gguf_flag(reader, "add_eos_token", False, where))
        for attr, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"),
                          ("unk_id", "unknown_token_id")):
            v = _gguf_id(reader, key, len(pieces), where)
            if v is not None:
                setattr(tok, attr, v)
    else:
        raise MinillamaError(f"{where}: GGUF tokenizer model {str(model)[:40]!r} is not supported "
                             f"(supported: llama, gpt2); pass --tokenizer")
    n = tok.vocab_size
    tok.stop_ids = {i for i in (_gguf_id(reader, k, n, where) for k in
                                ("eos_token_id", "eot_token_id", "eom_token_id")) if i is not None}
    template = gguf_meta(reader, "tokenizer.chat_template")
    tok.chat_template = template if isinstance(template, str) and template else None
    return tok


def _gguf_byte_level(reader, vocab_size: int, where, spec):
    """A GPT-2-style (``tokenizer.ggml.model`` ``gpt2``) tokenizer: tokens, merges, token types
    (3 = control: special) and the pre-tokenizer named by ``tokenizer.ggml.pre`` (one of the
    families' pre-tokenizers, :func:`minillama.io.families.pre_tokenizers`)."""
    tokens = gguf_meta(reader, "tokenizer.ggml.tokens")
    merges = gguf_meta(reader, "tokenizer.ggml.merges")
    types = gguf_meta(reader, "tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not isinstance(merges, list) or len(tokens) > vocab_size:
        raise MinillamaError(f"{where}: GGUF gpt2 tokenizer needs tokens (<= the vocabulary of "
                             f"{vocab_size}) and merges")
    pre = gguf_meta(reader, "tokenizer.ggml.pre", "default")
    patterns = pre_tokenizers()
    if not isinstance(pre, str) or pre not in patterns:
        raise MinillamaError(f"{where}: GGUF pre-tokenizer {str(pre)[:40]!r} is not supported "
                             f"(supported: {', '.join(patterns)})")
    pattern, ignore = patterns[pre]
    special = [i for i, t in enumerate(types) if t == 3 and i < len(tokens)]
    bpe = BPETokenizer(where, byte_level_json([str(t) for t in tokens], [str(m) for m in merges],
                                              special, pattern, ignore))
    bos = _gguf_id(reader, "bos_token_id", len(tokens), where)
    eos = _gguf_id(reader, "eos_token_id", len(tokens), where)
    return TextBPE(bpe, bos, eos, spec,
                   add_bos=_gguf_flag(reader, "add_bos_token", pre in GGUF_BOS_PRE, where),
                   add_eos=_gguf_flag(reader, "add_eos_token", False, where))


def load_gguf_tokenizer(path):
    """The tokenizer stored in the metadata of the GGUF file at ``path`` (None if it has none)."""
    from pathlib import Path

    if not isinstance(path, str) or not Path(path).is_file():
        raise MinillamaError(f"GGUF tokenizer file not found: {str(path)[:200]}")
    reader = gguf_reader(Path(path))
    vocab = gguf_meta(reader, "tokenizer.ggml.tokens")
    return tokenizer_from_gguf(reader, len(vocab) if isinstance(vocab, list) else 0, path)
