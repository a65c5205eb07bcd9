"""The ``minillama finetune`` and ``minillama merge`` commands: the flags and settings of a
fine-tuning run (LoRA adapters or every weight), the run's summary line, and merging a PEFT
adapter into its base model as a Hugging Face folder. The run itself is
:class:`minillama.train.finetune.Finetuner`; the adapter files are :mod:`minillama.io.peft`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from minillama.cli.common import (
    add_backend_flag,
    add_max_memory_flag,
    add_model_flags,
    positive_int,
)
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import atomic_write, check_output_dir
from minillama.io.hf import HF_TOKENIZER_FILES, gguf_tokenizer_files, is_hf_dir
from minillama.io.load import load_params, save_hf
from minillama.io.peft import load_peft
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer
from minillama.model.transformer import Transformer
from minillama.train.finetune import SETTINGS, Finetuner, saved_settings, settle_memory
from minillama.train.memplan import parse_size


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="LoRA or full fine-tuning of a checkpoint (text, prompt/completion, chat)",
        description="Fine-tune a checkpoint with its own tokenizer: LoRA adapters (written as "
                    "PEFT writes them) or every weight (--full).")
    add_model_flags(p, tokenizer=False,
                    checkpoint_help="the base model (HF folder, minillama, GGUF...)")
    p.add_argument("--data", help="training data: .jsonl records or a plain text file")
    p.add_argument("--out", required=True, help="output folder (checkpoint, adapter)")
    p.add_argument("--val-data", help="held-out data (default: --val-fraction of --data)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of --data held out for evaluation when there is no --val-data")
    p.add_argument("--full", action="store_true", help="train every weight instead of adapters")
    p.add_argument("--lora-rank", type=positive_int, default=8, help="adapter rank r")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="adapter scale alpha (s = alpha / r)")
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down",
                   help="comma-separated among q,k,v,o,gate,up,down (or all)")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input while training")
    p.add_argument("--rslora", action="store_true", help="scale alpha / sqrt(r) (rsLoRA)")
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=4, help="examples per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches summed per optimizer step")
    p.add_argument("--context", type=positive_int, default=None,
                   help="longest example in tokens (default: min(512, the model's))")
    p.add_argument("--lr", type=float, default=None, help="peak lr (2e-4 LoRA, 2e-5 full)")
    p.add_argument("--min-lr", type=float, default=None, help="final lr (default lr / 10)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the gradient norm to this (0: off)")
    p.add_argument("--eval-interval", type=positive_int, default=50,
                   help="steps between held-out evaluations")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and dropout")
    add_backend_flag(p, task="train")
    p.add_argument("--skip-bad", action="store_true", help="skip bad records (with a warning)")
    _add_memory_flags(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--stop-at", type=positive_int, default=None,
                   help="stop (with a checkpoint) after this step; the schedule spans --steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_cli)

    m = subparsers.add_parser(
        "merge", help="merge a LoRA adapter into its base model (writes a HF folder)",
        description="Write BASE with ADAPTER merged (W + s B A) as a Hugging Face llama folder "
                    "with the base's tokenizer and chat template (a Hugging Face base's files "
                    "copied, a GGUF base's byte-level BPE or the byte tokenizer written as "
                    "tokenizer.json), so generate, chat, serve and quantize take the folder as "
                    "it is.")
    m.add_argument("base", help="the base checkpoint the adapter was trained on")
    m.add_argument("adapter", help="the adapter folder (adapter_config.json + "
                                   "adapter_model.safetensors)")
    m.add_argument("--out", required=True, help="output folder")
    m.set_defaults(func=run_merge)


def _add_memory_flags(p) -> None:
    """--pack, --recompute and --max-memory (the memory a step takes)."""
    p.add_argument("--pack", action="store_true",
                   help="pack several examples per --context tokens (each attends only within "
                        "itself, positions restart per example) instead of padding each")
    p.add_argument("--recompute", action="store_true",
                   help="gradient checkpointing: keep only each block's input in the forward, "
                        "recompute the block in the backward (same gradients, less memory)")
    add_max_memory_flag(p)


def run_merge(args) -> int:
    """``minillama merge BASE ADAPTER --out DIR``: the merged weights and the base's tokenizer."""
    fmt, cfg, params, tok = load_params(args.base)
    files = _tokenizer_files(args.base, fmt, tok)
    out = check_output_dir(args.out, "output folder (--out)")
    model = Transformer(cfg, params, backend="reference", dtype=np.float32)
    lora = load_peft(model, args.adapter)
    save_hf(out, cfg, lora.merged(model.params),  # float32: a quantized base is dequantized
            tokenizer=tok if isinstance(tok, ByteTokenizer) else None)
    for name, data in files.items():
        atomic_write(out / name, lambda t, data=data: Path(t).write_bytes(data))
    if files:
        _check_carried(out, tok)
    print(f"wrote {out}: {args.base} with {args.adapter} merged "
          f"({len(lora.targets)} linears, rank {lora.lc.rank})", file=sys.stderr)
    return 0


def _tokenizer_files(base, fmt: str, tok) -> dict[str, bytes]:
    """The tokenizer files a merged folder takes from ``base`` (the byte tokenizer is written by
    ``save_hf``); a tokenizer that cannot be carried is refused before anything is written."""
    if tok is None or isinstance(tok, ByteTokenizer):
        return {}
    if is_hf_dir(base):
        return {name: (Path(base) / name).read_bytes() for name in HF_TOKENIZER_FILES
                if (Path(base) / name).is_file()}
    if fmt == "gguf":
        files = gguf_tokenizer_files(base, tok)
        if files is not None:
            return files
    raise MinillamaError(f"{base}: its {type(tok).__name__} cannot be written to a Hugging Face "
                         f"folder (a byte-level BPE or the byte tokenizer can); merge a base in "
                         f"another format")


def _check_carried(out: Path, tok) -> None:
    """The merged folder's tokenizer encodes, ends turns and renders chats as the base's."""
    got = HFTokenizer(out)
    text = "Merged: the cat sat on the mat, été 2024!\n  <|im_end|>"
    if got.encode(text) != tok.encode(text) or got.chat_template != tok.chat_template \
            or set(got.stop_ids) != set(getattr(tok, "stop_ids", set()) or got.stop_ids):
        raise MinillamaError(f"the tokenizer written to {out} does not encode as the base's")


def settings_from_args(args) -> dict[str, Any]:
    """The run's settings (:data:`~minillama.train.finetune.SETTINGS`) from the flags, checked;
    on ``--resume`` those saved with the run in ``--out``."""
    if args.resume:
        return saved_settings(args.out)
    if not args.checkpoint or not args.data:
        raise MinillamaError("finetune needs --checkpoint and --data (or --resume)")
    s = {k: getattr(args, k) for k in SETTINGS}
    if s["lr"] is None:
        s["lr"] = 2e-5 if s["full"] else 2e-4
    if s["min_lr"] is None:
        s["min_lr"] = s["lr"] / 10
    if not (s["lr"] > 0 and 0 <= s["min_lr"] <= s["lr"]):
        raise MinillamaError(f"--lr must be > 0 and --min-lr in [0, lr]; got {s['lr']}, "
                             f"{s['min_lr']}")
    if not 0 <= s["val_fraction"] < 1:
        raise MinillamaError(f"--val-fraction must lie in [0, 1), got {s['val_fraction']}")
    if s["warmup"] < 0 or s["weight_decay"] < 0 or s["grad_clip"] < 0:
        raise MinillamaError("--warmup, --weight-decay and --grad-clip must be >= 0")
    s["checkpoint"] = str(Path(s["checkpoint"]).resolve())
    return s


def run_cli(args) -> int:
    """``minillama finetune``: plan the memory, train (or resume), print the summary line."""
    def say(m):
        print(m, file=sys.stderr)

    check_output_dir(args.out, "output folder (--out)")
    max_memory = parse_size(args.max_memory) if args.max_memory is not None else None
    s = settings_from_args(args)
    if args.resume:
        if args.pack and not s.get("pack"):
            raise MinillamaError(f"--pack: the run in {args.out} pads its batches; packing "
                                 f"cannot start on a resume (it changes the data order)")
        s["recompute"] = bool(args.recompute)  # the same gradients either way
    ft = Finetuner(s, args.out, progress=not args.no_progress, say=say)
    n = sum(int(v.size) for v in ft.trainable.values())
    say(f"fine-tuning {s['checkpoint']}: {'every weight' if s['full'] else 'LoRA'} "
        f"({n:,} trainable parameters); {len(ft.train_ex)} train / {len(ft.val_ex)} held-out "
        f"examples; backend {ft.model.backend.name}"
        f"{'; packed' if s.get('pack') else ''}{'; recomputing blocks' if s['recompute'] else ''}")
    settle_memory(ft, max_memory, say)
    if args.resume:
        ft.resume()
        say(f"resumed at step {ft.step}")
    summary = ft.train(stop_at=args.stop_at)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v)
                      for k, v in summary.items()}))
    return 0
