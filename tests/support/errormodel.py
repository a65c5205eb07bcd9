r"""Rounding bounds for tests that compare two float32 computations of the same model.

Two evaluations of the same logits that differ only in how their sums are ordered and blocked
(another BLAS kernel family, AVX2 against AVX-512, a matrix dequantized per row tile instead of
whole, FMA or not) differ by their rounding errors. A K-term dot product's rounding error is at
most K u \sum_k |a_k b_k| in the worst case (u the unit roundoff, 2^{-24} in float32); with
roundings of mixed sign, as every real kernel makes them, it grows as \sqrt{K} u \sum_k |a_k b_k|
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 2.8).
:func:`minillama.identities.base.model_tolerance` is the worst-case bound for a model's logits,
64 (L + 1) (D + F + S) u times :func:`~minillama.identities.base.model_scale`;
:func:`logits_bound` takes its square-root form, tight enough that a wrong block or a wrong
scale in one layer is far outside it, and independent of the machine.
"""

from __future__ import annotations

import numpy as np

from minillama.identities.base import model_scale

U32 = float(np.finfo(np.float32).eps) / 2  #: float32's unit roundoff, 2^-24


def logits_bound(model, S: int, u: float = U32) -> float:
    r"""64 (L + 1) \sqrt{D + F + S} u \cdot model_scale(model): the most two float32
    evaluations of ``model``'s logits over ``S`` positions may differ by (``model`` a float
    model: its output matrix is read as an array)."""
    cfg = model.cfg
    return 64 * (cfg.n_layers + 1) * np.sqrt(cfg.dim + cfg.hidden_dim + S) * u \
        * model_scale(model)
