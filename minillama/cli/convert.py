"""The file-conversion commands: ``minillama export`` (a checkpoint as a Hugging Face folder, a
llama2.c ``.bin`` or a GGUF file), ``minillama convert-gqa`` (key/value heads mean-pooled into
fewer groups) and ``minillama quantize`` (a GGUF file in llama.cpp's block types).

The work is done below: :func:`minillama.io.export.export`, :func:`minillama.model.gqa.convert_gqa`
and :func:`minillama.core.quantize.quantize_params`; here are the flags and what is printed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix, dequantize_params
from minillama.core.quantize import (
    FLOAT_TYPES,
    PRESETS,
    QUANTIZERS,
    quantize_params,
    supported_type,
)
from minillama.io.checkpoint import check_output_file, save_checkpoint
from minillama.io.export import FORMATS, export
from minillama.io.gguf import save_gguf
from minillama.io.load import load_params, resolve_tokenizer
from minillama.io.tokenizer import TOKENIZER_KINDS
from minillama.model.gqa import convert_gqa


def add_cli(subparsers) -> None:
    """Register ``export``, ``convert-gqa`` and ``quantize``."""
    _add_export(subparsers)
    _add_convert_gqa(subparsers)
    _add_quantize(subparsers)


# ---------------------------------------------------------------------------------------------
# the `minillama export` command
# ---------------------------------------------------------------------------------------------
EXPORT_DESCRIPTION = """``minillama export``: write a checkpoint (the project's own
``.safetensors``, or anything :func:`~minillama.io.load.load_params` reads) as a Hugging Face
folder, a llama2.c ``.bin`` or a GGUF file. Each writer refuses, with one line, what its format
cannot hold."""


def _add_export(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint as hf, llama2c or gguf",
                              description=EXPORT_DESCRIPTION)
    p.add_argument("checkpoint", help="a minillama .safetensors, HF folder, GGUF or llama2.c file")
    p.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    p.add_argument("--out", required=True, help="output folder (hf) or file (llama2c, gguf)")
    p.add_argument("--gguf-type", default="F32", choices=("F32", "F16"),
                   help="GGUF matrix type (default F32)")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    path = export(args.checkpoint, args.out, args.format, args.gguf_type)
    print(f"wrote {args.format} to {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# the `minillama convert-gqa` command
# ---------------------------------------------------------------------------------------------
def _add_convert_gqa(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-gqa", help="mean-pool a model's key/value heads into fewer groups (MHA -> GQA)",
        description="Convert a checkpoint (any supported format) to grouped-query attention with "
                    "G key/value heads by mean-pooling the wk/wv heads of each group of query "
                    "heads; writes the project's .safetensors format. Uptrain it with "
                    "`minillama train --init-from OUT`.")
    p.add_argument("input", metavar="IN", help="the checkpoint to convert")
    p.add_argument("output", metavar="OUT", help="the .safetensors file to write")
    p.add_argument("--n-kv-heads", type=int, required=True, metavar="G",
                   help="key/value heads of the result (must divide the query heads)")
    p.set_defaults(func=run_convert_gqa)


def run_convert_gqa(args) -> int:
    _, cfg, params, tok = load_params(args.input)
    params = dequantize_params(params)  # quantized GGUF matrices: converted as float32
    new_cfg, new_params = convert_gqa(cfg, params, args.n_kv_heads)
    path = save_checkpoint(args.output, new_cfg, new_params, tokenizer=tok)
    print(f"wrote {path}: {cfg.n_heads} query heads, KV heads {cfg.n_kv_heads} -> "
          f"{new_cfg.n_kv_heads}, {cfg.n_params():,} -> {new_cfg.n_params():,} parameters",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# the `minillama quantize` command
# ---------------------------------------------------------------------------------------------
def _add_quantize(subparsers) -> None:
    types = ", ".join([*QUANTIZERS, *PRESETS, *FLOAT_TYPES])
    p = subparsers.add_parser(
        "quantize", help="write a quantized GGUF file (llama.cpp's block types)",
        description="Quantize any checkpoint minillama loads (the shipped model, a minillama "
                    ".safetensors, a Hugging Face folder, a GGUF file) into a GGUF file that "
                    "llama.cpp and transformers read. Norms stay F32; the output head takes "
                    "Q6_K (or the base type if it has 6 bits or more) unless --output-type "
                    "says otherwise. The file carries the checkpoint's tokenizer (or "
                    "--tokenizer's); one that cannot be carried is refused. "
                    f"Types: {types}. See docs/QUANTIZATION.md.")
    p.add_argument("input", help="checkpoint file or folder")
    p.add_argument("output", help="GGUF file to write (atomically)")
    p.add_argument("--type", required=True, dest="qtype", metavar="TYPE",
                   help=f"matrix type or preset ({types})")
    p.add_argument("--output-type", default=None, metavar="TYPE",
                   help="type of the output head (default: Q6_K, or the base type if higher)")
    p.add_argument("--embedding-type", default=None, metavar="TYPE",
                   help="type of the token embeddings when not tied (default: the base type)")
    p.add_argument("--tokenizer", "-t", default=None,
                   help=f"the tokenizer the file carries: {TOKENIZER_KINDS} (default: the "
                        f"checkpoint's own)")
    p.set_defaults(func=run_quantize)


def run_quantize(args) -> int:
    qtype = args.qtype.upper()
    supported_type(qtype, presets=True)
    out_type = supported_type(args.output_type.upper()) if args.output_type else None
    emb_type = supported_type(args.embedding_type.upper()) if args.embedding_type else None
    out = check_output_file(Path(args.output), "GGUF file")
    if Path(args.input).resolve() == out.resolve():
        raise MinillamaError("the output file is the input checkpoint; choose another path")
    t0 = time.perf_counter()
    fmt, cfg, params, tok = load_params(args.input)
    tok = resolve_tokenizer(args.tokenizer, tok, cfg, Path(args.input), fmt)
    if tok is None:
        raise MinillamaError(f"{args.input} has no tokenizer and a GGUF file without one cannot "
                             f"take a text prompt; pass --tokenizer ({TOKENIZER_KINDS})")
    before = sum(int(np.prod(a.shape)) * 4 for a in params.values())
    qparams, types, notes = quantize_params(cfg, params, qtype, out_type, emb_type)
    notes_tok: list[str] = []
    partial = out.with_name(out.name + ".partial")  # an existing file stays until this is whole
    save_gguf(partial, cfg, qparams, tokenizer=tok, types=types, notes=notes_tok)
    if not notes_tok:
        os.replace(partial, out)
    else:  # the tokenizer could not be carried: no file without it, the old one kept
        partial.unlink()
        raise MinillamaError(f"{notes_tok[0]}; nothing written (pass --tokenizer with one "
                             f"GGUF holds: {TOKENIZER_KINDS})")
    secs = time.perf_counter() - t0
    counts: dict[str, int] = {}
    for name, a in qparams.items():
        kind = a.qtype if isinstance(a, QuantMatrix) else types.get(name, "F32")
        counts[kind] = counts.get(kind, 0) + 1
    n_weights = sum(int(np.prod(a.shape)) for a in params.values())
    size = out.stat().st_size
    for note in notes:
        print(f"minillama: note: {note}", file=sys.stderr)
    print(f"wrote {out}: {size / 2**20:.2f} MiB ({8 * size / n_weights:.2f} bits per weight; "
          f"float32 {before / 2**20:.2f} MiB), tensors "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f", {secs:.1f} s")
    return 0
