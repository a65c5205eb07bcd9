#!/usr/bin/env python
r"""What a quantization costs: perplexity and bits per byte of one checkpoint written as each
GGUF type, side by side with llama.cpp's ``llama-perplexity`` on the same files when it is built.

For each type the checkpoint is quantized as ``minillama quantize --type T`` does and written to
a GGUF file (its size is reported); the model is evaluated with the weights that file holds
(decoded by minillama's loader when it reads the type, else by the ``gguf`` package) by
:func:`minillama.infer.perplexity.perplexity`, llama.cpp's chunked method.

llama.cpp needs a vocabulary in the file. The byte tokenizer of the shipped model has no GGUF
form, so for llama-perplexity only the script writes a copy of each file whose metadata spells
the byte tokenizer as a SentencePiece vocabulary of byte tokens (``<0xXX>``, and ``\u2581`` for
the space, which llama.cpp's SentencePiece tokenizer writes for it); the tensors are the same.

    python -m scripts.quant_perplexity [--checkpoint minillama/weights/shakespeare.safetensors]
        [--data shakespeare-val] [--types F32,Q8_0,Q6_K,Q4_K,Q4_0] [--limit-chunks N]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.core.quantize import quantize_params
from minillama.infer.perplexity import SHAKESPEARE_VAL, default_bos, perplexity, read_text
from minillama.io.gguf import save_gguf
from minillama.io.load import DEFAULT_CHECKPOINT, load_params
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import Transformer


def decode(params):
    """The float weights of ``params`` (QuantMatrix values decoded)."""
    from minillama.core import quant

    out = {}
    for k, v in params.items():
        if isinstance(v, QuantMatrix):
            if hasattr(quant, "dequantize"):
                out[k] = np.asarray(quant.dequantize(v), np.float32)
            else:
                import gguf

                out[k] = gguf.quants.dequantize(v.data, gguf.GGMLQuantizationType[v.qtype]) \
                    .reshape(v.shape)
        else:
            out[k] = np.asarray(v, np.float32)
    return out


def llama_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/tmp/llamacpp/*/vendor/llama.cpp/build/bin/{name}"))
    return hits[-1] if hits else None


def with_byte_vocab(src: Path, dst: Path) -> None:
    """A copy of ``src`` whose metadata adds the byte tokenizer as a SentencePiece vocabulary
    llama.cpp reads (ids 0-255 the bytes, 256 BOS, 257 EOS)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "minillama.")):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    tokens = [("\u2581" if b == 32 else f"<0x{b:02X}>") for b in range(256)] + ["<s>", "</s>"]
    kinds = [1 if b == 32 else 6 for b in range(256)] + [3, 3]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(kinds)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_perplexity(tool: str, model: Path, text_file: Path, ctx: int, chunks) -> float | None:
    cmd = [tool, "-m", str(model), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx),
           "-t", "2"] + (["--chunks", str(chunks)] if chunks else [])
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(tool).parent))
    for _ in range(3):  # a run that dies (another process's signal) is tried again
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
        if m:
            return float(m.group(1))
        print(f"llama-perplexity exited {run.returncode} on {model.name}: "
              f"{(run.stderr or run.stdout)[-200:]}", file=sys.stderr)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--data", default=SHAKESPEARE_VAL)
    ap.add_argument("--types", default="F32,Q8_0,Q6_K,Q4_K,Q4_0")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--limit-chunks", type=int, default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--no-llama", action="store_true", help="skip llama-perplexity")
    args = ap.parse_args(argv)
    try:
        _, cfg, params, tok = load_params(args.checkpoint)
        tok = tok or ByteTokenizer()
        text = read_text(args.data)
        bos = tok.bos_id if default_bos(tok) else None
        ids = tok.encode(text, bos=bos is not None)
        ctx = args.ctx or min(512, cfg.max_seq_len)
        tool = None if args.no_llama else llama_tool("llama-perplexity")
        work = Path(tempfile.mkdtemp(prefix="qppl-"))
        text_file = work / "data.txt"
        text_file.write_text(text, encoding="utf-8")
        n_weights = sum(int(np.prod(a.shape)) for a in params.values())
        rows = []
        for qtype in args.types.split(","):
            q, types, _ = quantize_params(cfg, params, qtype)
            path = save_gguf(work / f"{qtype}.gguf", cfg, q, tokenizer=tok, types=types)
            model = Transformer(cfg, decode(q), backend=args.backend, dtype=np.float32)
            r = perplexity(model, ids, ctx, bos, args.limit_chunks, tok=tok)
            theirs = None
            if tool:
                target = path
                if isinstance(tok, ByteTokenizer):
                    target = work / f"{qtype}.llama.gguf"
                    with_byte_vocab(path, target)
                theirs = llama_perplexity(tool, target, text_file, ctx, args.limit_chunks)
            bpw = 8 * path.stat().st_size / n_weights
            rows.append((qtype, path.stat().st_size, bpw, r, theirs))
            print(f"{qtype}: ppl {r.ppl:.4f} bpb {r.bits_per_byte:.4f} llama {theirs}",
                  file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    except MinillamaError as e:
        print(f"quant_perplexity: error: {e}", file=sys.stderr)
        return 2
    base = rows[0][3].ppl
    r0 = rows[0][3]
    print(f"checkpoint {args.checkpoint}, data {args.data}, {r0.tokens_scored} tokens scored "
          f"in {r0.chunks} chunks of {r0.n_ctx}, BOS {'yes' if r0.bos else 'no'}, "
          f"{datetime.date.today().isoformat()}")
    print("| type | file MiB | bits/weight | perplexity | vs first | bits/byte "
          "| llama-perplexity |")
    print("|---|---|---|---|---|---|---|")
    for qtype, size, bpw, r, theirs in rows:
        print(f"| {qtype} | {size / 2**20:.2f} | {bpw:.2f} | {r.ppl:.4f} | "
              f"{100 * (r.ppl / base - 1):+.2f}% | {r.bits_per_byte:.4f} | "
              f"{'n/a' if theirs is None else f'{theirs:.4f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
