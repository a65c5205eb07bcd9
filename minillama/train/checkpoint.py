"""Reading and writing a training checkpoint (``ckpt.safetensors`` in ``--out``): the
parameters, the AdamW moments as extra tensors ``optim.m.<name>`` / ``optim.v.<name>`` and the
metadata entry ``train_state`` (step, optimizer step count, data RNG state, loss history,
counters, the train config); and :func:`export_model`, the weights-only file for shipping.

The functions take the :class:`~minillama.train.trainer.Trainer` whose state they write or restore;
restoring puts back every bit that decides the next steps, so a resumed run matches an
uninterrupted one exactly on the same backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import check_finite, load_checkpoint, save_checkpoint
from minillama.io.tokenizer import ByteTokenizer


def training_state(trainer) -> dict[str, Any]:
    """The training state stored in the checkpoint's metadata (``train_state``)."""
    return {"step": trainer.step, "optim_step": trainer.opt.t, "data": trainer.data.state(),
            "history": trainer.history, "tokens_seen": trainer.tokens_seen,
            "train_seconds": trainer.train_seconds, "config": trainer.tc.to_dict(),
            "world_size": trainer.comm.size}


def optimizer_tensors(model, opt) -> dict[str, Any]:
    """The AdamW moments as extra checkpoint tensors ``optim.m.<name>`` / ``optim.v.<name>``."""
    extra = {}
    for k in model.params:
        extra[f"optim.m.{k}"] = opt.m[k]
        extra[f"optim.v.{k}"] = opt.v[k]
    return extra


def write_training_checkpoint(trainer, path: Path) -> Path:
    """Write ``trainer``'s parameters, moments and state to ``path`` (atomically)."""
    save_checkpoint(path, trainer.cfg, trainer.model.params, tokenizer=ByteTokenizer(),
                    extra_tensors=optimizer_tensors(trainer.model, trainer.opt),
                    extra_metadata={"train_state": training_state(trainer)})
    return path


def restore_training_checkpoint(trainer, path: Path) -> None:
    """Restore ``trainer``'s weights, optimizer moments, data position and history from
    ``path``; nothing is changed when the file is missing, of another model or corrupt."""
    cfg, params, meta = read_training_checkpoint(path)
    check_same_model(trainer.cfg, cfg)
    try:
        load_optimizer(trainer.opt, meta["train_state"], meta.get("tensors", {}), path)
        load_progress(trainer, meta["train_state"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        if isinstance(e, MinillamaError):
            raise
        raise MinillamaError(f"corrupt training state in {path}: {type(e).__name__} "
                             f"{str(e)[:80]}") from None
    load_params(trainer.model, params)


def read_training_checkpoint(path: Path):
    """(config, params, metadata) of a training checkpoint (one with ``train_state``)."""
    if not path.is_file():
        raise MinillamaError(f"--resume: no checkpoint at {path}")
    cfg, params, meta = load_checkpoint(path, with_extras=True)
    if not isinstance(meta.get("train_state"), dict):
        raise MinillamaError(f"{path} is a model file without training state; cannot resume")
    return cfg, params, meta


def check_same_model(want: ModelConfig, cfg: ModelConfig) -> None:
    """The checkpoint's model shape ``cfg`` must be the one this run's config asks for."""
    mine, theirs = want.to_dict(), cfg.to_dict()
    diff = [k for k in mine if mine[k] != theirs.get(k)]
    if diff:
        k = diff[0]
        raise MinillamaError(f"--resume: the checkpoint's model has {k}={theirs.get(k)!r}, "
                             f"the config asks for {mine[k]!r}")


def load_params(model, params: dict[str, Any]) -> None:
    be = model.backend
    for k in model.params:
        model.params[k][...] = be.asarray(params[k], dtype=model.dtype)


def load_optimizer(opt, st: dict[str, Any], tensors: dict[str, Any], path="") -> None:
    check_finite(tensors, path, limit=None)  # the moments: NaN/inf only (v may be large)
    for k, v in tensors.items():
        if k.startswith("optim.v.") and v.size and float(v.min()) < 0:
            raise MinillamaError(f"corrupt optimizer state in {path}: {k} holds negative "
                                 f"values (a second moment is a mean of squares)")
    opt.load_state_dict({
        "step": st["optim_step"],
        "m": {k[len("optim.m."):]: v for k, v in tensors.items() if k.startswith("optim.m.")},
        "v": {k[len("optim.v."):]: v for k, v in tensors.items() if k.startswith("optim.v.")}})


def load_progress(trainer, st: dict[str, Any]) -> None:
    """Step, data position, loss history and counters."""
    trainer.data.set_state(st["data"])
    trainer.step = int(st["step"])
    trainer.history = {"train": [list(x) for x in st["history"]["train"]],
                       "val": [list(x) for x in st["history"]["val"]]}
    trainer.tokens_seen = int(st.get("tokens_seen", 0))
    trainer.train_seconds = float(st.get("train_seconds", 0.0))


def export_model(src, dst, dtype: str = "float16") -> Path:
    """Write the weights of checkpoint ``src`` (no optimizer state) to ``dst`` in ``dtype``.

    The training summary stays in the metadata (``train_summary``) so the file records how it
    was made. float16 halves the size; loading converts back to the compute dtype."""
    cfg, params, meta = load_checkpoint(src)
    if dtype not in ("float16", "float32"):
        raise MinillamaError(f"export dtype must be float16 or float32, got {dtype!r}")
    if dtype == "float16":
        big = [k for k, v in params.items() if np.abs(v).max() > 65504]
        if big:
            raise MinillamaError(f"parameter {big[0]} exceeds the float16 range; export float32")
    st = meta.get("train_state") or {}
    summary = {k: st.get(k) for k in ("step", "tokens_seen", "train_seconds")}
    summary["config"] = st.get("config")
    val = (st.get("history") or {}).get("val") or []
    summary["val_loss"] = val[-1][1] if val else None
    extra = {"train_summary": summary}
    if "eval" in meta:
        extra["eval"] = meta["eval"]
    return save_checkpoint(dst, cfg, params, tokenizer=ByteTokenizer(), dtype=np.dtype(dtype),
                           extra_metadata=extra)
