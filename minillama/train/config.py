"""Every setting of a training run, written once: :class:`TrainConfig`'s fields carry their
help text (field metadata), and ``minillama train``'s flags are built from them
(:func:`add_flags`): ``--name-with-dashes`` for each field, its type from the annotation, its
default from the field.

Settings come from the defaults < a ``--config`` file (TOML or JSON, :func:`read_config_file`)
< the flags. Fields marked ``model`` are the model's shape and variants, copied into its
:class:`~minillama.core.config.ModelConfig` (:meth:`TrainConfig.model_config`) and checked against a
checkpoint on ``--resume``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minillama.backends import backend_help, check_precision, resolve_name
from minillama.core.config import COMPUTE_DTYPES, DTYPE_HELP, ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.tokenizer import ByteTokenizer


def setting(default, help: str, *, model: bool = False, variant: bool = False,
            metavar: str | None = None):
    """A :class:`TrainConfig` field: its default and its ``--help`` line; ``model``: a field of
    the :class:`~minillama.core.config.ModelConfig` of the same name, ``variant``: one of the
    architecture variants of docs/MATH.md part II (printed when a run uses them)."""
    return field(default=default, metadata={"help": help, "model": model or variant,
                                            "variant": variant, "metavar": metavar})


@dataclass
class TrainConfig:
    """Every setting of a training run (CLI flags, a TOML/JSON file, or both; flags win)."""

    # model (the defaults are LLaMA's choices; the variants are docs/MATH.md part II)
    dim: int = setting(192, "model width D", model=True)
    n_layers: int = setting(4, "number of blocks L", model=True)
    n_heads: int = setting(6, "query heads H", model=True)
    n_kv_heads: int = setting(2, "key/value heads KVH (GQA when < H)", model=True)
    hidden_dim: int | None = setting(None, "SwiGLU hidden size F (default: LLaMA's rule, 8/3 D "
                                           "rounded up to --multiple-of)", model=True)
    multiple_of: int = setting(32, "round F up to a multiple of this", model=True)
    tie_embeddings: bool = setting(True, "share the embedding and the output head (true/false)",
                                   model=True)
    rope_theta: float = setting(10000.0, "RoPE base frequency theta", model=True)
    norm_eps: float = setting(1e-5, "epsilon of the norms", model=True)
    norm: str = setting("rmsnorm", "rmsnorm (LLaMA) or layernorm", variant=True)
    norm_position: str = setting("pre", "pre (LLaMA: x + F(Norm(x))) or post (Norm(x + F(x)))",
                                 variant=True)
    pos_encoding: str = setting("rope", "rope (LLaMA), sinusoidal (added to the embeddings) or "
                                        "none", variant=True)
    ffn: str = setting("swiglu", "swiglu (LLaMA), or the two-matrix gelu / relu (default width "
                                 "3/2 F)", variant=True)
    logit_scale: float = setting(1.0, "multiply the logits by this (1/sqrt(dim) keeps their "
                                      "spread flat in the width); 1 = off", variant=True)
    init_from: str | None = setting(None, "start from this checkpoint's weights when OUT has no "
                                          "checkpoint; its model shape and variants become the "
                                          "defaults", metavar="CHECKPOINT")
    # data
    data: str = setting("shakespeare", "'shakespeare' (the corpus shipped with the package), a "
                                       "text file, or a prepared data folder", metavar="PATH")
    context: int = setting(128, "training context T (also the model's max_seq_len)")
    batch_size: int = setting(16, "windows per micro-batch B")
    grad_accum: int = setting(1, "micro-batches per optimisation step")
    # optimisation
    steps: int = setting(2000, "optimisation steps (the cosine schedule spans them)")
    lr: float = setting(2e-3, "peak learning rate")
    min_lr: float = setting(2e-4, "final learning rate of the cosine decay")
    warmup: int | None = setting(None, "linear warmup steps (default: min(100, steps // 10), so "
                                       "a short run still reaches the peak --lr)")
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    eps: float = setting(1e-8, "AdamW epsilon")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0: off)")
    decay_embeddings: bool = setting(True, "weight-decay the embedding too (true/false)")
    # evaluation / bookkeeping
    eval_interval: int = setting(200, "steps between validation losses")
    eval_iters: int = setting(10, "validation batches per evaluation")
    ckpt_interval: int | None = setting(None, "steps between checkpoints (default: "
                                              "--eval-interval)")
    backend: str | None = setting(None, backend_help("train"))
    dtype: str = setting(COMPUTE_DTYPES[0], DTYPE_HELP)
    precision: str = setting("fp32", "matrix products: fp32, or on --backend cupy tf32 (TF32 "
                                     "tensor cores) or bf16 (bfloat16 operands); float32 "
                                     "accumulation and master weights")
    recompute: bool = setting(False, "gradient checkpointing: keep only each block's input in "
                                     "the forward and recompute the block in the backward (the "
                                     "same gradients, less activation memory; --recompute alone "
                                     "means true)")
    seed: int = setting(0, "seed of the initial weights and of the batch sampler")
    out: str = setting("runs/default", "output folder (checkpoint, loss plot, prepared data)",
                       metavar="DIR")
    time_limit: float | None = setting(None, "minutes; save a checkpoint and stop when reached "
                                             "(default: no limit)")
    plot: bool = setting(True, "redraw OUT/loss.png at every checkpoint (true/false)")

    @property
    def warmup_steps(self) -> int:
        """``warmup``, or when unset min(100, steps // 10): warmup scaled to a short run."""
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    # --- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise a one-line :class:`MinillamaError` for the first bad setting: numbers in their
        ranges, the choices and paths, then the sizes this trainer holds."""
        self._check_numbers()
        self._check_choices()
        self._check_sizes()

    def _check_numbers(self) -> None:
        """Counts are positive integers, rates and factors finite numbers in their ranges."""
        def pos_int(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
                what = "a non-negative" if allow_zero else "a positive"
                raise MinillamaError(f"train config: {name} must be {what} integer, got {v!r}")

        def num(name: str, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < lo or v > hi or (lo_open and v == lo):
                raise MinillamaError(f"train config: {name} must be a number in "
                                     f"{'(' if lo_open else '['}{lo}, {hi}], got {v!r}")

        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "context",
                     "batch_size", "grad_accum", "steps", "eval_interval", "eval_iters"):
            pos_int(name)
        pos_int("seed", allow_zero=True)
        if self.warmup is not None:
            pos_int("warmup", allow_zero=True)
        if self.hidden_dim is not None:
            pos_int("hidden_dim")
        if self.ckpt_interval is not None:
            pos_int("ckpt_interval")
        num("lr", lo_open=True)
        num("min_lr")
        if self.min_lr > self.lr:
            raise MinillamaError(f"train config: min_lr ({self.min_lr}) > lr ({self.lr})")
        num("weight_decay")
        num("beta1", 0.0, 0.999999)
        num("beta2", 0.0, 0.999999)
        num("eps", lo_open=True)
        num("grad_clip")
        num("rope_theta", lo_open=True)
        num("norm_eps", lo_open=True)
        if self.time_limit is not None:
            num("time_limit", lo_open=True)

    def _check_choices(self) -> None:
        """Switches are booleans; dtype, data, init_from, out, backend and precision are ones
        this trainer knows (an unknown backend name, or $MINILLAMA_BACKEND, fails here)."""
        for name in ("tie_embeddings", "decay_embeddings", "plot"):
            if not isinstance(getattr(self, name), bool):
                raise MinillamaError(f"train config: {name} must be true or false")
        if self.dtype not in COMPUTE_DTYPES:
            raise MinillamaError(f"train config: dtype must be {' or '.join(COMPUTE_DTYPES)}, "
                                 f"got {self.dtype!r}")
        if not isinstance(self.data, str) or not self.data:
            raise MinillamaError("train config: data must be a path or 'shakespeare'")
        if self.init_from is not None and (not isinstance(self.init_from, str)
                                           or not self.init_from):
            raise MinillamaError("train config: init_from must be a checkpoint path")
        if not isinstance(self.out, str) or not self.out:
            raise MinillamaError("train config: out must be a folder path")
        if self.backend is not None and not isinstance(self.backend, str):
            raise MinillamaError(f"train config: backend must be a name, got {self.backend!r}")
        backend = resolve_name(self.backend)  # an unknown name (or $MINILLAMA_BACKEND) fails now
        try:
            check_precision(self.precision, backend, self.dtype)
        except MinillamaError as e:
            raise MinillamaError(f"train config: {e}") from None

    def _check_sizes(self) -> None:
        """Batches, validation tokens and the model fit what this trainer holds; the model's
        shape invariants (dim % n_heads, ...) hold."""
        for name, limit in (("batch_size", 1 << 16), ("grad_accum", 1 << 16),
                            ("eval_iters", 1 << 16), ("steps", 1 << 40)):
            if getattr(self, name) > limit:
                raise MinillamaError(f"train config: {name} must be <= {limit}, got "
                                     f"{getattr(self, name)}")
        if self.batch_size * self.context > 1 << 24:
            raise MinillamaError(f"train config: batch_size * context = "
                                 f"{self.batch_size * self.context} tokens per micro-batch is "
                                 f"more than {1 << 24}")
        if self.batch_size * self.context * self.eval_iters > 1 << 26:
            raise MinillamaError(f"train config: batch_size * context * eval_iters = "
                                 f"{self.batch_size * self.context * self.eval_iters} validation "
                                 f"tokens is more than {1 << 26}")
        n = self.model_config().n_params()  # the model-shape invariants (dim % n_heads, ...)
        if n > 1 << 31:
            raise MinillamaError(f"train config: a model of {n:,} parameters is more than this "
                                 f"trainer holds ({1 << 31:,}: weights, gradients and AdamW "
                                 f"moments in host or device memory)")


    def model_config(self) -> ModelConfig:
        """The model these settings train (byte vocabulary, context = ``max_seq_len``)."""
        return ModelConfig(vocab_size=ByteTokenizer.vocab_size, max_seq_len=self.context,
                           **{k: getattr(self, k) for k in MODEL_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
        """``base`` (default: the defaults) updated with ``d``; unknown keys are an error."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise MinillamaError(f"train config: unknown field(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(known)}")
        cfg = dataclasses.replace(base) if base is not None else cls()
        for k, v in d.items():
            if isinstance(v, int) and not isinstance(v, bool) and k in _FLOAT_FIELDS:
                v = float(v)
            setattr(cfg, k, v)
        return cfg


#: the fields copied into the ModelConfig (shape and variants), and the variants alone
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["model"])
VARIANT_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["variant"])


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _flag_type(f: dataclasses.Field):
    """The argparse type of a field, from its annotation (``int | None`` -> int)."""
    base = str(f.type).replace(" | None", "")
    return {"int": int, "float": float, "bool": _bool, "str": str}[base]


_FLOAT_FIELDS = {f.name for f in dataclasses.fields(TrainConfig) if _flag_type(f) is float}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`TrainConfig` field. Flags default to None (unset: the file's or the
    checkpoint's setting, else the field's default), so the help names the field's default."""
    group = parser.add_argument_group("training settings (also the keys of a --config file)")
    for f in dataclasses.fields(TrainConfig):
        hlp = f.metadata["help"]
        typ = _flag_type(f)
        if f.default is not None and "default" not in hlp:
            shown = str(f.default).lower() if typ is _bool else f.default
            hlp += f" (default: {shown})"
        metavar = f.metadata["metavar"] or {int: "N", float: "X", _bool: "BOOL"}.get(typ, "NAME")
        extra = {"nargs": "?", "const": True} if typ is _bool else {}  # --flag alone: true
        group.add_argument(flag_name(f.name), type=typ, default=None, metavar=metavar,
                           help=hlp.replace("%", "%%"), **extra)


def flag_overrides(args) -> dict[str, Any]:
    """The settings given as flags (those not None)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def read_config_file(path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of :class:`TrainConfig` fields (a ``[train]`` table or top
    level)."""
    path = Path(path)
    if not path.is_file():
        raise MinillamaError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MinillamaError(f"config file {path} is not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from None
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            d = tomllib.loads(text)
        else:
            d = json.loads(text)
    except (ValueError, RecursionError) as e:  # tomllib.TOMLDecodeError, JSONDecodeError
        raise MinillamaError(f"cannot parse config file {path}: {str(e).splitlines()[0]}") \
            from None
    if not isinstance(d, dict):
        raise MinillamaError(f"config file {path} must hold a table/object of settings")
    if "train" in d and isinstance(d["train"], dict) and len(d) == 1:
        d = d["train"]
    return d



def grad_accum_for(saved_world: int, saved_accum: int, batch_size: int, world_size: int) -> int:
    """The ``grad_accum`` with which ``world_size`` ranks continue a run written by
    ``saved_world`` ranks with ``saved_accum``: the same N x A micro-batches per step, so the
    resumed run draws and averages the same global batches as the original one."""
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
        raise MinillamaError(f"--resume: bad world_size {saved_world!r} in the checkpoint")
    micro = saved_world * saved_accum
    if micro % world_size:
        raise MinillamaError(
            f"--resume: the checkpoint's steps are {micro} micro-batches of {batch_size} windows "
            f"({saved_world} rank(s) x --grad-accum {saved_accum}), which {world_size} ranks "
            f"cannot share evenly: launch a rank count that divides {micro}, or pass --grad-accum "
            f"to choose a new global batch")
    return micro // world_size
