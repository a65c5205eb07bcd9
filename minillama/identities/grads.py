r"""Gradient identities: every op's backward is the derivative of its forward.

For an op y = f(x_1, ..., x_n) with upstream gradient w (drawn N(0, 1), shaped like y) the
backward returns \bar{x}_i = (\partial f / \partial x_i)^T w. Along a direction d (drawn per
input entry, scaled to that entry's magnitude: a relative step, which stays inside the scale on
which the op bends) the scalar \varphi(t) = \langle w, f(x + t d) \rangle has
\varphi'(0) = \sum_i \langle \bar{x}_i, d_i \rangle, and its central difference
D(h) = (\varphi(h) - \varphi(-h)) / 2h, taken with the op's own forward and read in float64,
equals \varphi'(0) up to the truncation \varphi'''(0) h^2 / 6 and the forward's rounding over h.
Every identity of this module compares the two. A backward that drops a term, a factor or a
sign differs from the difference by O(1) of the gradient; rounding and truncation stay near
u^{2/3} of it.

The error model. h = u^{1/3} (the step that balances truncation and rounding). The inputs are
perturbed in the subject's dtype, so the step actually taken, (x_+ - x_-) / 2h, is read back
exactly and the backward is dotted with it: the rounding of the perturbation is no error. The
truncation is measured, not guessed: D(2h) - D(h) = \varphi''' h^2 / 2 + O(h^4), three times
the truncation of D(h), and the tolerance takes twice it. Each forward value is within u A of
the exact one, A per output entry the op's own bound (``rounding`` of each spec: a K-term sum
is within (K + 2) u \sum |terms|, an elementwise function within a few u of its value), so
\varphi is within u \sum_j |w_j| A_j + n u_{64} \sum_j |w_j| |y_j| (the host's float64 sum),
and D(h) within that over h. The backward's own rounding, K u \sum |\bar{x}| |d| with K the
number of terms a gradient entry sums, is added, with \sum |w| |y| beside \sum |\bar{x}| |d|
for a gradient that cancels (it is smaller than the difference's by about h / K). The upstream
gradient w is drawn in the subject's dtype, so the backward sees it exactly.

The ops of the backend run through the backend; the core ops without a backend entry
(BatchNorm, the two-matrix FFN, the post-norm residual, the latent array) run from
:mod:`minillama.core.notes_ops` and check core code alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from minillama.core import notes_ops
from minillama.core.quant import QuantMatrix, dequantize
from minillama.core.quantize import quantize
from minillama.core.rope_scaling import rope_tables
from minillama.identities import strategies as ids
from minillama.identities.base import Identity, Subject, attention_bound, loss_bound, ratio

U64 = float(np.finfo(np.float64).eps) / 2
_GELU_C = float(np.sqrt(2.0 / np.pi))


@dataclass(frozen=True)
class GradSpec:
    """One op's gradient identity.

    ``build(ex, rng)`` gives the forward's arguments (float64 arrays are the float inputs,
    integer arrays and plain numbers pass as they are); ``wrt`` names, for each value the
    backward returns, the argument it is the gradient of (None: a value not checked);
    ``rounding(args, y)`` is A, the forward's rounding bound over u per output entry (args in
    float64); ``core``: call :mod:`minillama.core.notes_ops` (the notes' ops no backend carries)
    rather than the backend."""

    op: str
    statement: str
    equation: str
    strategy: object
    build: Callable
    wrt: tuple
    rounding: Callable
    backward: str = ""
    core: bool = False
    rounding_text: str = ""

    @property
    def backward_name(self) -> str:
        return self.backward or self.op + "_backward"


class _Calls:
    """The forward and backward of one spec on one subject, NumPy float64 in and out."""

    def __init__(self, s: Subject, spec: GradSpec):
        self.s, self.spec = s, spec
        src = notes_ops if spec.core else s.backend
        self.fwd = getattr(src, spec.op + "_forward")
        self.bwd = getattr(src, spec.backward_name)

    def put(self, a):
        if isinstance(a, QuantMatrix) and not self.spec.core:  # its blocks go to the device
            return self.s.backend.asarray(a, self.s.dtype)
        if not isinstance(a, np.ndarray):
            return a
        if a.ndim == 0:  # an upstream scalar: a 0-d array in the dtype (not a (1,) array)
            asarray = np.asarray if self.spec.core else self.s.backend.asarray
            return asarray(a, dtype=self.s.dtype)
        if self.spec.core:
            return np.ascontiguousarray(a, dtype=self.s.dtype) if a.dtype.kind == "f" else a
        if a.dtype.kind == "f":
            return self.s.put(a)
        return self.s.backend.asarray(a)

    def get(self, a) -> np.ndarray:
        return np.asarray(a, dtype=np.float64) if self.spec.core else self.s.get(a)

    def exact(self):
        """The backend's exact products (where GGML blocks have a faster approximate path)."""
        return contextlib.nullcontext() if self.spec.core else self.s.backend.exact_products()

    def forward(self, args):
        with self.exact():
            y, ctx = self.fwd(*[self.put(a) for a in args])
        return self.get(y), ctx

    def backward(self, w, ctx) -> list:
        with self.exact():
            g = self.bwd(self.put(np.asarray(w, dtype=np.float64)), ctx)
        g = g if isinstance(g, tuple) else (g,)
        return [None if x is None else self.get(x) for x in g]


def _in_dtype(args, dtype):
    return [a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
            for a in args]


def gradient_ratio(s: Subject, spec: GradSpec, ex: dict) -> float:
    """The worst error / tolerance of ``spec``'s backward against the central difference of its
    forward, on example ``ex`` (see the module's error model)."""
    rng = np.random.default_rng([ex["seed"], 7])
    args = _in_dtype(spec.build(ex, np.random.default_rng(ex["seed"])), s.dtype)
    calls = _Calls(s, spec)
    y, ctx = calls.forward(args)
    w = np.asarray(rng.standard_normal(y.shape)).astype(s.dtype).astype(np.float64)  # exact
    grads = list(zip(spec.wrt, calls.backward(w, ctx)))
    if any(g is None and isinstance(args[i], np.ndarray) for i, g in grads if i is not None):
        return float("inf")  # no gradient for a float input
    pairs = [(i, g) for i, g in grads if i is not None and g is not None]
    if any(g.shape != args[i].shape for i, g in pairs):  # a gradient that only broadcasts
        return float("inf")
    dirs = {}
    for i, _ in pairs:
        x = np.abs(args[i].astype(np.float64))
        dirs[i] = rng.standard_normal(x.shape) * (x if x.any() else 1.0)
    h = float(np.finfo(s.dtype).eps / 2) ** (1 / 3)

    def error(step):
        """D(step) - <backward, the step actually taken>."""
        plus, minus = list(args), list(args)
        for i in dirs:
            x = args[i].astype(np.float64)
            plus[i] = (x + step * dirs[i]).astype(s.dtype)
            minus[i] = (x - step * dirs[i]).astype(s.dtype)
        yp, _ = calls.forward(plus)
        ym, _ = calls.forward(minus)
        diff = (float(np.sum(w * yp)) - float(np.sum(w * ym))) / (2 * step)
        back = sum(float(np.sum(g * (plus[i].astype(np.float64) - minus[i].astype(np.float64))))
                   for i, g in pairs) / (2 * step)
        return diff - back

    e1, e2 = error(h), error(2 * h)
    a = spec.rounding([x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f"
                       else x for x in args], y)
    phi = s.u * float(np.sum(np.abs(w) * a)) + 4 * y.size * U64 * float(np.sum(np.abs(w * y)))
    terms = y.size + sum(args[i].size for i in dirs) + 8
    back = terms * s.u * (sum(float(np.sum(np.abs(g) * np.abs(dirs[i]))) for i, g in pairs)
                          + float(np.sum(np.abs(w * y))))
    return ratio(e1, 2 * abs(e1 - e2) + 4 * phi / h + 4 * back)


# ---------------------------------------------------------------------------------------------
# the ops: arguments and the forward's rounding bound A (over u) per output entry
# ---------------------------------------------------------------------------------------------
def _n(rng, *shape):
    return rng.standard_normal(shape)


def _targets(rng, N: int, V: int, ignored: float) -> np.ndarray:
    """N targets in [0, V), each ignored (-1) with probability ``ignored``."""
    t = rng.integers(0, V, N)
    return np.where(rng.random(N) < ignored, -1, t)


def _dot_bound(x, w):
    """(K + 2) \\sum_k |x_k| |w_k|: the rounding of x W^T over u."""
    return (x.shape[-1] + 2) * (np.abs(x) @ np.abs(w).T)


def _loss_bound(z, loss, N, V):
    """:func:`~minillama.identities.base.loss_bound` of the logits z."""
    return loss_bound(float(np.abs(z).max(initial=0.0)), loss, N, V)


def _norm_bound(x, g, centred: bool):
    """A row norm's rounding over u per entry: (D + 8) (|x| (+ |mean|)) r |g|."""
    D = x.shape[-1]
    mu = x.mean(-1, keepdims=True) if centred else 0.0
    xc = x - mu
    r = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-300)
    return 4 * (D + 8) * (np.abs(x) + np.abs(mu)) * r * np.abs(g)


def _gelu_bound(a, h):
    arg = _GELU_C * (np.abs(a) + 0.044715 * np.abs(a) ** 3)
    return 0.5 * np.abs(a) * (4 * arg + 4) + 4 * np.abs(h)


def _rows(big: int):
    """Row counts: mostly 1-6, sometimes ``big``: 8192 rows of D >= 8 pass the 2^16 elements
    from which the numpy and numba row ops split over threads; 64 rows of 256 x 256 pass the
    numpy backend's threaded-GEMM thresholds (64 rows, 2^22 multiply-adds)."""
    return st.sampled_from((1, 2, 3, 4, 5, 6, big))


def _rope_args(ex, rng):
    hd, T, start = 2 * ex["half"], ex["T"], ex["start"]
    cos, sin = rope_tables(hd, start + T, 10000.0, np.float64)
    return [_n(rng, ex["B"], T, ex["H"], hd), cos[start:], sin[start:]]


def _rope_bound(args, y):
    x = args[0]
    pair = np.abs(x[..., 0::2]) + np.abs(x[..., 1::2])
    return 4 * np.repeat(pair, 2, axis=-1)


def _frozen_linear_args(ex, rng):
    """x (2, N, K) and W (M, K), or W in Q8_0 blocks (K a multiple of 32)."""
    if not ex["quant"]:
        return [_n(rng, 2, ex["N"], ex["K"]), _n(rng, ex["M"], ex["K"])]
    K = 32 * ex["K"]
    return [_n(rng, 2, ex["N"], K), quantize(_n(rng, ex["M"], K).astype(np.float32), "Q8_0")]


def _frozen_linear_bound(args, y):
    x, w = args
    return _dot_bound(x, w if isinstance(w, np.ndarray) else dequantize(w).astype(np.float64))


def _lora_args(ex, rng):
    """x (2, N, in), W, A, B, s and a dropout mask (keep 3/4, kept entries 4/3) or None."""
    N, din = ex["N"], ex["din"]
    drop = (rng.random((2, N, din)) < 0.75) / 0.75 if ex["drop"] else None
    return [_n(rng, 2, N, din), _n(rng, ex["dout"], din), _n(rng, ex["r"], din),
            _n(rng, ex["dout"], ex["r"]), ex["alpha"] / ex["r"], drop]


def _lora_bound(args, y):
    x, w, a, b, scale, drop = args
    xa = np.abs(x) if drop is None else np.abs(x * drop)
    return (w.shape[1] + a.shape[0] + 4) * (np.abs(x) @ np.abs(w).T
                                            + scale * (xa @ np.abs(a).T) @ np.abs(b).T)


def _attention_args(ex, rng):
    B, T, KVH, G, hd = ex["B"], ex["T"], ex["KVH"], ex["G"], ex["hd"]
    S = T + ex["extra"]
    return [_n(rng, B, T, KVH * G, hd), _n(rng, B, S, KVH, hd), _n(rng, B, S, KVH, hd),
            ex["extra"]]


def _attention_bound(args, y):
    return np.broadcast_to(attention_bound(*args[:3], 1.0), y.shape)


def _lce_args(ex, rng):
    N, D, V = ex["N"], ex["D"], ex["V"]
    return [_n(rng, N, D), _n(rng, V, D), _targets(rng, N, V, ex["ignored"])]


def _lce_bound(args, y):
    x, w, t = args
    z = x @ w.T
    return _loss_bound(z, y, *z.shape) + 2 * float(_dot_bound(x, w).max(initial=0.0))


def _mlp_bound(args, y):
    x, w1, w2, act = args
    a = x @ w1.T
    h = notes_ops.ACTIVATIONS[act][0](a)[0]
    ha = 1.2 * _dot_bound(x, w1) + (_gelu_bound(a, h) if act == "gelu" else 0)
    return _dot_bound(h, w2) + ha @ np.abs(w2).T


def _batchnorm_bound(args, y):
    """LayerNorm's bound with each channel's values (over the batch and spatial axes) as the
    row; x (N, C, *spatial)."""
    x, g = args[0], args[1]
    rows = np.moveaxis(x, 1, 0).reshape(x.shape[1], -1)  # (C, N L)
    bound = _norm_bound(rows, g[:, None], True).reshape(np.moveaxis(x, 1, 0).shape)
    return np.moveaxis(bound, 0, 1) + 2 * np.abs(y)


def _postnorm_args(ex, rng):
    """x, F(x), g, b (LayerNorm) or None (RMSNorm), eps. D >= 2: with D = 1 a row's sum
    x + F(x) may cancel far below the steps of x and F(x), where the norm bends within a step."""
    N, D = ex["N"], ex["D"]
    b = _n(rng, D) if ex["layernorm"] else None
    return [_n(rng, N, D), _n(rng, N, D), 1 + 0.2 * _n(rng, D), b, 1e-5]


def _postnorm_bound(args, y):
    x, fx, g, b = args[:4]
    s = x + fx
    base = _norm_bound(s, g, b is not None) * (1 + (np.abs(x) + np.abs(fx)) / (np.abs(s) + 1e-300))
    return base + (2 * np.abs(y) if b is not None else 0)


_IGNORED = st.sampled_from((0.0, 0.3, 1.0))
_ATTN = st.fixed_dictionaries({  # T = 16: the numba backend's tiled attention from there
    "seed": ids.seeds, "B": st.integers(1, 2), "T": st.sampled_from((1, 2, 3, 4, 5, 16)),
    "extra": st.integers(0, 4), "KVH": st.integers(1, 2), "G": st.integers(1, 3),
    "hd": st.sampled_from((2, 4, 8))})
_ROWS = st.fixed_dictionaries({"seed": ids.seeds, "N": _rows(8192), "D": st.integers(1, 16)})
#: rows as the model has them, (B, T, D): a leading-axis slip shows only with three axes
_ROWS3 = st.fixed_dictionaries({"seed": ids.seeds, "N": _rows(4096), "D": st.integers(1, 16)})
_ELEMENTWISE = "a few u of each output (exp, tanh, products)"

SPECS = [
    GradSpec("embedding", "the gradient of the embedding table adds each output row's "
             "gradient into the row of its token (repeated tokens add up)",
             r"\bar{E}_v = \sum_{x_{bt} = v} \bar{h}_{bt}",
             st.fixed_dictionaries({"seed": ids.seeds, "V": st.integers(1, 9),
                                    "D": st.integers(1, 8), "B": st.integers(1, 2),
                                    "T": st.integers(1, 6)}),
             lambda ex, rng: [_n(rng, ex["V"], ex["D"]),
                              rng.integers(0, ex["V"], (ex["B"], ex["T"]))],
             (0,), lambda args, y: np.zeros_like(y), rounding_text="0: a copy"),
    GradSpec("linear", "dx = dy W and dW = dy^T x", r"\bar{x} = \bar{y} W, \ "
             r"\bar{W} = \bar{y}^T x",
             st.fixed_dictionaries({"seed": ids.seeds, "N": _rows(64), "K": st.integers(1, 8),
                                    "M": st.integers(1, 8)}),
             lambda ex, rng: ([_n(rng, 64, 256), _n(rng, 256, 256)] if ex["N"] == 64
                              else [_n(rng, 2, ex["N"], ex["K"]), _n(rng, ex["M"], ex["K"])]),
             (0, 1), lambda args, y: _dot_bound(*args[:2]), rounding_text="(K + 2) |x| |W|^T"),
    GradSpec("linear", "the input gradient alone (W frozen, a float matrix or GGML blocks) "
             "is dy W", r"\bar{x} = \bar{y} W",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 6),
                                    "K": st.integers(1, 8), "M": st.integers(1, 8),
                                    "quant": st.booleans()}),
             _frozen_linear_args, (0,), _frozen_linear_bound, backward="linear_backward_input",
             rounding_text="(K + 2) |x| |W|^T"),
    GradSpec("lora", "the LoRA linear's gradients of the input and of both adapter matrices "
             "(W frozen), with and without a dropout mask",
             r"\bar{x}, \bar{A}, \bar{B} \text{ of } x W^T + s ((x \odot m) A^T) B^T",
             st.builds(lambda c, drop: {**c, "drop": drop}, ids.lora_cases(), st.booleans()),
             _lora_args, (0, 2, 3), _lora_bound,
             rounding_text="(in + r + 4) |x| (|W| + s |B| |A|)^T, the dropout mask's |m| in "
                           "the adapter's term"),
    GradSpec("rmsnorm", "RMSNorm's gradients of the input (through the shared r) and the gain",
             r"\bar{x} = r (u - \hat{x}\, \mathrm{mean}(u \hat{x})), u = \bar{y} g",
             _ROWS3, lambda ex, rng: [_n(rng, 2, ex["N"], ex["D"]) + 0.3,
                                      1 + 0.2 * _n(rng, ex["D"]), 1e-5],
             (0, 1), lambda a, y: _norm_bound(a[0], a[1], False),
             rounding_text="4 (D + 8) |x| r |g|"),
    GradSpec("rope", "RoPE's gradient is the inverse rotation",
             r"\bar{x} = R_{-m\theta} \bar{y}",
             st.fixed_dictionaries({"seed": ids.seeds, "B": st.integers(1, 2),
                                    "T": st.integers(1, 5), "H": st.integers(1, 3),
                                    "half": st.integers(1, 8), "start": st.integers(0, 300)}),
             _rope_args, (0,), _rope_bound, rounding_text="4 (|x_2i| + |x_2i+1|) per pair"),
    GradSpec("attention", "causal GQA attention's gradients of q, k and v, cached queries "
             "(start_pos > 0, T > 1) included",
             r"\bar{Q}, \bar{K}, \bar{V} \text{ of } \mathrm{softmax}(QK^T/\sqrt{hd} + M) V",
             _ATTN, _attention_args, (0, 1, 2), _attention_bound,
             rounding_text="attention_bound"),
    GradSpec("swiglu", "SwiGLU's gradients of both branches", r"\bar{a} = \bar{h} b \sigma(a)"
             r"(1 + a(1 - \sigma(a))), \ \bar{b} = \bar{h}\, \mathrm{silu}(a)",
             _ROWS, lambda ex, rng: [2 * _n(rng, ex["N"], ex["D"]), _n(rng, ex["N"], ex["D"])],
             (0, 1), lambda a, y: 16 * np.abs(y), rounding_text="16 |h|: " + _ELEMENTWISE),
    GradSpec("cross_entropy", "the mean cross-entropy's gradient of the logits, ignored "
             "targets included (their rows get none)",
             r"\bar{z}_{nv} = (p_{nv} - [v = y_n]) / |\mathcal{V}|",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 6),
                                    "V": st.integers(1, 12), "ignored": _IGNORED}),
             lambda ex, rng: [5 * _n(rng, ex["N"], ex["V"]),
                              _targets(rng, ex["N"], ex["V"], ex["ignored"])],
             (0,), lambda a, y: _loss_bound(a[0], y, *a[0].shape),
             rounding_text="8 max|z| + 4 (V + N + 8) (1 + |L|)"),
    GradSpec("linear_cross_entropy", "the loss head's gradients of the hidden rows and the "
             "head, ignored targets included",
             r"\bar{x} = \bar{z} W, \ \bar{W} = \bar{z}^T x",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 6),
                                    "D": st.integers(1, 8), "V": st.integers(1, 12),
                                    "ignored": _IGNORED}),
             _lce_args, (0, 1), _lce_bound,
             rounding_text="the loss's, plus twice the logits' (D + 2) |x| |W|^T"),
    GradSpec("linear_cross_entropy", "the loss head's input gradient alone (head frozen)",
             r"\bar{x} = \bar{z} W",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 6),
                                    "D": st.integers(1, 8), "V": st.integers(1, 12),
                                    "ignored": _IGNORED}),
             _lce_args, (0,), _lce_bound, backward="linear_cross_entropy_backward_input",
             rounding_text="the loss's, plus twice the logits' (D + 2) |x| |W|^T"),
    GradSpec("layernorm", "LayerNorm's gradients of the input, the gain and the bias",
             r"\bar{x} = r (u - \mathrm{mean}(u) - \hat{x}\, \mathrm{mean}(u \hat{x}))",
             _ROWS3, lambda ex, rng: [_n(rng, 2, ex["N"], ex["D"]), _n(rng, ex["D"]),
                                      _n(rng, ex["D"]), 1e-5],
             (0, 1, 2), lambda a, y: _norm_bound(a[0], a[1], True) + 2 * np.abs(y),
             rounding_text="4 (D + 8) (|x| + |mean|) r |g| + 2 |y|"),
    GradSpec("gelu", "GELU's (tanh form) derivative", r"\bar{a} = \bar{h}\, "
             r"\mathrm{gelu}'(a)", _ROWS, lambda ex, rng: [2 * _n(rng, ex["N"], ex["D"])],
             (0,), lambda a, y: _gelu_bound(a[0], y), rounding_text=_ELEMENTWISE),
    GradSpec("relu", "ReLU's derivative is the mask a > 0", r"\bar{a} = \bar{h} [a > 0]",
             _ROWS, lambda ex, rng: [_n(rng, ex["N"], ex["D"])],
             (0,), lambda a, y: 2 * np.abs(y), rounding_text="2 |h|"),
    GradSpec("logit_scale", "the scaled logits' gradient is the scaled upstream gradient",
             r"\bar{z} = s \bar{z}'",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                    "V": st.integers(1, 9), "scale": st.floats(0.01, 4.0)}),
             lambda ex, rng: [_n(rng, ex["N"], ex["V"]), ex["scale"]],
             (0,), lambda a, y: 2 * np.abs(y), rounding_text="2 |z'|"),
    GradSpec("cross_attention", "unmasked cross-attention's gradients of q, k and v",
             r"\bar{Q}, \bar{K}, \bar{V} \text{ of } \mathrm{softmax}(QK^T/\sqrt{hd}) V",
             st.fixed_dictionaries({"seed": ids.seeds, "B": st.integers(1, 2),
                                    "M": st.integers(1, 4), "L": st.integers(1, 5),
                                    "KVH": st.integers(1, 2), "G": st.integers(1, 2),
                                    "hd": st.sampled_from((2, 4, 8))}),
             lambda ex, rng: [_n(rng, ex["B"], ex["M"], ex["KVH"] * ex["G"], ex["hd"]),
                              _n(rng, ex["B"], ex["L"], ex["KVH"], ex["hd"]),
                              _n(rng, ex["B"], ex["L"], ex["KVH"], ex["hd"])],
             (0, 1, 2), _attention_bound, rounding_text="attention_bound"),
    GradSpec("bias", "a bias's gradient is the sum of the rows' gradients",
             r"\bar{b} = \sum_n \bar{y}_n",
             _ROWS3, lambda ex, rng: [_n(rng, 2, ex["N"], ex["D"]), _n(rng, ex["D"])],
             (1,), lambda a, y: 2 * (np.abs(a[0]) + np.abs(a[1])),
             rounding_text="2 (|y| + |b|)"),
    # the core ops without a backend entry
    GradSpec("batchnorm", "training-mode BatchNorm's gradients: every row's input gradient "
             "depends on the whole batch", r"\bar{x} = r (u - \mathrm{mean}_n(u) - \hat{x}\, "
             r"\mathrm{mean}_n(u \hat{x}))",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(2, 6),
                                    "D": st.integers(1, 6),
                                    "spatial": st.lists(st.integers(1, 3), max_size=2)}),
             lambda ex, rng: [_n(rng, ex["N"], ex["D"], *ex["spatial"]),
                              _n(rng, ex["D"]), _n(rng, ex["D"]), 1e-5],
             (0, 1, 2), _batchnorm_bound, core=True,
             rounding_text="LayerNorm's over the batch (and spatial) axes"),
    GradSpec("mlp", "the two-matrix FFN's gradients of the input and both matrices",
             r"\bar{x}, \bar{W}_1, \bar{W}_2 \text{ of } \phi(x W_1^T) W_2^T",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                    "D": st.integers(1, 6), "F": st.integers(1, 8),
                                    "act": st.just("gelu")}),  # smooth: no kink to cross
             lambda ex, rng: [_n(rng, ex["N"], ex["D"]), _n(rng, ex["F"], ex["D"]),
                              _n(rng, ex["D"], ex["F"]), ex["act"]],
             (0, 1, 2), _mlp_bound, core=True,
             rounding_text="both products' (K + 2) |a| |b|, the first carried through phi"),
    GradSpec("postnorm_residual", "the post-norm residual's gradients reach x and F(x) alike "
             "through the norm", r"\bar{x} = \bar{F} = \mathrm{Norm}'(x + F)^T \bar{y}",
             st.fixed_dictionaries({"seed": ids.seeds, "N": st.integers(1, 4),
                                    "D": st.integers(2, 8), "layernorm": st.booleans()}),
             _postnorm_args, (0, 1, 2, 3), _postnorm_bound, core=True,
             rounding_text="the norm's, the sum x + F(x) relative to its terms"),
    GradSpec("latent_expand", "the shared latent array's gradient sums the sequences'",
             r"\bar{Z} = \sum_b \bar{z}_b",
             st.fixed_dictionaries({"seed": ids.seeds, "B": st.integers(1, 4),
                                    "M": st.integers(1, 4), "D": st.integers(1, 6)}),
             lambda ex, rng: [_n(rng, ex["M"], ex["D"]), ex["B"]],
             (0,), lambda a, y: np.zeros_like(y), core=True, rounding_text="0: a copy"),
]


def _name(spec: GradSpec) -> str:
    if spec.backward:
        return spec.backward + "_gradient"
    return spec.op + "_gradient"


def _identity(spec: GradSpec) -> Identity:
    return Identity(
        name=_name(spec), topic="grad",
        statement=f"The backward of {spec.op} is the derivative of its forward: {spec.statement}; "
                  "its directional derivative equals the central difference of the forward.",
        equation=spec.equation + r", \quad \sum_i \langle \bar{x}_i, d_i \rangle = "
                 r"\frac{\langle w, f(x + h d) - f(x - h d) \rangle}{2h} + O(h^2)",
        strategy=spec.strategy,
        tolerance="2 |D(h) - D(2h)| (the measured truncation) + 4 u sum |w| A / h (the "
                  f"forward's rounding, A = {spec.rounding_text}) + the backward's K u "
                  "(sum |grad| |d| + sum |w| |y|); h = u^(1/3)",
        ops=() if spec.core else (spec.op + "_forward", spec.backward_name),
        fn=lambda s, ex, spec=spec: gradient_ratio(s, spec, ex))


IDENTITIES = [_identity(spec) for spec in SPECS]
