r"""The training loop of ``minillama train`` (the command: :mod:`minillama.train_cli`; its
settings: :mod:`minillama.train_config`): a LLaMA from scratch with the hand-written backward pass.

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

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import CKPT_NAME, check_finite, check_output_dir, load_checkpoint, save_checkpoint
from .config import ModelConfig
from .data import TokenData, prepare_data
from .distributed import Communicator, SingleProcess
from .errors import MinillamaError
from .model import Transformer
from .optim import AdamW, clip_grad_norm, lr_at
from .tokenizer import ByteTokenizer
from .train_config import (MODEL_FIELDS, VARIANT_FIELDS, TrainConfig,  # noqa: F401 (re-exported)
                           grad_accum_for, read_config_file)

PLOT_NAME = "loss.png"

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
        tc = self.tc
        lr = lr_at(self.step, tc.lr, tc.warmup_steps, tc.steps, tc.min_lr)
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
