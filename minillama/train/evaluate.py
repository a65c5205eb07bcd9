"""The validation loss of a training run: the quick estimate on fixed batches logged during
training, and the full pass over the validation split."""

from __future__ import annotations

import numpy as np

from minillama.io.data import TokenData


class Evaluator:
    """Validation loss of ``model`` on ``data``'s validation split, in batches of ``batch_size``
    windows; the ``eval_iters`` batches of :meth:`quick` are drawn once and reused."""

    def __init__(self, data: TokenData, batch_size: int, eval_iters: int):
        self.data = data
        self.batch_size = batch_size
        self.eval_iters = eval_iters
        self._val_cache = None

    def quick(self, model) -> float:
        """Mean loss over the fixed validation batches (eval_iters of them)."""
        if self._val_cache is None:
            self._val_cache = self.data.val_batches(self.batch_size, self.eval_iters)
        losses = [model.loss(x, y) for x, y in self._val_cache]
        return float(np.mean(losses))

    def full(self, model, batch_size: int | None = None) -> float:
        """Token-weighted mean loss over the whole validation split (non-overlapping windows)."""
        total, count = 0.0, 0
        for x, y in self.data.val_full_batches(batch_size or self.batch_size):
            total += model.loss(x, y) * x.size
            count += x.size
        return total / count
