r"""Known answers, where the invariances are blind: every attention identity holds for any score
scale, RoPE's for any base, the norms' scale identities for a gain applied wrongly. Each identity
here builds inputs whose result is known in closed form and compares the op with it:

* attention with one visible key returns that key's value, and with two keys whose scores are
  0 and s returns v_0 + \sigma(s) (v_1 - v_0), s = q \cdot k / \sqrt{hd}; padding q, k and v with
  zeros is the same attention with q scaled by \sqrt{hd / hd'} (the scale is 1 / \sqrt{hd'});
* RoPE turns pair i of position m by m \theta^{-2i/hd}, for the subject's base \theta;
* RMSNorm of a constant row, of an alternating row and of a one-hot row; the cross-entropy of
  uniform rows and of rows with one raised logit, ignored targets among them;
* the FFN's activations: SwiGLU's and ReLU's odd parts, GELU's tanh form against the exact
  GELU;
* core code the backends leave to the reference: the sliding window and packed rows of
  attention, BatchNorm's running statistics (these call :mod:`minillama.core.ops` and
  :mod:`minillama.core.notes_ops` directly).

Tolerances follow :mod:`minillama.identities.base`.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from minillama.core import notes_ops, ops
from minillama.identities import strategies as ids
from minillama.identities.base import Identity, Subject, attention_bound, loss_bound, ratio
from minillama.identities.rows import table_error

_THETAS = (10000.0, 500000.0, 1e6)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
def _two_keys(s: Subject, ex: dict) -> float:
    """Query 0 sees key 0 only (k_0 = 0): o_0 = v_0. Query 1 sees k_0 and k_1: scores 0 and s."""
    rng = np.random.default_rng(ex["seed"])
    B, KVH, G, hd = ex["B"], ex["KVH"], ex["G"], ex["hd"]
    q = (ex["scale"] * rng.standard_normal((B, 2, KVH * G, hd))).astype(s.dtype)
    k = np.zeros((B, 2, KVH, hd))
    k[:, 1] = rng.standard_normal((B, KVH, hd))
    k = k.astype(s.dtype)
    v = rng.standard_normal((B, 2, KVH, hd)).astype(s.dtype)
    o = s.attention(q, k, v, 0)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    kk, vv = np.repeat(k64, G, axis=2), np.repeat(v64, G, axis=2)  # (B, 2, H, hd)
    score = np.einsum("bhd,bhd->bh", q64[:, 1], kk[:, 1]) / np.sqrt(hd)  # (B, H)
    p1 = (1.0 / (1.0 + np.exp(-score)))[..., None]
    want = np.stack([vv[:, 0], vv[:, 0] + p1 * (vv[:, 1] - vv[:, 0])], axis=1)
    # score rounding (hd + 2) u sum |q k| / sqrt(hd) moves p_1 by at most a quarter of it
    terms = np.einsum("bhd,bhd->bh", np.abs(q64[:, 1]), np.abs(kk[:, 1])) / np.sqrt(hd)
    dp = ((hd + 2) * terms / 4 + 8)[..., None] * s.u
    spread = np.abs(vv[:, 0]) + np.abs(vv[:, 1])
    tol = np.stack([4 * s.u * np.abs(vv[:, 0]), 4 * (dp + 4 * s.u) * spread], axis=1)
    return ratio(o - want, tol)


def _zero_padding(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    hd, pad = q.shape[-1], ex["pad"]

    def padded(a):
        return np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), dtype=a.dtype)], axis=-1)

    o = s.attention(padded(q), padded(k), padded(v), start)
    qs = (q.astype(np.float64) * np.sqrt(hd / (hd + pad))).astype(s.dtype)
    o_small = s.attention(qs, k, v, start)
    tol = 2 * attention_bound(q, k, v, s.u) + 2 * attention_bound(qs, k, v, s.u)
    return max(ratio(o[..., :hd] - o_small, tol), ratio(o[..., hd:], tol))


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def rope_base(s: Subject, ex: dict) -> float:
    """The base theta the subject is held to: its own (``check_rope(fn, theta=...)``) or the
    example's."""
    return float(getattr(s, "rope_theta", None) or ex["theta"])


def _rope_angles(s: Subject, ex: dict) -> float:
    x, pos = ids.rope_arrays(ex, s.dtype, scale=1.0)
    theta, hd = rope_base(s, ex), x.shape[-1]
    y = s.rotate(x, pos, theta)
    ang = np.outer(pos.astype(np.float64), theta ** (-np.arange(0, hd, 2) / hd))  # (T, hd/2)
    c, sn = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x0, x1 = s.rope_pairs(x.astype(np.float64))
    y0, y1 = s.rope_pairs(y)
    delta = np.array([table_error(s, p) for p in pos]).reshape(1, -1, 1, 1)
    tol = 4 * (delta + 2 * s.u) * (np.abs(x0) + np.abs(x1))
    return max(ratio(y0 - (x0 * c - x1 * sn), tol), ratio(y1 - (x0 * sn + x1 * c), tol))


# ---------------------------------------------------------------------------------------------
# RMSNorm and the loss
# ---------------------------------------------------------------------------------------------
def _rmsnorm_rows(s: Subject, ex: dict) -> float:
    """A constant row c (ms = c^2), an alternating row +-a (ms = a^2) and a one-hot row a e_j
    (ms = a^2 / D)."""
    D, c, a, eps = ex["D"], ex["c"], ex["a"], ex["eps"]
    g = np.random.default_rng(ex["seed"]).standard_normal(D)
    j = ex["seed"] % D
    x = np.stack([np.full(D, c), a * (-1.0) ** np.arange(D), a * (np.arange(D) == j)])
    x, g = x.astype(s.dtype), g.astype(s.dtype)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    ms = np.array([x64[0, 0] ** 2, x64[1, 0] ** 2, x64[2, j] ** 2 / D])[:, None]
    want = x64 / np.sqrt(ms + eps) * g64
    y = s.rmsnorm(x, g, eps)
    return ratio(y - want, 2 * (D + 8) * s.u * np.abs(x64) / np.sqrt(ms + eps) * np.abs(g64))


def _loss_rows(ex: dict, dtype):
    """Logits (N, V) whose per-row loss is known, the targets (some ignored) and the mean loss
    over the kept rows: a uniform row c (log V), or a row of zeros with a at column j
    (log(V - 1 + e^a) - a [j = y])."""
    rng = np.random.default_rng(ex["seed"])
    N, V = len(ex["rows"]), ex["V"]
    z = np.zeros((N, V))
    t = rng.integers(0, V, N)
    want = np.empty(N)
    for n, (kind, a) in enumerate(ex["rows"]):
        if kind == "uniform":
            z[n] = a
            want[n] = np.log(V)
        else:
            j = t[n] if kind == "target" else (t[n] + 1) % V
            z[n, j] = a
            want[n] = np.log(V - 1 + np.exp(a)) - (a if j == t[n] else 0.0)
    kept = rng.random(N) >= ex["ignored"]
    t = np.where(kept, t, -1)
    mean = float(want[kept].sum() / max(kept.sum(), 1))
    return z.astype(dtype), t, mean


def _loss_tolerance(s: Subject, z, mean: float) -> float:
    return s.u * loss_bound(float(np.abs(z).max()), mean, *z.shape)


def _cross_entropy_values(s: Subject, ex: dict) -> float:
    z, t, mean = _loss_rows(ex, s.dtype)
    return ratio(s.cross_entropy(z, t) - mean, _loss_tolerance(s, z, mean))


def _linear_cross_entropy_values(s: Subject, ex: dict) -> float:
    """The loss head with W = I (D = V): its logits are the rows themselves."""
    z, t, mean = _loss_rows(ex, s.dtype)
    tt = s.backend.asarray(t)
    w = np.eye(z.shape[1])
    loss, _ = s.backend.linear_cross_entropy_forward(s.put(z), s.put(w), tt)
    return ratio(float(s.get(loss)) - mean, _loss_tolerance(s, z, mean))


# ---------------------------------------------------------------------------------------------
# the FFN's activations
# ---------------------------------------------------------------------------------------------
#: max over a of |tanh-form GELU(a) - a Phi(a)|: 4.73e-4, at a = +-2.70 (the tanh form's known
#: approximation error; a dense float64 scan of [-10, 10], where beyond both equal relu to 1e-20)
GELU_TANH_ERROR = 4.8e-4


def _swiglu_odd_part(s: Subject, ex: dict) -> float:
    """silu(a) - silu(-a) = a sigma(a) + a (1 - sigma(a)) = a, so h(a, b) - h(-a, b) = a b."""
    rng = np.random.default_rng(ex["seed"])
    a = (ex["scale"] * rng.standard_normal((ex["N"], ex["F"]))).astype(s.dtype)
    b = rng.standard_normal((ex["N"], ex["F"])).astype(s.dtype)
    h = s.get(s.backend.swiglu_forward(s.put(a), s.put(b))[0])
    h_neg = s.get(s.backend.swiglu_forward(s.put(-a), s.put(b))[0])
    ab = np.abs(a.astype(np.float64) * b)
    return ratio(h - h_neg - a.astype(np.float64) * b, 16 * s.u * ab)


def _relu_odd_part(s: Subject, ex: dict) -> float:
    """relu(a) - relu(-a) = a and relu(a) >= 0, exactly (a product with 0 or 1)."""
    a = np.random.default_rng(ex["seed"]).standard_normal((ex["N"], ex["F"])).astype(s.dtype)
    h = s.get(s.backend.relu_forward(s.put(a))[0])
    h_neg = s.get(s.backend.relu_forward(s.put(-a))[0])
    return max(ratio(h - h_neg - a.astype(np.float64), 0.0), ratio(np.minimum(h, 0.0), 0.0))


def _gelu_erf(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    a = (ex["scale"] * rng.standard_normal((ex["N"], ex["F"]))).astype(s.dtype)
    h = s.get(s.backend.gelu_forward(s.put(a))[0])
    a64 = a.astype(np.float64)
    exact = 0.5 * a64 * (1 + np.vectorize(math.erf)(a64 / math.sqrt(2)))
    rounding = 8 * s.u * (np.abs(a64) + 0.1 * np.abs(a64) ** 3 + 1) * np.abs(a64)
    return ratio(h - exact, GELU_TANH_ERROR + rounding)


# ---------------------------------------------------------------------------------------------
# core code the backends do not replace: the sliding window, packed rows, BatchNorm's statistics
# ---------------------------------------------------------------------------------------------
def _window(s: Subject, ex: dict) -> float:
    """Query t (position p = start + t) with a window W reads keys p - W + 1..p: the same as
    causal attention over those keys alone."""
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    W = ex["window"]
    o = ops.attention_forward(q, k, v, start, window=W)[0].astype(np.float64)
    tol = attention_bound(q, k, v, s.u)
    worst = 0.0
    for t in range(q.shape[1]):
        p = start + t
        lo = max(0, p - W + 1)
        alone = ops.attention_forward(q[:, t:t + 1], k[:, lo:p + 1], v[:, lo:p + 1], p - lo)[0]
        worst = max(worst, ratio(o[:, t:t + 1] - alone, tol))
    return worst


def _packed(s: Subject, ex: dict) -> float:
    """A row packed from examples of the drawn lengths: each example's attention is its causal
    attention alone, and its positions restart at 0."""
    lengths = ex["lengths"]
    T = sum(lengths)
    q, k, v, _ = ids.attention_arrays({**ex, "T": T, "extra": 0}, s.dtype)
    seg = np.repeat(np.arange(len(lengths)), lengths)[None].repeat(q.shape[0], axis=0)
    o = ops.attention_forward(q, k, v, 0, segments=seg)[0].astype(np.float64)
    tol = attention_bound(q, k, v, s.u)
    starts = np.cumsum([0] + list(lengths))
    worst = 0.0
    for a, b in zip(starts[:-1], starts[1:]):
        alone = ops.attention_forward(q[:, a:b], k[:, a:b], v[:, a:b], 0)[0]
        worst = max(worst, ratio(o[:, a:b] - alone, tol))
    want = np.concatenate([np.arange(n) for n in lengths])[None].repeat(q.shape[0], axis=0)
    return max(worst, ratio(ops.segment_positions(seg) - want, 0.0))


def _sinusoidal_known(s: Subject, ex: dict) -> float:
    """With D = 8 and base 10^4 the frequencies are 10^0, 10^-1, 10^-2, 10^-3: P_{p, 2i} =
    sin(p 10^-i), P_{p, 2i+1} = cos(p 10^-i)."""
    pos = np.arange(ex["start"], ex["start"] + ex["T"])
    P = notes_ops.sinusoidal_positions(int(pos[-1]) + 1, 8, dtype=s.dtype)[pos].astype(np.float64)
    ang = pos[:, None] * 10.0 ** -np.arange(4.0)
    want = np.stack([np.sin(ang), np.cos(ang)], axis=-1).reshape(len(pos), 8)
    return ratio(P - want, s.u + (4 * pos[:, None] + 8) * float(np.finfo(np.float64).eps))


def _batchnorm_statistics(s: Subject, ex: dict) -> float:
    """One training step updates the running statistics as m <- (1 - a) m + a mu and
    v <- (1 - a) v + a sigma^2 n / (n - 1); inference normalises with them."""
    rng = np.random.default_rng(ex["seed"])
    N, C, a, spatial = ex["N"], ex["C"], ex["momentum"], tuple(ex["spatial"])
    x = (rng.standard_normal((N, C) + spatial) + 0.5).astype(s.dtype)
    g, b, m0 = rng.standard_normal((3, C)).astype(s.dtype)
    v0 = (1 + rng.random(C)).astype(s.dtype)
    running = {"mean": m0.copy(), "var": v0.copy()}
    kw = {} if a is None else {"momentum": a}  # None: the default, PyTorch's 0.1
    y_train = notes_ops.batchnorm_forward(x, g, b, 1e-5, running=running, **kw)[0]
    a = 0.1 if a is None else a
    x64 = x.astype(np.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, C) + (1,) * len(spatial)
    n = x.size // C
    mu, var = x64.mean(axes), x64.var(axes)
    m_want = (1 - a) * m0 + a * mu
    v_want = (1 - a) * v0 + a * var * n / (n - 1)
    terms = 4 * (n + 8) * s.u
    worst = max(ratio(running["mean"] - m_want, terms * (np.abs(m0) + np.abs(x64).max(axes))),
                ratio(running["var"] - v_want, terms * (v0 + 2 * (x64 * x64).mean(axes) * n
                                                        / (n - 1) + mu * mu)))
    gb, bb = g.reshape(shape).astype(np.float64), b.reshape(shape).astype(np.float64)
    xc = x64 - mu.reshape(shape)
    want = xc / np.sqrt(var.reshape(shape) + 1e-5) * gb + bb
    spread = (np.abs(x64) + np.abs(mu.reshape(shape))) / np.sqrt(var.reshape(shape) + 1e-5)
    worst = max(worst, ratio(y_train - want, 4 * (n + 8) * s.u * (spread * np.abs(gb)
                                                                   + np.abs(bb))))
    m, v = running["mean"].reshape(shape), running["var"].reshape(shape)
    y = notes_ops.batchnorm_inference(x, g, b, running["mean"], running["var"], 1e-5)
    want = (x64 - m) / np.sqrt(v + 1e-5) * gb + bb
    return max(worst, ratio(y - want, 8 * s.u * ((np.abs(x64) + np.abs(m)) / np.sqrt(v + 1e-5)
                                                 * np.abs(gb) + np.abs(bb))))


_LOSS_ROW = st.tuples(st.sampled_from(("uniform", "target", "other")), st.floats(-30.0, 30.0))
_LOSS = st.fixed_dictionaries({"seed": ids.seeds, "V": st.integers(2, 12),
                               "rows": st.lists(_LOSS_ROW, min_size=1, max_size=5),
                               "ignored": st.sampled_from((0.0, 0.4, 1.0))})
_LOSS_TOL = ("8u max|z| + 4 (V + N + 8) u (1 + |L|), as cross_entropy_shift_invariance; the "
             "answer is computed in float64 from its closed form")

IDENTITIES = [
    Identity(
        name="attention_two_keys_closed_form", topic="attention",
        statement="With k_0 = 0, query 0 (one visible key) returns v_0 and query 1 returns "
                  "v_0 + sigmoid(s) (v_1 - v_0), s = q_1 . k_1 / sqrt(hd): the softmax and the "
                  "1 / sqrt(hd) scale, which every invariance of attention ignores.",
        equation=r"o_0 = v_0, \quad o_1 = v_0 + \sigma\!\left(\frac{q_1 \cdot k_1}{\sqrt{hd}}"
                 r"\right)(v_1 - v_0)",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "B": st.integers(1, 2), "KVH": st.integers(1, 2),
            "G": st.integers(1, 3), "hd": st.sampled_from((1, 2, 4, 8, 16)),
            "scale": st.floats(0.5, 3.0)}),
        tolerance="4u |v_0| for query 0; 4 (dp + 4u) (|v_0| + |v_1|) for query 1, dp = "
                  "(hd + 2) u sum |q k| / (4 sqrt(hd)) + 8u the rounding of the probability",
        ops=("attention_forward",), fn=_two_keys),
    Identity(
        name="attention_zero_padding_rescales", topic="attention",
        statement="Padding q, k and v with zeros to head dim hd' is the attention of the "
                  "unpadded heads with q scaled by sqrt(hd / hd') (the scale is 1 / sqrt(hd')), "
                  "and the padded output entries are 0.",
        equation=r"\mathrm{attn}_{hd'}([Q, 0], [K, 0], [V, 0]) = "
                 r"[\mathrm{attn}_{hd}(\sqrt{hd / hd'}\, Q, K, V), 0]",
        strategy=st.builds(lambda c, pad: {**c, "pad": pad}, ids.attention_cases(),
                           st.integers(1, 12)),
        tolerance="attention_bound of both calls, doubled",
        ops=("attention_forward",), fn=_zero_padding),
    Identity(
        name="rope_angles_known", topic="rope",
        statement="RoPE turns pair i of position m by the angle m theta^(-2i/hd), theta the "
                  "base (a user's function: the theta given to check_rope).",
        equation=r"(y_{2i}, y_{2i+1}) = R(m\, \theta^{-2i/hd})\,(x_{2i}, x_{2i+1})",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "half": st.integers(1, 16), "T": st.integers(1, 6),
            "start": st.integers(0, 3000), "theta": st.sampled_from(_THETAS)}),
        tolerance="4 (delta_p + 2u) (|x_2i| + |x_2i+1|), delta_p the table error at position p",
        ops=("rope_forward",), fn=_rope_angles),
    Identity(
        name="rmsnorm_known_rows", topic="norm",
        statement="RMSNorm of a constant row c is c g / sqrt(c^2 + eps), of an alternating row "
                  "+-a is +-a g / sqrt(a^2 + eps), of a one-hot row a e_j is "
                  "a g_j / sqrt(a^2 / D + eps) at j and 0 elsewhere.",
        equation=r"y = x g / \sqrt{ms + \epsilon}, \ ms \in \{c^2, a^2, a^2 / D\}",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "D": st.integers(1, 48), "c": st.floats(0.05, 5.0),
            "a": st.floats(0.05, 5.0), "eps": st.sampled_from((1e-6, 1e-5, 1e-2, 0.5))}),
        tolerance="2 (D + 8) u |x| |g| / sqrt(ms + eps) per entry",
        ops=("rmsnorm_forward",), fn=_rmsnorm_rows),
    Identity(
        name="cross_entropy_known_values", topic="softmax",
        statement="The mean cross-entropy of rows with a known loss (uniform: log V; one "
                  "raised logit a: log(V - 1 + e^a), minus a on the target) over the kept "
                  "rows only (ignored targets count for nothing; all ignored: 0).",
        equation=r"L = \frac{1}{|\mathcal{V}|} \sum_{n \in \mathcal{V}} \ell_n, \ "
                 r"\ell_n \in \{\log V, \log(V - 1 + e^a) - a [j = y_n]\}",
        strategy=_LOSS, tolerance=_LOSS_TOL,
        ops=("cross_entropy_forward",), fn=_cross_entropy_values),
    Identity(
        name="linear_cross_entropy_known_values", topic="softmax",
        statement="The loss head with an identity head matrix gives the known mean "
                  "cross-entropy of its rows (as cross_entropy_known_values), ignored targets "
                  "included.",
        equation=r"\mathrm{LCE}(x, I, y) = \mathrm{CE}(x, y)",
        strategy=_LOSS, tolerance=_LOSS_TOL,
        ops=("linear_cross_entropy_forward",), fn=_linear_cross_entropy_values),
    Identity(
        name="swiglu_odd_part", topic="ffn",
        statement="silu(a) - silu(-a) = a (sigma(a) + sigma(-a) = 1), so the SwiGLU gate "
                  "h(a, b) - h(-a, b) = a b: a wrong sigmoid shows, which the gradient identity "
                  "(forward and backward wrong alike) and the model's invariances miss.",
        equation=r"\mathrm{silu}(a) b - \mathrm{silu}(-a) b = a b",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                        "F": st.integers(1, 16),
                                        "scale": st.sampled_from((0.5, 3.0, 30.0))}),
        tolerance="16 u |a b|: the sigmoid, the products and the difference, each a few u",
        ops=("swiglu_forward",), fn=_swiglu_odd_part),
    Identity(
        name="relu_odd_part", topic="ffn",
        statement="relu(a) - relu(-a) = a and relu(a) >= 0, exactly: a mask taken the wrong way "
                  "round passes the gradient identity (forward and backward agree) but not this.",
        equation=r"\max(a, 0) - \max(-a, 0) = a",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                        "F": st.integers(1, 16)}),
        tolerance="0: the output is the input or 0",
        ops=("relu_forward",), fn=_relu_odd_part),
    Identity(
        name="gelu_tanh_within_its_approximation", topic="ffn",
        statement="GELU's tanh form is within 4.8e-4 of a Phi(a), the exact GELU (its largest "
                  "approximation error, 4.73e-4 at a = +-2.70).",
        equation=r"|\tfrac12 a (1 + \tanh(\sqrt{2/\pi}(a + 0.044715 a^3))) - a \Phi(a)| "
                 r"\le 4.8 \cdot 10^{-4}",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                        "F": st.integers(1, 16),
                                        "scale": st.sampled_from((0.5, 2.0, 5.0))}),
        tolerance="4.8e-4 plus 8 u (|a| + 0.1 |a|^3 + 1) |a| of rounding",
        ops=("gelu_forward",), fn=_gelu_erf),
    Identity(
        name="attention_sliding_window", topic="attention",
        statement="With a sliding window W, query t at position p reads only keys p - W + 1..p: "
                  "its output is causal attention over those keys alone (core code: the op "
                  "with window, which the backends leave to the reference).",
        equation=r"\mathrm{attn}_W(Q, K, V)_t = \mathrm{attn}(q_t, K_{p-W+1:p+1}, "
                 r"V_{p-W+1:p+1})",
        strategy=st.builds(lambda c, w: {**c, "window": w}, ids.attention_cases(),
                           st.integers(1, 6)),
        tolerance="attention_bound of the windowed call",
        ops=(), fn=_window),
    Identity(
        name="attention_packed_rows_equal_alone", topic="attention",
        statement="A row packed from several examples attends within each example only: each "
                  "example's output equals its causal attention alone, and its positions "
                  "restart at 0 (core code: segments and segment_positions).",
        equation=r"\mathrm{attn}(Q, K, V; \sigma)_{a:b} = \mathrm{attn}(Q_{a:b}, K_{a:b}, "
                 r"V_{a:b}), \ m_t = t - a",
        strategy=st.builds(lambda c, n: {**c, "lengths": n}, ids.attention_cases(),
                           st.lists(st.integers(1, 4), min_size=1, max_size=4)),
        tolerance="attention_bound; the positions exactly",
        ops=(), fn=_packed),
    Identity(
        name="sinusoidal_positions_known", topic="notes",
        statement="With D = 8 and base 10^4 the sinusoidal positions are sin and cos of p, "
                  "p / 10, p / 100 and p / 1000 (core code).",
        equation=r"P_{p, 2i} = \sin(p\, 10^{-i}), \ P_{p, 2i+1} = \cos(p\, 10^{-i})",
        strategy=st.fixed_dictionaries({"start": st.integers(0, 3000), "T": st.integers(1, 6)}),
        tolerance="u + (4p + 8) u64: the cast to the dtype and the float64 angle p 10^-i",
        ops=(), fn=_sinusoidal_known),
    Identity(
        name="batchnorm_running_statistics", topic="notes",
        statement="A training step of BatchNorm normalises each channel over the batch (and "
                  "spatial) axes and moves the running mean and (unbiased) variance by the "
                  "momentum (0.1 by default); inference normalises with them, each row on its "
                  "own.",
        equation=r"m \leftarrow (1 - a) m + a \mu, \ v \leftarrow (1 - a) v + a \sigma^2 "
                 r"\tfrac{n}{n - 1}, \ y = (x - m) / \sqrt{v + \epsilon}\, g + b",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(2, 6),
                                        "C": st.integers(1, 5),
                                        "spatial": st.lists(st.integers(1, 3), max_size=2),
                                        "momentum": st.sampled_from((None, 0.5, 1.0))}),
        tolerance="4 (n + 8) u times the terms of each statistic and of the training output "
                  "(n values per channel); 8u times those of the inference output",
        ops=(), fn=_batchnorm_statistics),
]
