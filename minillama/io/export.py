"""A checkpoint (the project's own ``.safetensors``, or anything
:func:`~minillama.io.load.load_params` reads) written as a Hugging Face folder, a llama2.c ``.bin``
or a GGUF file. Each writer refuses, with one line, what its format cannot hold. The
``minillama export`` command (:mod:`minillama.cli.convert`) calls :func:`export`."""

from __future__ import annotations

from pathlib import Path

from minillama.core.errors import MinillamaError
from minillama.core.quant import dequantize_params
from minillama.io.gguf import save_gguf
from minillama.io.load import load_params, save_hf, save_llama2c

FORMATS = ("hf", "llama2c", "gguf")


def export(checkpoint, out, fmt: str, gguf_type: str = "F32") -> Path:
    """Load ``checkpoint`` and write it to ``out`` in ``fmt`` (``hf``, ``llama2c`` or ``gguf``).
    Returns the written path."""
    if fmt not in FORMATS:
        raise MinillamaError(f"unknown export format {fmt!r} (formats: {', '.join(FORMATS)})")
    _, cfg, params, tok = load_params(checkpoint)
    params = dequantize_params(params)  # the writers take float weights
    if fmt == "hf":
        return save_hf(out, cfg, params, tokenizer=tok)
    if fmt == "llama2c":
        return save_llama2c(out, cfg, params)
    return save_gguf(out, cfg, params, tokenizer=tok, matrix_type=gguf_type)
