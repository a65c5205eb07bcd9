r"""What every identity shares: the :class:`Identity` record, the :class:`Subject` an identity
checks (a backend, or a user's function, seen as NumPy arrays in one float dtype), and the
float error model the tolerances follow.

The error model. With u the unit roundoff of the dtype (2^{-53} in float64, 2^{-24} in float32),
a sum of n terms computed in floating point is within about n u \sum |terms| of the exact sum,
whatever order it is taken in. Two implementations of one equation may differ by twice that.
Every tolerance here is such a bound: a small constant times u times the sum of the absolute
values of what the result is made from (never times the result itself, which can cancel to
almost nothing), so an identity holds for every input its strategy draws, in either dtype.
A check returns the worst ratio of the error to its tolerance over the example; at most 1 passes.
A contrast (two things that must differ) returns floor / difference, the floor well above the
rounding tolerance, so a difference lost in rounding fails too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minillama.backends import complete
from minillama.core.rope_scaling import rope_tables
from minillama.model.transformer import Transformer

#: the backend ops a Transformer forward of the default config calls (attention_backward is read
#: beside its forward even when only the forward runs)
MODEL_FORWARD_OPS = ("embedding_forward", "rmsnorm_forward", "linear_forward", "rope_forward",
                     "attention_forward", "attention_backward", "swiglu_forward")
#: and what :meth:`Transformer.loss_and_grads` adds
MODEL_TRAIN_OPS = MODEL_FORWARD_OPS + (
    "embedding_backward", "rmsnorm_backward", "linear_backward", "rope_backward",
    "swiglu_backward", "linear_cross_entropy_forward", "linear_cross_entropy_backward")

@dataclass(frozen=True)
class Identity:
    """One identity of the catalog.

    ``check(subject, example)`` returns the worst error / tolerance ratio over one example drawn
    from ``strategy`` (a dict of sizes and a seed; the arrays are built from the seed), at most 1
    when the identity holds. ``ops`` are the backend ops it calls: a backend without one of them
    is skipped. ``tolerance`` says in one line what the tolerance is and why.
    """

    name: str
    topic: str
    statement: str
    equation: str
    strategy: Any
    tolerance: str
    ops: tuple[str, ...]
    fn: Callable[[Subject, dict], float] = field(repr=False)
    #: whether ``check_attention`` & co. run it on a user's function (False: it calls the
    #: backend op with arguments a user's function does not take)
    for_functions: bool = True
    #: a bitwise identity (tolerance zero): the name of the promise a backend lists in its
    #: ``invariance`` set to be held to it (:mod:`minillama.identities.invariance`); None for
    #: the identities checked against a rounding tolerance
    exact: str | None = None

    def promised(self, subject) -> bool:
        """Whether ``subject``'s backend promises this bitwise identity (always True for one
        with a tolerance)."""
        if self.exact is None:
            return True
        return self.exact in complete(as_subject(subject).backend).invariance

    def missing(self, subject) -> list[str]:
        """The ops of :attr:`ops` that ``subject`` (a :class:`Subject` or a backend) lacks."""
        subject = as_subject(subject)
        return [op for op in self.ops if not subject.has(op)]

    def check(self, backend, example: dict, dtype=np.float64) -> float:
        """The worst error / tolerance ratio of ``example`` on ``backend`` (a backend object or a
        :class:`Subject`), computed in ``dtype``; at most 1 when the identity holds."""
        return float(self.fn(as_subject(backend, dtype), example))


class Subject:
    """A backend as the identities see it: NumPy arrays in and out, every array in ``dtype``.

    Each method calls one backend op (``<op>_forward``) and returns its output on the host as
    float64 (an integer or float for a loss). :meth:`has` says whether the backend has an op; a
    user's functions are checked through :class:`minillama.identities.user.CallableSubject`.
    A backend that lacks the helpers or the optional abilities (a user's bare class) is held
    with them (:func:`with_helpers`).
    """

    #: which entries RoPE rotates together: "interleaved" (2i, 2i + 1) or "half" (i, i + hd/2)
    rope_layout = "interleaved"
    #: the RoPE base a subject's own rotation uses (a user's function: ``check_rope``'s theta);
    #: None for a backend, whose tables the identities build for the base they draw
    rope_theta: float | None = None

    def __init__(self, backend, dtype=np.float64):
        self.backend = with_helpers(backend)
        self.dtype = np.dtype(dtype)
        #: the unit roundoff u of the dtype
        self.u = float(np.finfo(self.dtype).eps) / 2

    def __repr__(self) -> str:
        return f"<identities subject {self.backend.name!r} {self.dtype}>"

    def has(self, op: str) -> bool:
        return callable(getattr(self.backend, op, None))

    # --- moving arrays ------------------------------------------------------------------------
    def put(self, a):
        """``a`` in the subject's dtype on the backend (C-contiguous)."""
        return self.backend.asarray(np.ascontiguousarray(a, dtype=self.dtype), dtype=self.dtype)

    def get(self, a) -> np.ndarray:
        """A backend array as float64 on the host."""
        return np.asarray(self.backend.to_numpy(a), dtype=np.float64)

    def _op(self, name: str, *args):
        return self.get(getattr(self.backend, name + "_forward")(*args)[0])

    # --- the ops ------------------------------------------------------------------------------
    def rope_pairs(self, x):
        """The two entries of every rotated pair of x (..., hd): two (..., hd/2) arrays."""
        if self.rope_layout == "half":
            return x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x[..., 0::2], x[..., 1::2]

    def rotate(self, x, positions, theta: float = 10000.0) -> np.ndarray:
        """RoPE of x (B, T, nh, hd) at the absolute positions (T,) ints: the backend's
        ``rope_forward`` on the rows of :func:`~minillama.core.rope_scaling.rope_tables`."""
        pos = np.asarray(positions, dtype=np.int64)
        cos, sin = rope_tables(x.shape[-1], int(pos.max()) + 1, theta, np.float64)
        return self._op("rope", self.put(x), self.put(cos[pos]), self.put(sin[pos]))

    def attention(self, q, k, v, start_pos: int = 0) -> np.ndarray:
        """Causal attention: q (B, T, H, hd); k, v (B, S, KVH, hd); queries at start_pos + t."""
        return self._op("attention", self.put(q), self.put(k), self.put(v), int(start_pos))

    def cross_attention(self, q, k, v) -> np.ndarray:
        return self._op("cross_attention", self.put(q), self.put(k), self.put(v))

    def rmsnorm(self, x, g, eps: float) -> np.ndarray:
        return self._op("rmsnorm", self.put(x), self.put(g), eps)

    def layernorm(self, x, g, b, eps: float) -> np.ndarray:
        return self._op("layernorm", self.put(x), self.put(g), self.put(b), eps)

    def cross_entropy(self, logits, targets) -> float:
        """The mean cross-entropy of logits (N, V) against targets (N,) ints."""
        t = np.asarray(targets, dtype=np.int64)
        loss, _ = self.backend.cross_entropy_forward(self.put(logits), self.backend.asarray(t))
        return float(self.get(loss))

    def linear(self, x, w) -> np.ndarray:
        """y = x W^T; W a float matrix or a :class:`~minillama.core.quant.QuantMatrix` (the
        backend's exact products, where it has a faster approximate path)."""
        be = self.backend
        # a QuantMatrix too: its blocks go to the device
        w = self.put(w) if isinstance(w, np.ndarray) else be.asarray(w, self.dtype)
        with be.exact_products():
            return self._op("linear", self.put(x), w)

    def lora(self, x, w, a, b, scale: float) -> np.ndarray:
        return self._op("lora", self.put(x), self.put(w), self.put(a), self.put(b), scale)

    # --- whole models -------------------------------------------------------------------------
    def model(self, cfg, params: dict) -> Transformer:
        """A :class:`~minillama.model.transformer.Transformer` of ``cfg`` and ``params`` on the
        backend, computing in the subject's dtype."""
        return Transformer(cfg, params, backend=self.backend, dtype=self.dtype)

    def logits(self, model, tokens, **kwargs) -> np.ndarray:
        """``model.forward(tokens, **kwargs)`` as float64 on the host."""
        return self.get(model.forward(np.asarray(tokens), **kwargs))


def as_subject(backend, dtype=np.float64) -> Subject:
    """``backend`` as a :class:`Subject` in ``dtype`` (a Subject passes through unchanged)."""
    return backend if isinstance(backend, Subject) else Subject(backend, dtype)


def with_helpers(backend):
    """``backend``, given NumPy helpers and the reference's optional abilities where it lacks
    them (:func:`minillama.backends.complete`); a backend deriving from the reference has them
    all."""
    return complete(backend)


# ---------------------------------------------------------------------------------------------
# the error model
# ---------------------------------------------------------------------------------------------
def ratio(err, tol) -> float:
    """max |err| / tol over the elements (tol broadcasts against err); NaN or inf in ``err``
    gives inf, and an element with tol 0 counts only if its error is not 0."""
    err = np.abs(np.asarray(err, dtype=np.float64))
    tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), err.shape)
    if err.size == 0:
        return 0.0
    if not np.isfinite(err).all():
        return float("inf")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(err == 0, 0.0, err / tol)
    return float(np.max(r))


def differs(diff, floor: float) -> float:
    """A contrast: ``floor`` / max |diff|; more than 1 when the two things that must differ
    differ by less than ``floor`` (or not at all, or by NaN)."""
    d = float(np.max(np.abs(np.asarray(diff, dtype=np.float64)), initial=0.0))
    if not np.isfinite(d):
        return float("inf")
    return floor / d if d > 0 else float("inf")


def dot_terms(a, b) -> np.ndarray:
    """\\sum |a_k| |b_k| over the last axis of a (..., K) against b (N, K): the sum of |terms|
    of a @ b.T, (..., N)."""
    return np.abs(a) @ np.abs(b).T


def attention_bound(q, k, v, u: float) -> np.ndarray:
    r"""The rounding bound of causal or full attention, per (b, h) (B, 1, H, 1): a score
    s = q \cdot k / \sqrt{hd} is within (hd + 2) u \sum_d |q_d k_d| / \sqrt{hd}; a
    probability within 2 of those plus (S + 4) u relatively; the output, a convex mix of the
    values, within that times max |v|. Taken over all keys of the (b, h), doubled (two
    implementations)."""
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    kk = np.repeat(np.abs(k), G, axis=2)  # (B, S, H, hd)
    vv = np.repeat(np.abs(v), G, axis=2)
    terms = np.einsum("bthd,bshd->bhts", np.abs(q), kk) / np.sqrt(hd)
    score = (hd + 2) * u * terms.max(axis=(2, 3))  # (B, H)
    vmax = vv.max(axis=(1, 3))  # (B, H)
    bound = 2 * (4 * score + (S + 4) * u) * vmax
    return bound[:, None, :, None]


def model_scale(model) -> float:
    r"""What a model's logits are made from: \sqrt{D} \max |g| \max_v \|W_v\|_2 bounds
    \sum_d |h_d W_{vd}| for the final normalised h (its rows have RMS at most \max |g|)."""
    host = model.backend.to_numpy
    g = float(np.abs(np.asarray(host(model.params["norm.weight"]), dtype=np.float64)).max())
    w = np.asarray(host(model.output_weight), dtype=np.float64)
    return float(np.sqrt(model.cfg.dim) * g * np.sqrt((w * w).sum(axis=1)).max())


def loss_bound(zmax: float, loss: float, N: int, V: int) -> float:
    """A mean cross-entropy's rounding error over u: the shift by the row maximum (|z| up to
    ``zmax``), the log of a sum of V exponentials, the mean of N rows."""
    return 8 * zmax + 4 * (V + N + 8) * (1 + abs(float(loss)))


def model_tolerance(model, S: int, u: float) -> float:
    r"""Rounding bound for two ways of computing one model's logits (cached or not, batched or
    not, grouped or repeated heads): each layer's sums have at most D + F + S terms, errors add
    over the L layers; 64 (L + 1) (D + F + S) u times :func:`model_scale`."""
    cfg = model.cfg
    return 64 * (cfg.n_layers + 1) * (cfg.dim + cfg.hidden_dim + S) * u * model_scale(model)


def contrast_floor(tol: float, scale: float) -> float:
    """The least difference a contrast must show: 10 rounding tolerances, and at least 1e-4 of
    the scale of what is compared."""
    return max(10 * tol, 1e-4 * scale)
