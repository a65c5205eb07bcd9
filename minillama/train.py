r"""``minillama train``: train a LLaMA from scratch with the hand-written backward pass.

One optimisation step with A micro-batches of B windows of T tokens:

.. math::

    g = \frac{1}{A} \sum_{a=1}^{A} \nabla_\theta L(x_a, y_a), \qquad
    g \leftarrow \mathrm{clip}(g, c), \qquad
    \theta \leftarrow \mathrm{AdamW}(\theta, g, \eta(s))

with the schedule \eta(s) of :func:`minillama.optim.lr_at` and global-norm clipping at c.

Outputs in ``--out`` (default ``runs/default``):

* ``ckpt.safetensors``: the training checkpoint in the project's format: the parameters, the
  AdamW moments as extra tensors ``optim.m.<name>`` / ``optim.v.<name>`` and the metadata entry
  ``train_state`` (step, optimizer step count, data RNG state, loss history, the train config).
  Written atomically, so an interruption keeps the previous one. ``--resume`` continues from it and
  reproduces an uninterrupted run bit for bit on the same backend;
* ``loss.png``: the training and validation loss curves;
* ``data/``: the prepared token files (unless ``--data`` names a prepared folder).

``--export PATH`` also writes a weights-only model file (float16 by default) for shipping.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backends import resolve_name
from .checkpoint import (CKPT_NAME, check_finite, check_output_dir, check_output_file,
                         load_checkpoint, save_checkpoint)
from .config import ModelConfig
from .data import TokenData, prepare_data, prepare_shakespeare, prepare_text_file
from .distributed import (Communicator, NCCLComm, RanksFailed, SingleProcess, blas_share,
                          open_world, share_cores)
from .errors import MinillamaError
from .model import Transformer
from .optim import AdamW, clip_grad_norm, lr_at
from .tokenizer import ByteTokenizer

PLOT_NAME = "loss.png"

#: fields of the model shape (checked against the checkpoint on --resume)
MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "multiple_of",
                "tie_embeddings", "rope_theta", "norm_eps", "norm", "norm_position",
                "pos_encoding", "ffn", "logit_scale")


@dataclass
class TrainConfig:
    """Every setting of a training run (CLI flags, a TOML/JSON file, or both; flags win)."""

    # model
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int = 2
    hidden_dim: int | None = None
    multiple_of: int = 32
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    norm: str = "rmsnorm"  # the variants of docs/MATH.md part II (defaults: LLaMA's)
    norm_position: str = "pre"
    pos_encoding: str = "rope"
    ffn: str = "swiglu"
    logit_scale: float = 1.0
    init_from: str | None = None  # start from these weights when out/ has no checkpoint
    # data
    data: str = "shakespeare"
    context: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    # optimisation
    steps: int = 2000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    decay_embeddings: bool = True
    # evaluation / bookkeeping
    eval_interval: int = 200
    eval_iters: int = 10
    ckpt_interval: int | None = None
    backend: str | None = None
    dtype: str = "float32"
    precision: str = "fp32"  # or tf32 / bf16 GPU matrix products (backends/cupy/mixed_precision.py)
    seed: int = 0
    out: str = "runs/default"
    time_limit: float | None = None  # minutes; save and stop cleanly when reached
    plot: bool = True  # redraw out/loss.png at every checkpoint

    # --- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
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
        for name in ("warmup", "seed"):
            pos_int(name, allow_zero=True)
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
        for name in ("tie_embeddings", "decay_embeddings", "plot"):
            if not isinstance(getattr(self, name), bool):
                raise MinillamaError(f"train config: {name} must be true or false")
        if self.dtype not in ("float32", "float64"):
            raise MinillamaError(f"train config: dtype must be float32 or float64, "
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
        from .backends.cupy.mixed_precision import check_precision  # noqa: PLC0415

        try:
            check_precision(self.precision, backend, self.dtype)
        except MinillamaError as e:
            raise MinillamaError(f"train config: {e}") from None
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
        return ModelConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, vocab_size=ByteTokenizer.vocab_size,
                           hidden_dim=self.hidden_dim, multiple_of=self.multiple_of,
                           norm_eps=self.norm_eps, rope_theta=self.rope_theta,
                           max_seq_len=self.context, tie_embeddings=self.tie_embeddings,
                           norm=self.norm, norm_position=self.norm_position,
                           pos_encoding=self.pos_encoding, ffn=self.ffn,
                           logit_scale=self.logit_scale)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: "TrainConfig | None" = None) -> "TrainConfig":
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


_FLOAT_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)
                 if f.type in ("float", "float | None")}


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
            import tomllib  # noqa: PLC0415

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


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class TrainingDiverged(MinillamaError):
    """The loss or the gradient norm became NaN/Inf."""


class Trainer:
    """Owns the model, the optimizer, the data and the history of one run.

    ``Trainer(tc)`` starts fresh; :meth:`resume` restores a checkpoint; :meth:`train` runs to
    ``tc.steps`` (or the time limit) and saves checkpoints every ``ckpt_interval`` steps.

    ``comm`` (a :class:`~minillama.distributed.Communicator`, default one process) makes it one
    rank of a data-parallel run: every rank builds the same model from the same seed, draws the
    same global batch of ``size x grad_accum`` micro-batches and trains on its own share, the
    gradients are summed over the ranks in one flat buffer, and only rank 0 evaluates, prints and
    writes checkpoints.
    """

    def __init__(self, tc: TrainConfig, data_dir=None, progress: bool = True,
                 comm: Communicator | None = None):
        tc.validate()
        self.tc = tc
        self.comm = comm if comm is not None else SingleProcess()
        self.is_root = self.comm.rank == 0
        self.out = self.comm.agree(lambda: check_output_dir(tc.out, "output folder (--out)"),
                                   root_only=True)
        self.cfg = tc.model_config()
        self.data = self._open_data(data_dir)
        self.comm.agree(self._check_share_of_data)
        self.model = self.comm.agree(self._build_model)
        self.opt = self._build_optimizer()
        self.step = 0
        self.history: dict[str, list] = {"train": [], "val": []}  # [step, loss] pairs
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.progress = progress and self.is_root
        self._val_cache = None
        self._flat = None  # (buffer, views): the gradients of a data-parallel step, flat
        self._deadline = None  # perf_counter() time of --time-limit while train() runs
        self._stop_voted = False  # some rank's time limit has passed (decided in the last step)
        self._check_weights_agree()

    # --- construction --------------------------------------------------------------------------
    def _open_data(self, data_dir) -> TokenData:
        """The token files: ``data_dir`` if given, else ``tc.data`` prepared under ``out/data``
        (by rank 0 alone; the others open what it wrote)."""
        if data_dir is not None:
            folder = Path(data_dir)
        else:
            folder = self.comm.agree(lambda: prepare_data(self.tc.data, self.out / "data"),
                                     root_only=True)
        return self.comm.agree(lambda: TokenData(folder, self.tc.context, seed=self.tc.seed,
                                                 vocab_size=self.cfg.vocab_size))

    def _check_share_of_data(self) -> None:
        """Several ranks need at least as many distinct training windows as one step uses."""
        N, A, B, T = self.comm.size, self.tc.grad_accum, self.tc.batch_size, self.tc.context
        windows = self.data.train.size - T
        if N > 1 and N * A * B > windows:
            raise MinillamaError(
                f"{N} ranks x --grad-accum {A} x --batch-size {B} = {N * A * B} windows per step, "
                f"but the training split has only {windows} windows of {T} + 1 tokens: launch "
                f"fewer ranks or use a smaller batch")

    def _build_model(self) -> Transformer:
        """A freshly initialised model (weights from ``tc.seed``), or, with ``tc.init_from`` and
        no checkpoint in ``out/`` yet, one that starts from that checkpoint's weights (its model
        must be the one this run asks for)."""
        params = None
        if self.tc.init_from and not (self.out / CKPT_NAME).is_file():
            from .formats import load_params  # noqa: PLC0415

            _, cfg, params, _ = load_params(self.tc.init_from)
            mine, theirs = self.cfg.to_dict(), cfg.to_dict()
            diff = [k for k in MODEL_FIELDS + ("vocab_size",) if mine[k] != theirs[k]]
            if diff:
                raise MinillamaError(f"--init-from: {self.tc.init_from} has {diff[0]}="
                                     f"{theirs[diff[0]]!r}, this run asks for {mine[diff[0]]!r}")
        from .backends import get_backend  # noqa: PLC0415
        from .backends.cupy.mixed_precision import with_precision  # noqa: PLC0415

        backend = with_precision(get_backend(self.tc.backend), self.tc.precision)
        return Transformer(self.cfg, params, backend=backend, dtype=np.dtype(self.tc.dtype),
                           seed=self.tc.seed)

    def _build_optimizer(self) -> AdamW:
        tc = self.tc
        return AdamW(self.model.params, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                     weight_decay=tc.weight_decay, decay_embeddings=tc.decay_embeddings,
                     backend=self.model.backend)

    @property
    def ckpt_path(self) -> Path:
        return self.out / CKPT_NAME

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimisation step: N ranks x A micro-batches of B windows of T tokens."""
        return self.comm.size * self.tc.grad_accum * self.tc.batch_size * self.tc.context

    def _check_weights_agree(self) -> None:
        """Every rank must hold bit-identical weights (same seed or checkpoint, same updates)."""
        if self.comm.size > 1:
            import hashlib  # noqa: PLC0415

            h = hashlib.sha1()
            for k in sorted(self.model.params):
                h.update(np.ascontiguousarray(self.model.backend.to_numpy(
                    self.model.params[k])).tobytes())
            self.comm.agree_on("the model weights (SHA-1 of every parameter)",
                               {"weights": h.hexdigest()})

    # --- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The training state stored in the checkpoint's metadata (``train_state``)."""
        return {"step": self.step, "optim_step": self.opt.t, "data": self.data.state(),
                "history": self.history, "tokens_seen": self.tokens_seen,
                "train_seconds": self.train_seconds, "config": self.tc.to_dict(),
                "world_size": self.comm.size}

    def _optimizer_tensors(self) -> dict[str, Any]:
        """The AdamW moments as extra checkpoint tensors ``optim.m.<name>`` / ``optim.v.<name>``."""
        extra = {}
        for k in self.model.params:
            extra[f"optim.m.{k}"] = self.opt.m[k]
            extra[f"optim.v.{k}"] = self.opt.v[k]
        return extra

    def save(self, path=None) -> Path:
        """Write the checkpoint (atomically), then redraw the loss plot (unless ``plot`` is off)."""
        path = Path(path) if path is not None else self.ckpt_path
        save_checkpoint(path, self.cfg, self.model.params, tokenizer=ByteTokenizer(),
                        extra_tensors=self._optimizer_tensors(),
                        extra_metadata={"train_state": self.state()})
        if self.tc.plot:
            self._draw_plot()
        return path

    def _draw_plot(self) -> None:
        """``out/loss.png``; a plotting failure is a warning, never a lost checkpoint."""
        try:
            plot_losses(self.history, self.out / PLOT_NAME,
                        title=f"{self.cfg.n_params() / 1e6:.2f}M params, step {self.step}")
        except Exception as e:
            print(f"minillama: warning: could not draw the loss plot: {e}", file=sys.stderr)

    def _save_on_root(self) -> None:
        """Rank 0 writes the checkpoint while the others wait to hear that it did."""
        self.comm.agree(self.save, root_only=True)
        self._check_weights_agree()

    def resume(self, path=None) -> None:
        """Restore weights, optimizer moments, data position and history from a checkpoint
        (every rank reads the same file)."""
        path = Path(path) if path is not None else self.ckpt_path

        def restore() -> None:
            cfg, params, meta = self._read_checkpoint(path)
            self._check_same_model(cfg)
            try:
                self._load_optimizer(meta["train_state"], meta.get("tensors", {}), path)
                self._load_progress(meta["train_state"])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                if isinstance(e, MinillamaError):
                    raise
                raise MinillamaError(f"corrupt training state in {path}: {type(e).__name__} "
                                     f"{str(e)[:80]}") from None
            self._load_params(params)

        self.comm.agree(restore)
        self._check_weights_agree()

    @staticmethod
    def _read_checkpoint(path: Path):
        """(config, params, metadata) of a training checkpoint (one with ``train_state``)."""
        if not path.is_file():
            raise MinillamaError(f"--resume: no checkpoint at {path}")
        cfg, params, meta = load_checkpoint(path, with_extras=True)
        if not isinstance(meta.get("train_state"), dict):
            raise MinillamaError(f"{path} is a model file without training state; cannot resume")
        return cfg, params, meta

    def _check_same_model(self, cfg: ModelConfig) -> None:
        """The checkpoint's model shape must be the one this run's config asks for."""
        mine, theirs = self.cfg.to_dict(), cfg.to_dict()
        diff = [k for k in mine if mine[k] != theirs.get(k)]
        if diff:
            k = diff[0]
            raise MinillamaError(f"--resume: the checkpoint's model has {k}={theirs.get(k)!r}, "
                                 f"the config asks for {mine[k]!r}")

    def _load_params(self, params: dict[str, Any]) -> None:
        be = self.model.backend
        for k in self.model.params:
            self.model.params[k][...] = be.asarray(params[k], dtype=self.model.dtype)

    def _load_optimizer(self, st: dict[str, Any], tensors: dict[str, Any], path="") -> None:
        check_finite(tensors, path, limit=None)  # the moments: NaN/inf only (v may be large)
        for k, v in tensors.items():
            if k.startswith("optim.v.") and v.size and float(v.min()) < 0:
                raise MinillamaError(f"corrupt optimizer state in {path}: {k} holds negative "
                                     f"values (a second moment is a mean of squares)")
        self.opt.load_state_dict({
            "step": st["optim_step"],
            "m": {k[len("optim.m."):]: v for k, v in tensors.items() if k.startswith("optim.m.")},
            "v": {k[len("optim.v."):]: v for k, v in tensors.items() if k.startswith("optim.v.")}})

    def _load_progress(self, st: dict[str, Any]) -> None:
        """Step, data position, loss history and counters."""
        self.data.set_state(st["data"])
        self.step = int(st["step"])
        self.history = {"train": [list(x) for x in st["history"]["train"]],
                        "val": [list(x) for x in st["history"]["val"]]}
        self.tokens_seen = int(st.get("tokens_seen", 0))
        self.train_seconds = float(st.get("train_seconds", 0.0))

    # --- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (eval_iters of them)."""
        if self._val_cache is None:
            self._val_cache = self.data.val_batches(self.tc.batch_size, self.tc.eval_iters)
        losses = [self.model.loss(x, y) for x, y in self._val_cache]
        return float(np.mean(losses))

    def evaluate_full(self, batch_size: int | None = None) -> float:
        """Token-weighted mean loss over the whole validation split (non-overlapping windows)."""
        total, count = 0.0, 0
        for x, y in self.data.val_full_batches(batch_size or self.tc.batch_size):
            total += self.model.loss(x, y) * x.size
            count += x.size
        return total / count

    # --- one optimisation step -----------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float]:
        """One optimisation step; returns (loss, grad norm before clipping, lr)."""
        lr = lr_at(self.step, self.tc.lr, self.tc.warmup, self.tc.steps, self.tc.min_lr)
        loss, grads = self._mean_loss_and_grads()
        self._check_finite("loss", loss)
        norm = clip_grad_norm(grads, self.tc.grad_clip)
        self._check_finite("gradient norm", norm)
        self.opt.step(grads, lr=lr)
        self._record_step(loss)
        return loss, norm, lr

    def _mean_loss_and_grads(self) -> tuple[float, dict[str, Any]]:
        r"""The loss and gradient averaged over the N x A micro-batches of the global batch
        (N ranks, A = ``grad_accum``): g = \frac{1}{N A} \sum_{r} \sum_{a} \nabla_\theta
        L(x_{rA+a}, y_{rA+a}). One process (N = 1) sums its A micro-batches; several sum theirs,
        then :meth:`_sum_over_ranks`."""
        loss_sum, grads = self._local_loss_and_grads()
        self._stop_voted = self._time_is_up()
        if self.comm.size > 1:
            loss_sum, grads = self._sum_over_ranks(loss_sum, grads)
        n = self.comm.size * self.tc.grad_accum
        if n > 1:
            for k in grads:
                grads[k] *= 1.0 / n
        return loss_sum / n, grads

    def _local_loss_and_grads(self) -> tuple[float, dict[str, Any]]:
        """This rank's share of the global batch: micro-batches rA .. rA + A - 1 of the N x A that
        every rank draws from the same sampler (so the data position stays the same everywhere);
        returns the sums of their losses and of their gradients."""
        A, r = self.tc.grad_accum, self.comm.rank
        loss_sum, grads = 0.0, None
        for j in range(self.comm.size * A):
            x, y = self.data.train_batch(self.tc.batch_size)
            if j // A != r:
                continue
            loss, g = self.model.loss_and_grads(x, y)
            loss_sum += loss
            if grads is None:
                grads = g
            else:
                for k in grads:
                    grads[k] += g[k]
        return loss_sum, grads

    def _flat_buffer(self):
        """(buf, views): one contiguous array (in the parameters' array module: host or device)
        holding every gradient followed by two slots, the loss sum and the time-limit vote;
        ``views[name]`` is the gradient's piece, shaped like the parameter."""
        if self._flat is None:
            params = self.model.params
            xp = self.model.backend.xp
            n = sum(int(p.size) for p in params.values())
            buf = xp.zeros(n + 2, dtype=self.model.dtype)
            views, off = {}, 0
            for k, p in params.items():
                views[k] = buf[off:off + p.size].reshape(p.shape)
                off += p.size
            self._flat = (buf, views)
        return self._flat

    def _sum_over_ranks(self, loss_sum: float, grads: dict[str, Any]):
        """Sum the gradients, the loss and the time-limit votes of every rank with one in-place
        all-reduce of the flat buffer (bucketed by the communicator); returns the summed loss and
        the summed gradients (views into the buffer)."""
        buf, views = self._flat_buffer()
        for k, v in views.items():
            v[...] = grads[k]
        buf[-2] = loss_sum
        buf[-1] = 1.0 if self._stop_voted else 0.0
        self.comm.allreduce_(buf)
        tail = self.model.backend.to_numpy(buf[-2:])
        self._stop_voted = bool(tail[1] > 0)
        return float(tail[0]), dict(views)

    def _time_is_up(self) -> bool:
        return self._deadline is not None and time.perf_counter() > self._deadline

    def _check_finite(self, what: str, value: float) -> None:
        """Stop with :class:`TrainingDiverged` when ``value`` is NaN or infinite."""
        if not math.isfinite(value):
            keep = (f"the last good checkpoint {self.ckpt_path} is kept"
                    if self.ckpt_path.is_file() else "no checkpoint was written")
            raise TrainingDiverged(f"training diverged: {what} is {value} at step "
                                   f"{self.step + 1}; {keep} (try a lower --lr or --grad-clip)")

    def _record_step(self, loss: float) -> None:
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self.history["train"].append([self.step, loss])

    # --- the loop ------------------------------------------------------------------------------
    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Run to ``tc.steps`` (or only to step ``stop_at``, saving a checkpoint there; the
        schedule still spans ``tc.steps``); returns a summary (steps, losses, tokens/s, time)."""
        tc = self.tc
        end = tc.steps if stop_at is None else min(int(stop_at), tc.steps)
        start_step = self.step
        t0 = time.perf_counter()
        self._deadline = t0 + tc.time_limit * 60 if tc.time_limit else None
        stopped_early = False
        last_loss = math.nan
        bar = _progress(total=tc.steps, initial=self.step, enabled=self.progress)
        try:
            self._evaluate_at_start(bar)
            while self.step < end:
                last_loss, lr = self._timed_step(bar)
                self._evaluate_if_due(bar, last_loss, lr)
                self._checkpoint_if_due(end)
                if self.step < end and self._stop_voted:
                    self._stop_for_time_limit(bar)
                    stopped_early = True
                    break
        finally:
            bar.close()
            self._deadline = None
        return self._summary(start_step, time.perf_counter() - t0, last_loss, stopped_early)

    def _evaluate_at_start(self, bar) -> None:
        """The validation loss of the initial weights (a fresh run only; rank 0)."""
        if self.step == 0 and self.is_root:
            v = self.evaluate()
            self.history["val"].append([0, v])
            bar.write(f"step 0: val loss {v:.4f}")

    def _timed_step(self, bar) -> tuple[float, float]:
        """:meth:`train_step`, timed into ``train_seconds`` and shown on the progress bar."""
        ts = time.perf_counter()
        loss, _, lr = self.train_step()
        dt = time.perf_counter() - ts
        self.train_seconds += dt
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}",
                        tok_s=f"{self.tokens_per_step / max(dt, 1e-9):.0f}", refresh=False)
        return loss, lr

    def _evaluate_if_due(self, bar, train_loss: float, lr: float) -> None:
        """Every ``eval_interval`` steps and at the last step: validation loss, logged (rank 0)."""
        if not self.is_root:
            return
        if self.step % self.tc.eval_interval == 0 or self.step == self.tc.steps:
            v = self.evaluate()
            self.history["val"].append([self.step, v])
            bar.write(f"step {self.step}: train loss {train_loss:.4f}, val loss {v:.4f}, "
                      f"lr {lr:.2e}, {self.tokens_seen / max(self.train_seconds, 1e-9):.0f} tok/s")

    def _checkpoint_if_due(self, end: int) -> None:
        """Every ``ckpt_interval`` (default: ``eval_interval``) steps and at ``end``."""
        every = self.tc.ckpt_interval or self.tc.eval_interval
        if self.step % every == 0 or self.step == end:
            self._save_on_root()

    def _stop_for_time_limit(self, bar) -> None:
        """Save, and say so on rank 0 alone: every rank stops here (the vote is agreed), and a
        second rank writing the same line to the launcher's merged stdout could land in the middle
        of one of rank 0's lines."""
        self._save_on_root()
        if self.is_root:
            bar.write(f"time limit of {self.tc.time_limit} min reached at step {self.step}; "
                      f"checkpoint saved, continue with --resume")

    def _summary(self, start_step: int, wall: float, last_loss: float,
                 stopped_early: bool) -> dict[str, Any]:
        steps_run = self.step - start_step
        if steps_run == 0 and self.history["train"]:  # nothing ran: the last recorded loss
            last_loss = self.history["train"][-1][1]
        return {"steps": self.step, "steps_run": steps_run, "wall_seconds": wall,
                "train_seconds": self.train_seconds, "tokens_seen": self.tokens_seen,
                "tokens_per_second": steps_run * self.tokens_per_step / max(wall, 1e-9),
                "final_train_loss": last_loss,
                "final_val_loss": self.history["val"][-1][1] if self.history["val"] else None,
                "stopped_early": stopped_early or self.step < self.tc.steps,
                "checkpoint": str(self.ckpt_path)}


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, mininterval=2.0, file=sys.stderr)


def plot_losses(history: dict[str, list], path, title: str = "") -> Path:
    """Draw the training loss (raw and smoothed) and the validation loss against the step
    into a PNG, atomically."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = np.asarray(history.get("train") or np.zeros((0, 2)), dtype=np.float64).reshape(-1, 2)
    va = np.asarray(history.get("val") or np.zeros((0, 2)), dtype=np.float64).reshape(-1, 2)
    if tr.size:
        ax.plot(tr[:, 0], tr[:, 1], color="tab:blue", alpha=0.25, lw=0.8, label="train (step)")
        k = max(1, len(tr) // 50)
        if k > 1:
            kern = np.ones(k) / k
            sm = np.convolve(tr[:, 1], kern, mode="valid")
            ax.plot(tr[k - 1:, 0], sm, color="tab:blue", lw=1.5, label=f"train ({k}-step mean)")
    if va.size:
        ax.plot(va[:, 0], va[:, 1], "o-", color="tab:red", ms=3, lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path


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


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


#: flag name -> (field, type, help)
_FLAGS = [
    ("--dim", int, "model width D"),
    ("--n-layers", int, "number of blocks L"),
    ("--n-heads", int, "query heads H"),
    ("--n-kv-heads", int, "key/value heads KVH (GQA when < H)"),
    ("--hidden-dim", int, "SwiGLU hidden size F (default: LLaMA's rule)"),
    ("--multiple-of", int, "round F up to a multiple of this"),
    ("--tie-embeddings", _bool, "share the embedding and the output head (true/false)"),
    ("--context", int, "training context T (also the model's max_seq_len)"),
    ("--batch-size", int, "windows per micro-batch B"),
    ("--grad-accum", int, "micro-batches per optimisation step"),
    ("--steps", int, "optimisation steps"),
    ("--lr", float, "peak learning rate"),
    ("--min-lr", float, "final learning rate of the cosine decay"),
    ("--warmup", int, "linear warmup steps"),
    ("--weight-decay", float, "AdamW decoupled weight decay"),
    ("--beta1", float, "AdamW beta1"),
    ("--beta2", float, "AdamW beta2"),
    ("--eps", float, "AdamW epsilon"),
    ("--grad-clip", float, "clip the global gradient norm to this (0: off)"),
    ("--decay-embeddings", _bool, "weight-decay the embedding too (true/false)"),
    ("--eval-interval", int, "steps between validation losses"),
    ("--eval-iters", int, "validation batches per evaluation"),
    ("--ckpt-interval", int, "steps between checkpoints (default: eval interval)"),
    ("--backend", str, "numpy, numba or cupy (default: $MINILLAMA_BACKEND or numpy)"),
    ("--dtype", str, "compute dtype, float32 or float64"),
    ("--precision", str, "matrix products: fp32 (default), or on --backend cupy tf32 (TF32 tensor "
                         "cores) or bf16 (bfloat16 operands); float32 accumulation and master "
                         "weights"),
    ("--seed", int, "seed of the initial weights and of the batch sampler"),
    ("--out", str, "output folder (checkpoint, loss plot, prepared data)"),
    ("--data", str, "'shakespeare' (default), a text file, or a prepared data folder"),
    ("--time-limit", float, "minutes; save a checkpoint and stop when reached"),
    ("--plot", _bool, "redraw OUT/loss.png at every checkpoint (true/false; default true)"),
    ("--norm", str, "rmsnorm (LLaMA) or layernorm"),
    ("--norm-position", str, "pre (LLaMA: x + F(Norm(x))) or post (Norm(x + F(x)))"),
    ("--pos-encoding", str, "rope (LLaMA), sinusoidal (added to the embeddings) or none"),
    ("--ffn", str, "swiglu (LLaMA), or the two-matrix gelu / relu (default width 3/2 F)"),
    ("--logit-scale", float, "multiply the logits by this (1/sqrt(dim) keeps their spread flat "
                             "in the width); 1 = off"),
    ("--init-from", str, "start from this checkpoint's weights when OUT has no checkpoint; its "
                         "model shape and variants become the defaults"),
]


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from scratch (or --resume)",
        description="Train a LLaMA on byte-level text with the hand-written backward pass. "
                    "Settings: defaults < --config file (TOML/JSON) < flags.")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings")
    for flag, typ, hlp in _FLAGS:
        p.add_argument(flag, type=typ, default=None, help=hlp)
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/ckpt.safetensors (its settings, unless overridden)")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="stop (with a checkpoint) after this step; the schedule still spans "
                        "--steps, so a later --resume continues the same run")
    p.add_argument("--export", metavar="PATH",
                   help="when done, also write a weights-only model file here")
    p.add_argument("--export-dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)

    q = subparsers.add_parser(
        "prepare-data", help="tokenize a corpus into uint16 token files",
        description="Write OUT/train.bin, OUT/val.bin and OUT/meta.json (byte tokens) from the "
                    "Shakespeare corpus (default) or a plain text file.")
    q.add_argument("--data", default="shakespeare", help="'shakespeare' or a text file")
    q.add_argument("--out", default="data/shakespeare", help="output folder")
    q.set_defaults(func=run_prepare)


def _flag_overrides(args) -> dict[str, Any]:
    out = {}
    for flag, _, _ in _FLAGS:
        name = flag[2:].replace("-", "_")
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    return out


def build_config(args, world_size: int = 1) -> TrainConfig:
    """defaults < (checkpoint's config on --resume) < --config file < flags.

    On ``--resume`` with another rank count than the checkpoint's, ``grad_accum`` becomes what
    keeps the global batch (unless the file or a flag sets it): see :func:`grad_accum_for`."""
    flags = _flag_overrides(args)
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


def _model_defaults_from(path, base: TrainConfig) -> TrainConfig:
    """``base`` with the model fields (shape and variants) of the checkpoint at ``path``."""
    from .formats import load_params  # noqa: PLC0415

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
    comm = NCCLComm(world) if world.size > 1 and backend == "cupy" else world
    trainer = Trainer(tc, progress=not args.no_progress, comm=comm)
    n = trainer.cfg.n_params()
    say(f"model: dim {tc.dim}, {tc.n_layers} layers, {tc.n_heads} heads / {tc.n_kv_heads} kv "
        f"heads, F {trainer.cfg.hidden_dim}, context {tc.context}: {n:,} parameters; "
        f"backend {trainer.model.backend.name}"
        f"{'' if tc.precision == 'fp32' else f', {tc.precision} matrix products'}")
    if not trainer.cfg.is_llama:
        say("variants: " + ", ".join(f"{k}={getattr(tc, k)}" for k in MODEL_FIELDS[9:]))
    say(f"data: {trainer.data.folder} ({trainer.data.train.size:,} train / "
        f"{trainer.data.val.size:,} val tokens)")
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
