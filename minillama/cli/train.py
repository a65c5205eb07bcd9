"""The ``minillama train`` and ``minillama prepare-data`` commands: settings from the defaults,
a ``--config`` file and the flags (built from :class:`~minillama.train.config.TrainConfig`'s
fields), one process or one rank of ``mpiexec -n N minillama train``, the summary line and the
optional ``--export``. The training loop itself is :class:`minillama.train.trainer.Trainer`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minillama.backends import resolve_name
from minillama.cli.common import add_max_memory_flag
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import CKPT_NAME, check_output_dir, check_output_file, load_checkpoint
from minillama.io.data import prepare_shakespeare, prepare_text_file
from minillama.io.load import load_params
from minillama.io.tokenizer import ByteTokenizer
from minillama.train.checkpoint import export_model
from minillama.train.config import (
    MODEL_FIELDS,
    VARIANT_FIELDS,
    TrainConfig,
    add_flags,
    flag_overrides,
    grad_accum_for,
    read_config_file,
)
from minillama.train.distributed import (
    Communicator,
    NCCLComm,
    RanksFailed,
    blas_share,
    open_world,
    share_cores,
)
from minillama.train.memplan import parse_size, settle
from minillama.train.trainer import Trainer, TrainingDiverged


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from scratch (or --resume)",
        description="Train a LLaMA on byte-level text with the hand-written backward pass. "
                    "Settings: defaults < --config file (TOML/JSON) < flags.")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings (the keys "
                                                    "are the flags' names with underscores)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/ckpt.safetensors (its settings, unless overridden)")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="stop (with a checkpoint) after this step; the schedule still spans "
                        "--steps, so a later --resume continues the same run")
    p.add_argument("--export", metavar="PATH",
                   help="when done, also write a weights-only model file here")
    p.add_argument("--export-dtype", default="float16", choices=("float16", "float32"),
                   help="dtype of the --export file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_max_memory_flag(p)
    add_flags(p)
    p.set_defaults(func=run_train)

    q = subparsers.add_parser(
        "prepare-data", help="tokenize a corpus into uint16 token files",
        description="Write OUT/train.bin, OUT/val.bin and OUT/meta.json (byte tokens) from the "
                    "Shakespeare corpus (default) or a plain text file.")
    q.add_argument("--data", default="shakespeare", help="'shakespeare' or a text file")
    q.add_argument("--out", default="data/shakespeare", help="output folder")
    q.set_defaults(func=run_prepare)


def build_config(args, world_size: int = 1) -> TrainConfig:
    """defaults < (checkpoint's config on --resume) < --config file < flags.

    On ``--resume`` with another rank count than the checkpoint's, ``grad_accum`` becomes what
    keeps the global batch (unless the file or a flag sets it): see :func:`grad_accum_for`."""
    flags = flag_overrides(args)
    file_cfg = read_config_file(args.config) if getattr(args, "config", None) else {}
    base = TrainConfig()
    saved_world = None
    if getattr(args, "resume", False):
        out = flags.get("out", file_cfg.get("out", base.out))
        ckpt = Path(out) / CKPT_NAME
        if not ckpt.is_file():
            raise MinillamaError(f"--resume: no checkpoint at {ckpt}")
        _, _, meta = load_checkpoint(ckpt)
        st = meta.get("train_state") or {}
        saved = st.get("config")
        if not isinstance(saved, dict):
            raise MinillamaError(f"{ckpt} has no training state; cannot resume")
        base = TrainConfig.from_dict(saved)
        saved_world = st.get("world_size", 1)
    elif flags.get("init_from", file_cfg.get("init_from")):
        base = _model_defaults_from(flags.get("init_from", file_cfg.get("init_from")), base)
    settings = {**file_cfg, **flags}
    tc = TrainConfig.from_dict(settings, base=base)
    if saved_world is not None and "grad_accum" not in settings:
        tc.grad_accum = grad_accum_for(saved_world, base.grad_accum, base.batch_size, world_size)
    tc.validate()
    return tc


def _model_defaults_from(path, base: TrainConfig) -> TrainConfig:
    """``base`` with the model fields (shape and variants) of the checkpoint at ``path``."""
    _, cfg, _, _ = load_params(path)
    if cfg.vocab_size != ByteTokenizer.vocab_size:
        raise MinillamaError(f"--init-from: {path} has a vocabulary of {cfg.vocab_size}; training "
                             f"uses byte tokens ({ByteTokenizer.vocab_size})")
    theirs = cfg.to_dict()
    return TrainConfig.from_dict({k: theirs[k] for k in MODEL_FIELDS}, base=base)


def run_train(args) -> int:
    """``minillama train``: one process, or one rank of ``mpiexec -n N minillama train``."""
    world = open_world()
    with world.guard(collective_errors=(TrainingDiverged,)):
        return _train_command(args, world)


def _train_command(args, world: Communicator) -> int:
    say = _say if world.rank == 0 else _silent
    threads = share_cores(world.local_size) if world.size > 1 else None
    with blas_share(threads):
        return _train_ranks(args, world, say)


def _train_ranks(args, world: Communicator, say) -> int:
    tc = world.agree(lambda: build_config(args, world_size=world.size))
    backend = world.agree(lambda: resolve_name(tc.backend))
    world.agree_on("the training settings",
                   {**tc.to_dict(), "backend": backend, "resume": bool(args.resume),
                    "stop_at": args.stop_at, "export": args.export,
                    "export_dtype": args.export_dtype})
    if args.stop_at is not None and args.stop_at < 1:
        raise RanksFailed(f"--stop-at must be >= 1, got {args.stop_at}")
    world.agree(lambda: _check_outputs(tc, args), root_only=True)
    max_memory = world.agree(lambda: parse_size(args.max_memory)
                             if args.max_memory is not None else None)
    comm = NCCLComm(world) if world.size > 1 and backend == "cupy" else world
    trainer = Trainer(tc, progress=not args.no_progress, comm=comm)
    n = trainer.cfg.n_params()
    say(f"model: dim {tc.dim}, {tc.n_layers} layers, {tc.n_heads} heads / {tc.n_kv_heads} kv "
        f"heads, F {trainer.cfg.hidden_dim}, context {tc.context}: {n:,} parameters; "
        f"backend {trainer.model.backend.name}"
        f"{'' if tc.precision == 'fp32' else f', {tc.precision} matrix products'}")
    if not trainer.cfg.is_llama:
        say("variants: " + ", ".join(f"{k}={getattr(tc, k)}" for k in VARIANT_FIELDS))
    say(f"schedule: {tc.steps} steps, linear warmup over {tc.warmup_steps} to lr {tc.lr:g}, "
        f"cosine decay to {tc.min_lr:g}"
        f"{'' if tc.warmup is not None else ' (warmup: min(100, steps // 10); set --warmup)'}")
    say(f"data: {trainer.data.folder} ({trainer.data.train.size:,} train / "
        f"{trainer.data.val.size:,} val tokens)")
    p = world.agree(lambda: settle(trainer.model, trainer.model.params, tc.batch_size,
                                   tc.context, tc.grad_accum, tc.recompute, max_memory, say),
                    root_only=True)
    if p.recompute and not tc.recompute:  # turned on to fit --max-memory, on every rank
        tc.recompute = trainer.model.recompute = True
    if comm.size > 1:
        say(f"data parallel: {comm.size} ranks over {comm.name.upper()}, "
            f"{comm.size} x {tc.grad_accum} micro-batches of {tc.batch_size} windows per step")
    if args.resume:
        trainer.resume()
        say(f"resumed at step {trainer.step}")
        if trainer.step >= tc.steps:
            say(f"the run in {tc.out} is complete: step {trainer.step} of --steps {tc.steps}, "
                f"nothing to train; to extend it pass more steps, e.g. `minillama train --resume "
                f"--out {tc.out} --steps {2 * tc.steps}` (the cosine schedule then spans the new "
                f"total)")
    summary = trainer.train(stop_at=args.stop_at)
    if world.rank == 0:
        _print_line(json.dumps({k: (round(v, 5) if isinstance(v, float) else v)
                                for k, v in summary.items()}))
    if args.export:
        path = world.agree(lambda: export_model(trainer.ckpt_path, args.export,
                                                args.export_dtype), root_only=True)
        say(f"exported the model to {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


def _check_outputs(tc: TrainConfig, args) -> None:
    """Refuse unwritable outputs now, not after the training (rank 0 writes them)."""
    check_output_dir(tc.out, "output folder (--out)")
    if args.export:
        check_output_file(args.export, "--export file")


def _print_line(line: str) -> None:
    """``line`` and its newline to stdout in one write, flushed (before MPI_Finalize): under a
    launcher the ranks' stdout is merged, and with unbuffered stdout (``PYTHONUNBUFFERED``)
    ``print`` writes the text and the newline separately."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _silent(line: str) -> None:
    pass


def run_prepare(args) -> int:
    if args.data == "shakespeare":
        out = prepare_shakespeare(args.out)
    else:
        out = prepare_text_file(args.data, args.out)
    meta = json.loads((Path(out) / "meta.json").read_text())
    print(f"wrote {out}: {meta['train']['tokens']:,} train tokens, {meta['val']['tokens']:,} "
          f"val tokens (validation: {', '.join(meta['val']['documents'])})")
    return 0
