"""``minillama export``: write a checkpoint (the project's own ``.safetensors``, or anything
:func:`~minillama.io.load.load_params` reads) as a Hugging Face folder, a llama2.c ``.bin`` or a
GGUF file. Each writer refuses, with one line, what its format cannot hold."""

from __future__ import annotations

from pathlib import Path

from minillama.core.errors import MinillamaError

FORMATS = ("hf", "llama2c", "gguf")


def export(checkpoint, out, fmt: str, gguf_type: str = "F32") -> Path:
    """Load ``checkpoint`` and write it to ``out`` in ``fmt`` (``hf``, ``llama2c`` or ``gguf``).
    Returns the written path."""
    from minillama.io.load import load_params, save_hf, save_llama2c
    from minillama.core.quant import dequantize_params

    if fmt not in FORMATS:
        raise MinillamaError(f"unknown export format {fmt!r} (formats: {', '.join(FORMATS)})")
    _, cfg, params, tok = load_params(checkpoint)
    params = dequantize_params(params)  # the writers take float weights
    if fmt == "hf":
        return save_hf(out, cfg, params, tokenizer=tok)
    if fmt == "llama2c":
        return save_llama2c(out, cfg, params)
    from minillama.io.gguf import save_gguf

    return save_gguf(out, cfg, params, tokenizer=tok, matrix_type=gguf_type)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint as hf, llama2c or gguf",
                              description=__doc__)
    p.add_argument("checkpoint", help="a minillama .safetensors, HF folder, GGUF or llama2.c file")
    p.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    p.add_argument("--out", required=True, help="output folder (hf) or file (llama2c, gguf)")
    p.add_argument("--gguf-type", default="F32", choices=("F32", "F16"),
                   help="GGUF matrix type (default F32)")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    path = export(args.checkpoint, args.out, args.format, args.gguf_type)
    print(f"wrote {args.format} to {path}")
    return 0
