r"""The gradient of one optimisation step over the global batch, on one process or as one rank of
a data-parallel run, and the time limit whose vote travels with the gradients.

With N ranks and A = ``grad_accum`` micro-batches each:

.. math::

    g = \frac{1}{N A} \sum_{r=1}^{N} \sum_{a=1}^{A} \nabla_\theta L(x_{rA+a}, y_{rA+a})

Every rank draws all N x A micro-batches from the same sampler (so the data position stays the
same everywhere) and computes on its own A; the sums go over the ranks in one flat buffer.

Pretraining (:class:`minillama.train.trainer.Trainer`) and fine-tuning
(:class:`minillama.train.finetune.Finetuner`) both take their step's gradient from
:class:`DataParallelStep`; fine-tuning draws micro-batches with masked targets (and, packed, their
segments), trains only some parameters (the adapters, the base frozen) and skips micro-batches
without a trained target.
"""

from __future__ import annotations

import time
from typing import Any

from minillama.core.errors import MinillamaError
from minillama.train.distributed import Communicator


class TimeLimit:
    """``--time-limit``: a deadline on :func:`time.perf_counter` while the loop runs."""

    def __init__(self):
        self.deadline = None

    def start(self, minutes: float | None) -> None:
        self.deadline = time.perf_counter() + minutes * 60 if minutes else None

    def clear(self) -> None:
        self.deadline = None

    def is_up(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


class DataParallelStep:
    """The mean loss and gradient of the global batch for ``model`` on ``data``; with several
    ranks, summed with one in-place all-reduce of a flat buffer that also carries the loss sum and
    the time-limit vote (:attr:`stop_voted`, the same on every rank after a step).

    What fine-tuning changes, by keyword:

    * ``draw``: () -> (x, y, keywords of ``model.loss_and_grads``), one micro-batch (default:
      ``data.train_batch(batch_size)`` and no keywords); targets y = -1 are not trained, and
      packed rows pass ``segments``;
    * ``params``: the parameters that get gradients (default: all of ``model.params``; a LoRA
      run's adapters, its base frozen), the layout of the flat buffer;
    * ``skip_untrained``: a drawn micro-batch with no trained target (every y = -1) is not run
      (it adds nothing to the sums and still counts in the mean); a step of which no micro-batch
      ran raises :class:`MinillamaError`.
    """

    def __init__(self, model, data, comm: Communicator, batch_size: int, grad_accum: int,
                 time_limit: TimeLimit | None = None, *, draw=None, params=None,
                 skip_untrained: bool = False):
        self.model = model
        self.data = data
        self.comm = comm
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.time_limit = time_limit if time_limit is not None else TimeLimit()
        self.draw = draw if draw is not None else self._draw_from_data
        self.params = params if params is not None else model.params
        self.skip_untrained = skip_untrained
        self.stop_voted = False  # some rank's time limit has passed (decided in the last step)
        self._flat = None  # (buffer, views): the gradients of a data-parallel step, flat

    def mean_loss_and_grads(self) -> tuple[float, dict[str, Any]]:
        """The loss and gradient averaged over the N x A micro-batches of the global batch. One
        process (N = 1) sums its A micro-batches; several sum theirs, then
        :meth:`sum_over_ranks`."""
        loss_sum, grads = self.local_loss_and_grads()
        self.stop_voted = self.time_limit.is_up()
        if self.comm.size > 1:
            loss_sum, grads = self.sum_over_ranks(loss_sum, grads)
        n = self.comm.size * self.grad_accum
        if n > 1:
            for k in grads:
                grads[k] *= 1.0 / n
        return loss_sum / n, grads

    def local_loss_and_grads(self) -> tuple[float, dict[str, Any]]:
        """This rank's share of the global batch: micro-batches rA .. rA + A - 1 of the N x A that
        every rank draws from the same sampler; returns the sums of their losses and of their
        gradients."""
        A, r = self.grad_accum, self.comm.rank
        loss_sum, grads = 0.0, None
        for j in range(self.comm.size * A):
            x, y, kw = self.draw()
            if j // A != r:
                continue
            if self.skip_untrained and not (y >= 0).any():
                continue
            loss, g = self.model.loss_and_grads(x, y, **kw)
            loss_sum += loss
            if grads is None:
                grads = g
            else:
                for k in grads:
                    grads[k] += g[k]
        if grads is None:
            raise MinillamaError("a whole step drew no trained token")
        return loss_sum, grads

    def _draw_from_data(self):
        """The default ``draw``: a micro-batch of ``data``, no keywords."""
        x, y = self.data.train_batch(self.batch_size)
        return x, y, {}

    def flat_buffer(self):
        """(buf, views): one contiguous array (in the parameters' array module: host or device)
        holding every gradient followed by two slots, the loss sum and the time-limit vote;
        ``views[name]`` is the gradient's piece, shaped like the parameter."""
        if self._flat is None:
            params = self.params
            xp = self.model.backend.xp
            n = sum(int(p.size) for p in params.values())
            buf = xp.zeros(n + 2, dtype=self.model.dtype)
            views, off = {}, 0
            for k, p in params.items():
                views[k] = buf[off:off + p.size].reshape(p.shape)
                off += p.size
            self._flat = (buf, views)
        return self._flat

    def sum_over_ranks(self, loss_sum: float, grads: dict[str, Any]):
        """Sum the gradients, the loss and the time-limit votes of every rank with one in-place
        all-reduce of the flat buffer (bucketed by the communicator); returns the summed loss and
        the summed gradients (views into the buffer)."""
        buf, views = self.flat_buffer()
        for k, v in views.items():
            v[...] = grads[k]
        buf[-2] = loss_sum
        buf[-1] = 1.0 if self.stop_voted else 0.0
        self.comm.allreduce_(buf)
        tail = self.model.backend.to_numpy(buf[-2:])
        self.stop_voted = bool(tail[1] > 0)
        return float(tail[0]), dict(views)
