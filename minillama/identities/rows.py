r"""Identities of the row-wise ops: RoPE, RMSNorm, softmax and cross-entropy.

Tolerances follow :mod:`minillama.identities.base`: u is the unit roundoff of the dtype, and a
RoPE table entry is off by \delta_p = u + (4p + 1) u_{64} at position p (its angle p \theta_i
is formed in float64, then cos/sin are cast).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core import ops
from minillama.identities import strategies as ids
from minillama.identities.base import Identity, Subject, loss_bound, ratio

U64 = float(np.finfo(np.float64).eps) / 2


def table_error(s: Subject, position: int) -> float:
    """\\delta_p: how far a RoPE cos/sin entry at ``position`` may be from the exact value."""
    return s.u + (4 * position + 1) * U64


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def _rope_relative(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    hd = 2 * ex["half"]
    q, k = rng.standard_normal((2, 1, 1, 1, hd)).astype(s.dtype)
    m, n, c, theta = ex["m"], ex["n"], ex["shift"], ex["theta"]

    def score(i, j):
        return float(np.sum(s.rotate(q, [i], theta) * s.rotate(k, [j], theta)))

    err = score(m, n) - score(m + c, n + c)
    delta = table_error(s, max(m, n) + c)
    tol = (16 * delta + (32 + 4 * hd) * s.u) * np.linalg.norm(q) * np.linalg.norm(k)
    return ratio(err, tol)


def _rope_norms(s: Subject, ex: dict) -> float:
    x, pos = ids.rope_arrays(ex, s.dtype)
    y = s.rotate(x, pos)
    x64 = x.astype(np.float64)
    x0, x1 = s.rope_pairs(x64)
    delta = np.array([table_error(s, p) for p in pos]).reshape(1, -1, 1, 1)
    tol = 4 * (delta + 2 * s.u) * (np.abs(x0) + np.abs(x1))
    worst = ratio(np.hypot(*s.rope_pairs(y)) - np.hypot(x0, x1), tol)
    y0 = s.rotate(x, np.zeros(len(pos), dtype=np.int64))  # cos 0 = 1, sin 0 = 0 exactly
    return max(worst, ratio(y0 - x64, 2 * s.u * np.abs(x64)))


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------
def _rmsnorm_scale(s: Subject, ex: dict) -> float:
    x, g, _ = ids.norm_arrays({**ex, "N": 3}, s.dtype)
    a, eps = ex["a"], ex["eps"]
    y1 = s.rmsnorm(a * x.astype(np.float64), g, eps)
    y2 = s.rmsnorm(x, g, eps / a**2)
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps / a**2)
    D = x.shape[-1]
    return ratio(y1 - y2, 2 * (D + 12) * s.u * np.abs(x64) * r * np.abs(g.astype(np.float64)))


def _rmsnorm_unit_rms(s: Subject, ex: dict) -> float:
    eps = 1e-5
    rng = np.random.default_rng(ex["seed"])
    D = ex["D"]
    x = (ex["scale"] * (rng.standard_normal((4, D)) + 0.3)).astype(s.dtype)
    y = s.rmsnorm(x, np.ones(D), eps)
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1)
    want = np.sqrt(ms / (ms + eps))
    return ratio(np.sqrt(np.mean(y * y, axis=-1)) - want, 2 * (D + 8) * s.u * want)


# ---------------------------------------------------------------------------------------------
# softmax and cross-entropy
# ---------------------------------------------------------------------------------------------
def _shifted_logits(s: Subject, ex: dict):
    """x (N, V) = 5 N(0, 1), the row shifts c (N, 1), the targets (N,; -1 where ignored), x + c;
    all in dtype."""
    rng = np.random.default_rng(ex["seed"])
    x = (5 * rng.standard_normal((ex["N"], ex["V"]))).astype(s.dtype)
    c = ex["shift"] * (0.5 + 0.5 * rng.random((ex["N"], 1)))
    t = rng.integers(0, ex["V"], ex["N"])
    t = np.where(rng.random(ex["N"]) < ex["ignored"], -1, t)  # -1: an ignored position
    return x, c, t, (x.astype(np.float64) + c).astype(s.dtype)


def _softmax_shift(s: Subject, ex: dict) -> float:
    x, _, _, xc = _shifted_logits(s, ex)
    V = x.shape[-1]
    p0 = ops.softmax(x).astype(np.float64)
    p1 = ops.softmax(xc).astype(np.float64)
    m = float(np.abs(x).max() + np.abs(xc.astype(np.float64)).max())
    rel = 8 * s.u * m + 4 * (V + 3) * s.u
    return max(ratio(p1 - p0, rel * p0),
               ratio(p0.sum(-1) - 1, 2 * (2 * s.u * m + (2 * V + 3) * s.u)))


def _cross_entropy_shift(s: Subject, ex: dict) -> float:
    x, _, t, xc = _shifted_logits(s, ex)
    N, V = x.shape
    l0, l1 = s.cross_entropy(x, t), s.cross_entropy(xc, t)
    m = float(np.abs(x).max() + np.abs(xc.astype(np.float64)).max())
    return ratio(l1 - l0, s.u * loss_bound(m, l0, N, V))


_LOGITS = st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 5),
                                 "V": st.integers(1, 30), "shift": ids.shifts(),
                                 "ignored": st.sampled_from((0.0, 0.3, 1.0))})

IDENTITIES = [
    Identity(
        name="rope_relative_position", topic="rope",
        statement="A RoPE attention score depends only on the offset of the two positions: "
                  "moving query and key by the same shift leaves it unchanged.",
        equation=r"\langle R_{m} q, R_{n} k \rangle = \langle R_{m+s} q, R_{n+s} k \rangle",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "half": st.integers(1, 16), "m": st.integers(0, 2000),
            "n": st.integers(0, 2000), "shift": st.integers(0, 2000),
            "theta": st.sampled_from((10000.0, 500000.0))}),
        tolerance="(16 delta_p + (32 + 4 hd) u) |q| |k|: each rotated entry is off by the "
                  "table error delta_p plus 2u, and the dot sums hd terms",
        ops=("rope_forward",), fn=_rope_relative),
    Identity(
        name="rope_preserves_pair_norms", topic="rope",
        statement="RoPE turns each pair (x_2i, x_2i+1) by an orthogonal 2x2 rotation: every "
                  "pair keeps its length, and at position 0 RoPE is the identity.",
        equation=r"\|(y_{2i}, y_{2i+1})\| = \|(x_{2i}, x_{2i+1})\|, \qquad R_0 x = x",
        strategy=ids.rope_cases(),
        tolerance="4 (delta_p + 2u) (|x_2i| + |x_2i+1|) per pair; 2u |x| at position 0, where "
                  "cos = 1 and sin = 0 exactly",
        ops=("rope_forward",), fn=_rope_norms),
    Identity(
        name="rmsnorm_scale_invariance", topic="norm",
        statement="Scaling RMSNorm's input by omega is the same as dividing its epsilon by "
                  "omega^2 (so RMSNorm is scale invariant up to epsilon).",
        equation=r"\mathrm{RMSNorm}(\omega x; \epsilon) = \mathrm{RMSNorm}(x; \epsilon / \omega^2)",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "D": st.integers(1, 64), "a": st.floats(0.05, 20.0),
            "eps": st.sampled_from((0.0, 1e-6, 1e-5))}),
        tolerance="2 (D + 12) u |x_i| r |g_i|: the mean of D squares, a square root, a division "
                  "and the products with x and g",
        ops=("rmsnorm_forward",), fn=_rmsnorm_scale),
    Identity(
        name="rmsnorm_unit_gain_rms", topic="norm",
        statement="With unit gain every output row of RMSNorm has root mean square "
                  "sqrt(ms / (ms + eps)), ms the mean square of the input row: 1 up to epsilon.",
        equation=r"\mathrm{rms}(\mathrm{RMSNorm}(x; \epsilon)) = \sqrt{ms / (ms + \epsilon)},"
                 r"\ ms = \mathrm{mean}(x^2)",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "D": st.integers(1, 64),
                                        "scale": st.floats(0.1, 100.0)}),
        tolerance="2 (D + 8) u relative: the output's entries are each within (D/2 + 4) u",
        ops=("rmsnorm_forward",), fn=_rmsnorm_unit_rms),
    Identity(
        name="softmax_shift_invariance", topic="softmax",
        statement="Softmax ignores a constant added to a row of logits (the max-shifted form "
                  "computes it without overflow), and each row sums to 1.",
        equation=r"\mathrm{softmax}(x + c\mathbf{1}) = \mathrm{softmax}(x), \qquad "
                 r"\sum_j p_j = 1",
        strategy=_LOGITS,
        tolerance="(8u M + 4 (V + 3) u) p_j, M = max |x| + max |x + c|: the shift and the "
                  "exponential's argument are off by u M each, the sum of V exponentials by V u",
        ops=(), fn=_softmax_shift),
    Identity(
        name="cross_entropy_shift_invariance", topic="softmax",
        statement="Cross-entropy ignores a constant added to a row of logits, even a shift "
                  "large enough to overflow an exponential that is not max-shifted (ignored "
                  "targets among the rows).",
        equation=r"\mathrm{CE}(x + c\mathbf{1}, y) = \mathrm{CE}(x, y)",
        strategy=_LOGITS,
        tolerance="8u M + 4 (V + N + 8) u (1 + |L|): logits off by u M after the shift, a log "
                  "of a sum of V terms, a mean of N rows",
        ops=("cross_entropy_forward",), fn=_cross_entropy_shift),
]
