#!/usr/bin/env python
r"""Validation loss of a model on the held-out Shakespeare plays, and a sample.

The validation split (minillama.io.data.VAL_PLAYS: Macbeth, Twelfth Night, Julius Caesar, never seen
in training) is cut into non-overlapping windows of the model's context T; the loss is the mean
next-byte cross-entropy over every position of every window,

    L = -\frac{1}{N} \sum_{i} \ln p(x_{i+1} | x_{\le i}),    bits per byte = L / \ln 2,

the same per-position average as the training loop's validation loss (positions early in a
window see less context than a sliding window would give them).

    python -m scripts.eval_shakespeare [--checkpoint minillama/weights/shakespeare.safetensors]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.infer.generate import generate
from minillama.io.data import TokenData, prepare_shakespeare
from minillama.io.load import DEFAULT_CHECKPOINT, load_model
from minillama.io.tokenizer import ByteTokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--data", default=None, help="prepared data folder (default: prepare a "
                                                  "temporary one)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--sample-tokens", type=int, default=255)
    ap.add_argument("--prompt", default="")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        model, _ = load_model(args.checkpoint, backend=args.backend, dtype=np.float32)
        folder = args.data or prepare_shakespeare(tempfile.mkdtemp(prefix="shk-"))
        data = TokenData(folder, model.cfg.max_seq_len, vocab_size=model.cfg.vocab_size)
        t0 = time.perf_counter()
        total, count = 0.0, 0
        for x, y in data.val_full_batches(args.batch_size):
            total += model.loss(x, y) * x.size
            count += x.size
        nats = total / count
        secs = time.perf_counter() - t0
        tok = ByteTokenizer()
        ids = generate(model, tok.encode(args.prompt, bos=True), args.sample_tokens,
                       temperature=args.temperature, top_p=0.9, seed=args.seed,
                       stop_ids=[tok.eos_id])
    except MinillamaError as e:
        print(f"eval_shakespeare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"checkpoint": args.checkpoint, "val_tokens": count,
                      "val_nats_per_byte": round(nats, 4),
                      "val_bits_per_byte": round(nats / math.log(2), 4),
                      "eval_seconds": round(secs, 1)}))
    print(f"--- sample (temperature {args.temperature}, top-p 0.9, seed {args.seed}) ---")
    print(args.prompt + tok.decode(ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
