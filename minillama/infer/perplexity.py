r"""Perplexity of a model on a text, by llama.cpp's method (``llama-perplexity``), so that a
quantized file and its float original can be compared, here and against llama.cpp.

The text is tokenized once (with a leading BOS when the tokenizer's model starts sequences with
one) and cut into C non-overlapping chunks of n_ctx tokens (the tail that does not fill a chunk
is dropped); with BOS, the first token of each chunk is also replaced by BOS. Each chunk is run
from an empty context and only its second half is scored, so that every scored token sees at
least n_ctx/2 tokens of context: positions j = n_ctx/2 .. n_ctx - 2 predict tokens j + 1, giving
N = C (n_ctx - 1 - n_ctx/2) scored tokens and

    NLL = -\frac{1}{N} \sum_{c, j} \ln p(x_{c, j+1} | x_{c, \le j}),    PPL = e^{NLL},

    bits per byte = N NLL / (\ln 2 \cdot bytes of the scored tokens),

the bytes being those of each scored token decoded alone (for the byte tokenizer, one per
token: bits per byte = NLL / ln 2).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError

#: ``--data`` name of the shipped model's held-out text (minillama.io.data.VAL_PLAYS, in order)
SHAKESPEARE_VAL = "shakespeare-val"


@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean nats per scored token
    bits_per_byte: float
    tokens_scored: int
    bytes_scored: int
    chunks: int
    n_ctx: int
    bos: bool
    seconds: float


def default_bos(tok) -> bool:
    """Whether the tokenizer's model starts a sequence with BOS: the byte tokenizer (the
    project's models are trained on [BOS] + bytes) and SentencePiece tokenizers do; a Hugging
    Face tokenizer does when its own encoding with special tokens starts with BOS; a byte-level
    BPE from a GGUF file does not (pass --bos to say otherwise)."""
    from minillama.io.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer

    if isinstance(tok, (ByteTokenizer, Llama2cTokenizer)):
        return True
    if isinstance(tok, HFTokenizer) and tok.bos_id is not None:
        ids = tok._guard("encode", lambda: tok._tok.encode("a", add_special_tokens=True).ids)
        return bool(ids) and ids[0] == tok.bos_id
    return False


def token_bytes(tok, ids: np.ndarray) -> int:
    """The number of bytes of ``ids``, each token decoded alone."""
    counts = {}
    total = 0
    for i in ids.tolist():
        if i not in counts:
            if hasattr(tok, "decode_bytes"):
                counts[i] = len(tok.decode_bytes([i]))
            else:
                counts[i] = len(tok.decode([i]).encode("utf-8"))
        total += counts[i]
    return total


def perplexity(model, tokens, n_ctx: int, bos_id: int | None = None,
               max_chunks: int | None = None, batch_size: int = 4, tok=None,
               progress=None) -> Perplexity:
    """llama.cpp's perplexity of ``model`` on the token ids ``tokens`` (see the module doc:
    the text's ids, after a BOS when the model uses one); ``bos_id`` replaces the first token
    of each chunk when given; bytes are counted with
    ``tok`` (one byte per token without one)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if n_ctx < 4 or n_ctx % 2:
        raise MinillamaError(f"--ctx must be an even number >= 4, got {n_ctx}")
    if n_ctx > model.cfg.max_seq_len:
        raise MinillamaError(f"--ctx {n_ctx} exceeds the model's context of "
                             f"{model.cfg.max_seq_len}")
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise MinillamaError(f"the text has {len(tokens)} tokens, fewer than one chunk of "
                             f"--ctx {n_ctx}")
    first = n_ctx // 2
    be = model.backend
    t0 = time.perf_counter()
    nll_sum, scored = 0.0, 0
    targets_all = []
    for c0 in range(0, n_chunks, batch_size):
        c1 = min(c0 + batch_size, n_chunks)
        x = tokens[c0 * n_ctx:c1 * n_ctx].reshape(c1 - c0, n_ctx).copy()
        targets = x[:, first + 1:].copy()  # what positions first .. n_ctx-2 predict
        if bos_id is not None:
            x[:, 0] = bos_id
        logits = np.asarray(be.to_numpy(model.forward(x)), dtype=np.float64)[:, first:-1]
        top = logits.max(axis=-1, keepdims=True)
        logz = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
        picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        nll_sum += float((logz - picked).sum())
        scored += targets.size
        targets_all.append(targets.reshape(-1))
        if progress is not None:
            progress(c1, n_chunks, math.exp(nll_sum / scored))
    secs = time.perf_counter() - t0
    nll = nll_sum / scored
    n_bytes = token_bytes(tok, np.concatenate(targets_all)) if tok is not None else scored
    bpb = nll_sum / (math.log(2) * n_bytes) if n_bytes else float("nan")
    return Perplexity(ppl=math.exp(nll), nll=nll, bits_per_byte=bpb, tokens_scored=scored,
                      bytes_scored=n_bytes, chunks=n_chunks, n_ctx=n_ctx,
                      bos=bos_id is not None, seconds=secs)


def read_text(spec: str) -> str:
    """The text of ``--data``: a UTF-8 file, or ``shakespeare-val`` (the held-out plays of the
    shipped model, joined by newlines)."""
    if spec == SHAKESPEARE_VAL:
        from minillama.io.data import VAL_PLAYS, shakespeare_documents

        docs = dict(shakespeare_documents())
        return "\n".join(docs[name] for name in VAL_PLAYS if name in docs)
    p = Path(spec)
    if not p.is_file():
        raise MinillamaError(f"text file not found: {spec}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MinillamaError(f"{spec} is not UTF-8 text (byte {e.start})") from None


# ---------------------------------------------------------------------------------------------
# the `minillama perplexity` command
# ---------------------------------------------------------------------------------------------
def add_cli(subparsers) -> None:
    from minillama.cli.common import positive_int
    from minillama.cli.common import backend_help

    p = subparsers.add_parser(
        "perplexity", help="perplexity and bits per byte of a checkpoint on a text file",
        description="llama.cpp's perplexity (non-overlapping windows of --ctx tokens, the "
                    "second half of each scored) of any checkpoint minillama loads, quantized "
                    "GGUF files included. Prints perplexity, bits per byte, tokens scored, time.")
    p.add_argument("--checkpoint", "-c", default=None,
                   help="model file or folder (default: the shipped model)")
    p.add_argument("--data", required=True,
                   help=f"UTF-8 text file, or {SHAKESPEARE_VAL} (the shipped model's held-out "
                        f"plays)")
    p.add_argument("--tokenizer", "-t", default=None,
                   help="tokenizer: tokenizer.bin, tokenizer.json, or 'byte' (default: the "
                        "checkpoint's own)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="tokens per chunk (default: 512, or the model's context if shorter)")
    p.add_argument("--limit-chunks", type=positive_int, default=None, metavar="N",
                   help="score only the first N chunks")
    p.add_argument("--batch-size", type=positive_int, default=4, help="chunks per forward")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="replace each chunk's first token by BOS (auto: as the tokenizer's "
                        "model does)")
    p.add_argument("--backend", default=None, help=backend_help())
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=run_perplexity)


def run_perplexity(args) -> int:
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from minillama.io.load import detect_format, load_model
    from minillama.io.load import DEFAULT_CHECKPOINT, resolve_tokenizer

    checkpoint = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    fmt = detect_format(checkpoint)
    text = read_text(args.data)
    model, model_tok = load_model(checkpoint, backend=args.backend)
    tok = resolve_tokenizer(args.tokenizer, model_tok, model.cfg, checkpoint, fmt)
    if tok is None:
        raise MinillamaError(f"{checkpoint} has no tokenizer; pass --tokenizer (tokenizer.bin, "
                             f"tokenizer.json or byte)")
    bos = default_bos(tok) if args.bos == "auto" else args.bos == "yes"
    if bos and tok.bos_id is None:
        raise MinillamaError("the tokenizer has no BOS token; pass --bos no")
    n_ctx = args.ctx or min(512, model.cfg.max_seq_len)
    tokens = np.asarray(tok.encode(text, bos=bos), dtype=np.int64)

    def progress(done, total, ppl):
        print(f"\r[{done}/{total}] perplexity {ppl:.4f}", end="", file=sys.stderr, flush=True)

    r = perplexity(model, tokens, n_ctx, tok.bos_id if bos else None, args.limit_chunks,
                   args.batch_size, tok, progress=None if args.json else progress)
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
