"""``minillama perplexity``: llama.cpp's perplexity and the bits per byte of a checkpoint on a
text, computed by :func:`minillama.infer.perplexity.perplexity`, printed as text or one JSON
line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from minillama.cli.common import add_backend_flag, add_model_flags, positive_int
from minillama.core.errors import MinillamaError
from minillama.infer.perplexity import SHAKESPEARE_VAL, default_bos, perplexity, read_text
from minillama.io.load import DEFAULT_CHECKPOINT, detect_format, load_model, resolve_tokenizer
from minillama.io.tokenizer import TOKENIZER_KINDS


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "perplexity", help="perplexity and bits per byte of a checkpoint on a text file",
        description="llama.cpp's perplexity (non-overlapping windows of --ctx tokens, the "
                    "second half of each scored) of any checkpoint minillama loads, quantized "
                    "GGUF files included. Prints perplexity, bits per byte, tokens scored, time.")
    add_model_flags(p)
    p.add_argument("--data", required=True,
                   help=f"UTF-8 text file, or {SHAKESPEARE_VAL} (the shipped model's held-out "
                        f"plays)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="tokens per chunk (default: 512, or the model's context if shorter)")
    p.add_argument("--limit-chunks", type=positive_int, default=None, metavar="N",
                   help="score only the first N chunks")
    p.add_argument("--batch-size", type=positive_int, default=4,
                   help="chunks between two progress lines (each chunk is its own forward, "
                        "so the result does not depend on it)")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="replace each chunk's first token by BOS (auto: as the tokenizer's "
                        "model does)")
    add_backend_flag(p, cache=False)  # a forward per chunk, no KV cache
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=run_perplexity)


def _progress(done: int, total: int, ppl: float) -> None:
    print(f"\r[{done}/{total}] perplexity {ppl:.4f}", end="", file=sys.stderr, flush=True)


def run_perplexity(args) -> int:
    checkpoint = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    fmt = detect_format(checkpoint)
    text = read_text(args.data)
    model, model_tok = load_model(checkpoint, backend=args.backend)
    tok = resolve_tokenizer(args.tokenizer, model_tok, model.cfg, checkpoint, fmt)
    if tok is None:
        raise MinillamaError(f"{checkpoint} has no tokenizer; pass --tokenizer ({TOKENIZER_KINDS})")
    bos = default_bos(tok) if args.bos == "auto" else args.bos == "yes"
    if bos and tok.bos_id is None:
        raise MinillamaError("the tokenizer has no BOS token; pass --bos no")
    tokens = np.asarray(tok.encode(text, bos=bos), dtype=np.int64)
    # without --ctx: 512 (llama-perplexity's usual), or what the model or a short text allows
    n_ctx = args.ctx or max(4, min(512, model.cfg.max_seq_len, len(tokens) // 2 * 2))

    r = perplexity(model, tokens, n_ctx, tok.bos_id if bos else None, args.limit_chunks,
                   args.batch_size, tok, progress=None if args.json else _progress)
    if not args.json:
        print(file=sys.stderr)
    fields = {"checkpoint": str(checkpoint), "data": args.data, "ppl": round(r.ppl, 4),
              "bits_per_byte": round(r.bits_per_byte, 4), "nll": round(r.nll, 5),
              "tokens_scored": r.tokens_scored, "bytes_scored": r.bytes_scored,
              "chunks": r.chunks, "ctx": r.n_ctx, "bos": r.bos, "seconds": round(r.seconds, 1)}
    if args.json:
        print(json.dumps(fields))
    else:
        print(f"perplexity {r.ppl:.4f}  bits/byte {r.bits_per_byte:.4f}  "
              f"({r.tokens_scored} tokens scored in {r.chunks} chunks of {r.n_ctx}, "
              f"BOS {'yes' if r.bos else 'no'}, {r.seconds:.1f} s)")
    return 0
