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

The ``minillama perplexity`` command is :mod:`minillama.cli.perplexity`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.io.data import VAL_PLAYS, shakespeare_documents
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer

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
    ``tok`` (one byte per token without one). Each chunk is its own forward, so the result
    does not depend on ``batch_size`` (the chunks between two ``progress`` calls) nor on what a
    backend's products do with more rows."""
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
                             f"--ctx {n_ctx}; give a longer text or a --ctx of at most "
                             f"{len(tokens) // 2 * 2}")
    first = n_ctx // 2
    be = model.backend
    t0 = time.perf_counter()
    nll_sum, scored = 0.0, 0
    targets_all = []
    for c in range(n_chunks):  # one chunk per forward: its logits do not depend on the others
        x = tokens[c * n_ctx:(c + 1) * n_ctx].reshape(1, n_ctx).copy()
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
        if progress is not None and ((c + 1) % batch_size == 0 or c + 1 == n_chunks):
            progress(c + 1, n_chunks, math.exp(nll_sum / scored))
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
        docs = dict(shakespeare_documents())
        return "\n".join(docs[name] for name in VAL_PLAYS if name in docs)
    p = Path(spec)
    if not p.is_file():
        raise MinillamaError(f"text file not found: {spec}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MinillamaError(f"{spec} is not UTF-8 text (byte {e.start})") from None
