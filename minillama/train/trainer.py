r"""The training loop of ``minillama train`` (the command: :mod:`minillama.cli.train`; its
settings: :mod:`minillama.train.config`): a LLaMA from scratch with the hand-written backward pass.

One optimisation step with A micro-batches of B windows of T tokens:

.. math::

    g = \frac{1}{A} \sum_{a=1}^{A} \nabla_\theta L(x_a, y_a), \qquad
    g \leftarrow \mathrm{clip}(g, c), \qquad
    \theta \leftarrow \mathrm{AdamW}(\theta, g, \eta(s))

with the schedule \eta(s) of :func:`minillama.train.optim.lr_at` and global-norm clipping at c.

Outputs in ``--out`` (default ``runs/default``):

* ``ckpt.safetensors``: the training checkpoint in the project's format: the parameters, the
  AdamW moments as extra tensors ``optim.m.<name>`` / ``optim.v.<name>`` and the metadata entry
  ``train_state`` (step, optimizer step count, data RNG state, loss history, the train config).
  Written atomically, so an interruption keeps the previous one. ``--resume`` continues from it and
  reproduces an uninterrupted run bit for bit on the same backend;
* ``loss.png``: the training and validation loss curves;
* ``data/``: the prepared token files (unless ``--data`` names a prepared folder).

``--export PATH`` also writes a weights-only model file (float16 by default) for shipping.

The pieces: :class:`Trainer` (this module) holds the run and runs the loop;
:mod:`minillama.train.setup` opens its data and builds its model and optimizer;
:mod:`minillama.train.step` computes the gradient of a step (data parallel or not) and keeps the
time limit; :mod:`minillama.train.evaluate` the validation loss; :mod:`minillama.train.checkpoint`
writes and restores the checkpoint; :mod:`minillama.train.plot` draws ``loss.png``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import CKPT_NAME, check_output_dir
from minillama.train.checkpoint import (
    restore_training_checkpoint,
    training_state,
    write_training_checkpoint,
)
from minillama.train.config import (
    TrainConfig,
)
from minillama.train.distributed import Communicator, SingleProcess
from minillama.train.evaluate import Evaluator
from minillama.train.optim import clip_grad_norm, lr_at
from minillama.train.plot import PLOT_NAME, plot_losses
from minillama.train.setup import (
    build_model,
    build_optimizer,
    check_share_of_data,
    check_weights_agree,
    open_data,
)
from minillama.train.step import DataParallelStep, TimeLimit


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class TrainingDiverged(MinillamaError):
    """The loss or the gradient norm became NaN/Inf."""


class Trainer:
    """Owns the model, the optimizer, the data and the history of one run.

    ``Trainer(tc)`` starts fresh; :meth:`resume` restores a checkpoint; :meth:`train` runs to
    ``tc.steps`` (or the time limit) and saves checkpoints every ``ckpt_interval`` steps.

    ``comm`` (a :class:`~minillama.train.distributed.Communicator`, default one process) makes it
    one rank of a data-parallel run: every rank builds the same model from the same seed, draws the
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
        self.data = open_data(tc, self.comm, self.out, self.cfg, data_dir)
        self.comm.agree(lambda: check_share_of_data(tc, self.comm, self.data))
        self.model = self.comm.agree(lambda: build_model(tc, self.cfg, self.out))
        self.opt = build_optimizer(tc, self.model)
        self.step = 0
        self.history: dict[str, list] = {"train": [], "val": []}  # [step, loss] pairs
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.progress = progress and self.is_root
        self.evaluator = Evaluator(self.data, tc.batch_size, tc.eval_iters)
        self.time_limit = TimeLimit()
        self.grad_step = DataParallelStep(self.model, self.data, self.comm, tc.batch_size,
                                          tc.grad_accum, self.time_limit)
        check_weights_agree(self.comm, self.model)

    @property
    def ckpt_path(self) -> Path:
        return self.out / CKPT_NAME

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimisation step: N ranks x A micro-batches of B windows of T tokens."""
        return self.comm.size * self.tc.grad_accum * self.tc.batch_size * self.tc.context

    # --- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The training state stored in the checkpoint's metadata (``train_state``)."""
        return training_state(self)

    def save(self, path=None) -> Path:
        """Write the checkpoint (atomically), then redraw the loss plot (unless ``plot`` is off)."""
        path = Path(path) if path is not None else self.ckpt_path
        write_training_checkpoint(self, path)
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
        check_weights_agree(self.comm, self.model)

    def resume(self, path=None) -> None:
        """Restore weights, optimizer moments, data position and history from a checkpoint
        (every rank reads the same file)."""
        path = Path(path) if path is not None else self.ckpt_path

        self.comm.agree(lambda: restore_training_checkpoint(self, path))
        check_weights_agree(self.comm, self.model)

    # --- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (eval_iters of them)."""
        return self.evaluator.quick(self.model)

    def evaluate_full(self, batch_size: int | None = None) -> float:
        """Token-weighted mean loss over the whole validation split (non-overlapping windows)."""
        return self.evaluator.full(self.model, batch_size)

    # --- one optimisation step -----------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float]:
        """One optimisation step; returns (loss, grad norm before clipping, lr)."""
        tc = self.tc
        lr = lr_at(self.step, tc.lr, tc.warmup_steps, tc.steps, tc.min_lr)
        loss, grads = self.grad_step.mean_loss_and_grads()
        self._check_finite("loss", loss)
        norm = clip_grad_norm(grads, self.tc.grad_clip)
        self._check_finite("gradient norm", norm)
        self.opt.step(grads, lr=lr)
        self._record_step(loss)
        return loss, norm, lr

    def _flat_buffer(self):
        """The flat gradient buffer of a data-parallel step (see :class:`DataParallelStep`)."""
        return self.grad_step.flat_buffer()

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
        self.time_limit.start(tc.time_limit)
        stopped_early = False
        last_loss = math.nan
        bar = _progress(total=tc.steps, initial=self.step, enabled=self.progress)
        try:
            self._evaluate_at_start(bar)
            while self.step < end:
                last_loss, lr = self._timed_step(bar)
                self._evaluate_if_due(bar, last_loss, lr)
                self._checkpoint_if_due(end)
                if self.step < end and self.grad_step.stop_voted:
                    self._stop_for_time_limit(bar)
                    stopped_early = True
                    break
        finally:
            bar.close()
            self.time_limit.clear()
        return _summary(self, start_step, time.perf_counter() - t0, last_loss, stopped_early)

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


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, mininterval=2.0, file=sys.stderr)


def _summary(tr: Trainer, start_step: int, wall: float, last_loss: float,
             stopped_early: bool) -> dict[str, Any]:
    """What :meth:`Trainer.train` returns: steps, losses, tokens/s and times of the run."""
    steps_run = tr.step - start_step
    if steps_run == 0 and tr.history["train"]:  # nothing ran: the last recorded loss
        last_loss = tr.history["train"][-1][1]
    return {"steps": tr.step, "steps_run": steps_run, "wall_seconds": wall,
            "train_seconds": tr.train_seconds, "tokens_seen": tr.tokens_seen,
            "tokens_per_second": steps_run * tr.tokens_per_step / max(wall, 1e-9),
            "final_train_loss": last_loss,
            "final_val_loss": tr.history["val"][-1][1] if tr.history["val"] else None,
            "stopped_early": stopped_early or tr.step < tr.tc.steps,
            "checkpoint": str(tr.ckpt_path)}
