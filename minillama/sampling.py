r"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

With logits z (V,) and temperature \tau > 0 the model's distribution is

    p_v = e^{z_v / \tau} / \sum_u e^{z_u / \tau}.

top-k keeps the k most likely tokens; top-p keeps the smallest set of most likely tokens whose
mass reaches p. Both renormalise what is kept. \tau = 0 is greedy: \arg\max_v z_v.
The candidate sets are found with ``np.argpartition`` (linear time); only the kept candidates are
sorted, never the whole vocabulary.
"""

from __future__ import annotations

import numpy as np

from .errors import MinillamaError


def check_sampling(temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None) -> None:
    """Raise :class:`MinillamaError` for settings outside their ranges."""
    if not (temperature >= 0.0) or not np.isfinite(temperature):
        raise MinillamaError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise MinillamaError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise MinillamaError(f"top_p must lie in (0, 1], got {top_p}")


def _top_indices(z: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of z (V,), in descending order of z (ties: lower id first)."""
    V = z.shape[0]
    if k >= V:
        idx = np.arange(V)
    else:
        idx = np.argpartition(-z, k - 1)[:k]
    order = np.lexsort((idx, -z[idx]))
    return idx[order]


def candidates(logits, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The tokens that may be sampled and their renormalised probabilities.

    logits: (V,). Returns (ids (K,), probs (K,)) with probs summing to 1; with a filter the ids
    are sorted by decreasing probability, without one they are the whole vocabulary in id order
    (no sort needed to sample). top-p keeps the shortest prefix of that order whose mass
    \sum p \ge top\_p (the token that crosses the threshold is kept).
    """
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    V = z.shape[0]
    t = float(temperature) if temperature > 0 else 1.0
    k = V if top_k is None else min(int(top_k), V)
    # log-sum-exp over the whole vocabulary gives exact probabilities of any candidate subset
    zmax = z.max()
    logZ = zmax / t + np.log(np.exp((z - zmax) / t).sum())
    if top_p is None or top_p >= 1.0:
        ids = np.arange(V) if top_k is None else _top_indices(z, k)
        p = np.exp(z[ids] / t - logZ)
        return ids, p / p.sum()
    # nucleus: grow a partially selected candidate set until it holds mass >= top_p
    m = min(k, 64)
    while True:
        ids = _top_indices(z, m)
        p = np.exp(z[ids] / t - logZ)
        c = np.cumsum(p)
        if c[-1] >= top_p or m >= k:
            n = min(int(np.searchsorted(c, top_p)) + 1, m)  # first index with c >= top_p
            ids, p = ids[:n], p[:n]
            return ids, p / p.sum()
        m = min(4 * m, k)


def sample(logits, rng: np.random.Generator | None = None, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> int:
    """One token id from logits (V,): argmax when ``temperature == 0`` else a draw from the
    (top-k / top-p filtered) tempered distribution using ``rng``."""
    z = np.asarray(logits)
    if temperature == 0.0:
        return int(np.argmax(z))
    if rng is None:
        raise MinillamaError("sampling with temperature > 0 needs a random generator")
    ids, p = candidates(z, temperature, top_k, top_p)
    u = rng.random()
    j = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(ids[min(j, len(ids) - 1)])
