"""Tokenizers. Every tokenizer has ``encode(text, bos=..., eos=...) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``bos_id``, ``eos_id`` and ``spec()`` (a JSON-able dict
stored in checkpoints so :func:`tokenizer_from_spec` can rebuild it)."""

from __future__ import annotations

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


def tokenizer_from_spec(spec: dict[str, Any] | None):
    """Rebuild the tokenizer a checkpoint names (``{"type": "byte"}``, ...)."""
    if not spec:
        return None
    kind = spec.get("type")
    if kind == "byte":
        return ByteTokenizer()
    raise MinillamaError(f"unknown tokenizer type {kind!r} in checkpoint")
