"""Shared float64 gradient-check helpers for the whole-model tests."""

from __future__ import annotations

import numpy as np


def rel_err(a, b) -> float:
    """||a - b|| / max(||a||, ||b||); refuses the vacuous case where both are zero."""
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    den = max(np.linalg.norm(a), np.linalg.norm(b))
    assert den > 0, "vacuous check: both gradients are zero"
    return float(np.linalg.norm(a - b) / den)


def central_differences(loss, flat, idx, h: float) -> np.ndarray:
    """(loss(x + h e_i) - loss(x - h e_i)) / 2h for each i in ``idx``, perturbing ``flat`` (a view
    of a parameter that ``loss()`` reads) in place and restoring it."""
    num = np.empty(len(idx))
    for j, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + h
        lp = loss()
        flat[i] = old - h
        lm = loss()
        flat[i] = old
        num[j] = (lp - lm) / (2 * h)
    return num
