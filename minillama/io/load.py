"""Checkpoint formats: one entry point, :func:`load_model`, that recognises what a path holds.

* a directory with ``config.json`` and ``model.safetensors`` (or a sharded index): Hugging Face
  LLaMA (:mod:`.hf`); its ``tokenizer.json`` is loaded when present;
* a ``.safetensors`` file with minillama metadata: the project's own format
  (:func:`minillama.io.checkpoint.load_checkpoint`), tokenizer rebuilt from its spec;
* a file starting with the llama2.c magic ``ak42`` or a plausible legacy header: llama2.c
  ``.bin`` version 1 or 0 (:mod:`.llama2c`); no tokenizer inside.

Nothing is unpickled anywhere.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from minillama.backends import resolve_name
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.io.checkpoint import CKPT_NAME, load_checkpoint
from minillama.io.gguf import is_gguf, load_gguf
from minillama.io.hf import is_hf_dir, load_hf, save_hf
from minillama.io.llama2c import is_llama2c, load_llama2c, save_llama2c
from minillama.io.peft import apply_adapter
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_from_spec
from minillama.model.transformer import Transformer

__all__ = ["detect_format", "load_model", "load_params", "save_llama2c", "save_hf",
           "load_llama2c", "load_hf"]


def _is_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and n < (1 << 32)


def resolve_checkpoint(path) -> Path:
    """``path``, or the checkpoint inside it when it is a folder that ``minillama train --out``
    wrote (``ckpt.safetensors``, no ``config.json``): a run folder is accepted wherever a
    checkpoint is."""
    p = Path(path)
    if p.is_dir() and not is_hf_dir(p) and (p / CKPT_NAME).is_file():
        return p / CKPT_NAME
    return p


def detect_format(path) -> str:
    """``"hf"``, ``"minillama"``, ``"gguf"`` or ``"llama2c"`` for ``path`` (a training run's
    folder counts as its checkpoint); anything else raises."""
    p = resolve_checkpoint(path)
    if p.is_dir():
        if is_hf_dir(p):
            return "hf"
        raise MinillamaError(f"{p} is a folder without config.json (not a Hugging Face model) "
                             f"nor a training run's ckpt.safetensors")
    if not p.exists():
        raise MinillamaError(f"checkpoint not found: {p}")
    if not p.is_file():  # a device or a FIFO: reading it could block forever
        raise MinillamaError(f"{p} is not a regular file")
    if _is_safetensors(p):
        return "minillama"
    if is_gguf(p):
        return "gguf"
    if is_llama2c(p):
        return "llama2c"
    raise MinillamaError(f"{p} is not a recognised checkpoint (llama2.c .bin, minillama "
                         f".safetensors, GGUF or Hugging Face folder)")


def load_params(path):
    """``(format, cfg, host params, tokenizer or None)`` of the checkpoint at ``path``."""
    path = resolve_checkpoint(path)
    fmt = detect_format(path)
    tok = None
    if fmt == "hf":
        cfg, params = load_hf(path)
        tj = Path(path) / "tokenizer.json"
        if tj.is_file():
            tok = HFTokenizer(tj)
            if tok.is_byte_tokenizer() and not tok.chat_template:
                tok = ByteTokenizer()  # minillama's byte tokenizer, as an export writes it
    elif fmt == "gguf":
        cfg, params, tok = load_gguf(path)
    elif fmt == "minillama":
        cfg, params, meta = load_checkpoint(path)
        tok = tokenizer_from_spec(meta.get("tokenizer"))
    else:
        cfg, params = load_llama2c(path)
    check_tokenizer(tok, cfg.vocab_size, path)
    return fmt, cfg, params, tok


def check_tokenizer(tok, vocab_size: int, where="") -> None:
    """A tokenizer fits a model when every id it makes (BOS/EOS included) indexes the model's
    vocabulary and every id the model samples decodes: V_tok = V, except that a Hugging Face
    model may pad its vocabulary beyond its tokenizer.json's (V_tok <= V; such ids decode to
    nothing)."""
    if tok is None:
        return
    at = f" of {where}" if str(where) else ""
    n = tok.vocab_size
    if n > vocab_size or (n != vocab_size and not isinstance(tok, HFTokenizer)):
        raise MinillamaError(f"tokenizer vocabulary ({n} tokens) does not match the model "
                             f"vocabulary ({vocab_size}){at}")
    for name in ("bos_id", "eos_id"):
        i = getattr(tok, name, None)
        if i is not None and not 0 <= i < vocab_size:
            raise MinillamaError(f"tokenizer {name} {i} lies outside the model vocabulary "
                                 f"({vocab_size}){at}")


def load_model(path, backend=None, dtype=None):
    """Load any supported checkpoint as a :class:`~minillama.model.transformer.Transformer` on
    ``backend`` (compute ``dtype``, default float32). Returns ``(model, tokenizer or None)``."""
    fmt, cfg, params, tok = load_params(path)
    if backend is None or isinstance(backend, str):  # None/"auto": by the model's size and type
        quantized = any(isinstance(v, QuantMatrix) for v in params.values())
        backend = resolve_name(backend, cfg, quantized=quantized)
    model = Transformer(cfg, params, backend=backend, dtype=np.dtype(dtype or np.float32))
    model.source_format = fmt
    return model, tok


#: where the default model ships (own format, byte tokenizer in the metadata)
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "weights" / "shakespeare.safetensors"


def resolve_tokenizer(spec: str | None, model_tokenizer, cfg, checkpoint: Path, fmt: str):
    """The tokenizer to use: ``--tokenizer``, else the checkpoint's own, else (llama2.c) a
    ``tokenizer.bin`` beside the checkpoint whose vocabulary fits; may be None."""
    if spec:
        tok = load_tokenizer(spec)
    elif model_tokenizer is not None:
        tok = model_tokenizer
    else:
        tok = None
        side = checkpoint.parent / "tokenizer.bin" if fmt == "llama2c" else None
        if side is not None and side.is_file():
            cand = load_tokenizer(str(side))
            if cand.vocab_size == cfg.vocab_size:
                tok = cand
    check_tokenizer(tok, cfg.vocab_size)
    return tok


def open_model(checkpoint, backend=None, dtype=None, adapter=None, tokenizer: str | None = None):
    """(model, tokenizer or None, format) of a checkpoint on ``backend`` in ``dtype``, with the
    LoRA ``adapter`` folder merged in (if given) and the tokenizer of
    :func:`resolve_tokenizer` for the spec ``tokenizer``."""
    checkpoint = Path(checkpoint)
    fmt = detect_format(checkpoint)
    model, model_tok = load_model(checkpoint, backend=backend, dtype=dtype)
    if adapter:
        apply_adapter(model, adapter)
    return model, resolve_tokenizer(tokenizer, model_tok, model.cfg, checkpoint, fmt), fmt
