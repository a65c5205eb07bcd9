r"""Optimisation: AdamW with decoupled weight decay, global-norm gradient clipping and the
learning-rate schedule (linear warmup, then cosine decay).

Everything is written against the array module of the parameters (NumPy or CuPy), and updates the
parameter arrays **in place**, so a :class:`~minillama.model.transformer.Transformer` whose
``params`` dict is handed to :class:`AdamW` sees the new weights without copying.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.ops import array_module
from minillama.core.quant import QuantMatrix


def is_norm_gain(name: str) -> bool:
    """True for the norm gains (``*norm.weight``) and LayerNorm biases (``*norm.bias``), which
    are never weight-decayed."""
    return name.endswith(("norm.weight", "norm.bias"))


def is_embedding(name: str) -> bool:
    """True for the token embedding (which is also the output head when tied)."""
    return name == "tok_embeddings.weight"


class AdamW:
    r"""Adam with decoupled weight decay (Loshchilov & Hutter, 2019), as in ``torch.optim.AdamW``.

    For every parameter w with gradient \bar{w}, at step it = 1, 2, ... and learning rate \eta_{it}
    (docs/MATH.md section 9d):

    .. math::

        w &\leftarrow w - \eta_{it} \lambda w \qquad\text{(only where decay applies)}\\
        m_w &\leftarrow \beta_1 m_w + (1 - \beta_1) \bar{w} \\
        v_w &\leftarrow \beta_2 v_w + (1 - \beta_2) \bar{w}^2 \\
        w &\leftarrow w - \frac{\eta_{it}}{1 - \beta_1^{it}}
                  \frac{m_w}{\sqrt{v_w} / \sqrt{1 - \beta_2^{it}} + \epsilon_{adam}}

    ``params``: dict name -> array (any shape; NumPy or CuPy), updated in place.
    ``weight_decay`` \lambda is skipped for the names where ``no_decay(name)`` is true; by default
    the RMSNorm gains, plus the embedding when ``decay_embeddings`` is false.
    The state (``m``, ``v`` per parameter and the step count it, ``self.t``) round-trips through
    :meth:`state_dict` / :meth:`load_state_dict` for checkpoints.
    ``backend`` (optional): when it provides a fused ``adamw_update(p, g, m, v, lr, beta1, beta2,
    eps, wd, t)`` (the CuPy and Numba backends do), each parameter is updated by that one kernel
    instead of the array expressions below; the math is the same. Without it, NumPy parameters
    are updated through one reusable scratch buffer (no temporaries).
    """

    def __init__(self, params: dict[str, Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, no_decay: Callable[[str], bool] | None = None,
                 decay_embeddings: bool = True, backend=None):
        if not params:
            raise MinillamaError("AdamW needs at least one parameter")
        frozen = [k for k, p in params.items() if isinstance(p, QuantMatrix)]
        if frozen:
            raise MinillamaError(f"cannot train {frozen[0]}: it is a quantized "
                                 f"{params[frozen[0]].qtype} matrix, which stays frozen; train "
                                 f"from a float checkpoint")
        b1, b2 = (float(b) for b in betas)
        for label, val, lo, hi in (("lr", lr, 0.0, math.inf), ("beta1", b1, 0.0, 1.0),
                                   ("beta2", b2, 0.0, 1.0), ("eps", eps, 0.0, math.inf),
                                   ("weight_decay", weight_decay, 0.0, math.inf)):
            if not (lo <= float(val) < hi) or (label == "eps" and val <= 0):
                raise MinillamaError(f"AdamW {label} out of range: {val!r}")
        self.params = params
        self.lr = float(lr)
        self.betas = (b1, b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        if no_decay is None:
            if decay_embeddings:
                no_decay = is_norm_gain
            else:
                def no_decay(name: str) -> bool:
                    return is_norm_gain(name) or is_embedding(name)
        self.no_decay = no_decay
        self.decays = {k: not no_decay(k) for k in params}
        self._fused = backend.adamw_update if backend is not None else None
        self._scratch = None
        self.t = 0
        self.m = {k: array_module(p).zeros_like(p) for k, p in params.items()}
        self.v = {k: array_module(p).zeros_like(p) for k, p in params.items()}

    def step(self, grads: dict[str, Any], lr: float | None = None) -> None:
        r"""One update of every parameter w from its gradient \bar{w} in ``grads`` (same names
        and shapes), in place, at step it = ``self.t`` (counted from 1) and rate \eta_{it}:

        w \leftarrow w (1 - \eta_{it} \lambda),
        m_w \leftarrow \beta_1 m_w + (1 - \beta_1) \bar{w},
        v_w \leftarrow \beta_2 v_w + (1 - \beta_2) \bar{w} \odot \bar{w},
        w \leftarrow w - \eta_{it} / (1 - \beta_1^{it}) \cdot
        m_w / (\sqrt{v_w} / \sqrt{1 - \beta_2^{it}} + \epsilon_{adam}).

        w, \bar{w}, m_w, v_w: (the parameter's shape). ``lr`` overrides the learning rate for this
        step (the schedule :func:`lr_at` passes it here)."""
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise MinillamaError(f"AdamW.step: no gradient for {missing[0]}")
        eta = self.lr if lr is None else float(lr)
        b1, b2 = self.betas
        self.t += 1
        bc1 = 1.0 - b1 ** self.t
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.t)
        step_size = eta / bc1
        for k, p in self.params.items():
            g = grads[k]
            if g.shape != p.shape:
                raise MinillamaError(f"AdamW.step: gradient {k} has shape {g.shape}, "
                                     f"parameter has {p.shape}")
            xp = array_module(p)
            m, v = self.m[k], self.v[k]
            wd = self.weight_decay if self.decays[k] else 0.0
            if self._fused is not None:
                self._fused(p, g, m, v, eta, b1, b2, self.eps, wd, self.t)
            elif xp is np:
                self._numpy_update(p, g, m, v, eta * wd, b1, b2, bc2_sqrt, step_size)
            else:
                if wd:
                    p *= 1.0 - eta * wd
                m *= b1
                m += (1.0 - b1) * g
                v *= b2
                v += (1.0 - b2) * (g * g)
                denom = xp.sqrt(v)
                denom /= bc2_sqrt
                denom += self.eps
                upd = m / denom
                upd *= step_size
                p -= upd

    def _numpy_update(self, p, g, m, v, decay, b1, b2, bc2_sqrt, step_size) -> None:
        """The update above for NumPy arrays with no temporaries: every intermediate goes
        through one reusable scratch buffer (as large as the largest parameter)."""
        n = p.size
        if self._scratch is None or self._scratch.size < n or self._scratch.dtype != p.dtype:
            self._scratch = np.empty(max(n, max(a.size for a in self.params.values())),
                                     dtype=p.dtype)
        tmp = self._scratch[:n].reshape(p.shape)
        if decay:
            p *= 1.0 - decay
        m *= b1
        np.multiply(g, 1.0 - b1, out=tmp)
        m += tmp
        v *= b2
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp *= 1.0 / bc2_sqrt
        tmp += self.eps
        np.divide(m, tmp, out=tmp)
        tmp *= step_size
        p -= tmp

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"step": t, "m": {name: array}, "v": {name: array}}`` (the arrays themselves)."""
        return {"step": self.t, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; names and shapes must match the parameters."""
        try:
            t, ms, vs = int(state["step"]), state["m"], state["v"]
        except (KeyError, TypeError, ValueError):
            raise MinillamaError("optimizer state needs 'step', 'm' and 'v'") from None
        if t < 0:
            raise MinillamaError(f"optimizer step count must be >= 0, got {t}")
        for slot, src in (("m", ms), ("v", vs)):
            for k, p in self.params.items():
                if k not in src:
                    raise MinillamaError(f"optimizer state lacks {slot} for {k}")
                if tuple(src[k].shape) != tuple(p.shape):
                    raise MinillamaError(f"optimizer state {slot}.{k} has shape "
                                         f"{tuple(src[k].shape)}, parameter has {tuple(p.shape)}")
        for k, p in self.params.items():
            xp = array_module(p)
            self.m[k] = xp.asarray(ms[k], dtype=p.dtype).copy()
            self.v[k] = xp.asarray(vs[k], dtype=p.dtype).copy()
        self.t = t


def global_grad_norm(grads: dict[str, Any]) -> float:
    r"""\lVert g \rVert_2 = \sqrt{\sum_i \sum_j g_{ij}^2} over every gradient array (a float)."""
    total = 0.0
    for g in grads.values():
        xp = array_module(g)
        flat = g.reshape(-1)
        total += float(xp.dot(flat, flat))
    return math.sqrt(total) if math.isfinite(total) else total


def clip_grad_norm(grads: dict[str, Any], max_norm: float) -> float:
    r"""Scale all gradients in place so their global norm is at most ``max_norm``.

    With n = \lVert g \rVert_2 (see :func:`global_grad_norm`) every gradient becomes
    g \cdot \min(1, \mathrm{max\_norm} / (n + 10^{-6})), as ``torch.nn.utils.clip_grad_norm_``.
    Returns n, the norm *before* clipping (NaN/Inf norms are returned without scaling).
    ``max_norm`` <= 0 disables clipping (the norm is still returned).
    """
    norm = global_grad_norm(grads)
    if max_norm and max_norm > 0 and math.isfinite(norm):
        coef = float(max_norm) / (norm + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g *= coef
    return norm


def lr_at(step: int, max_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    r"""The learning rate \eta_{it} of step it = ``step`` + 1 (``step`` counts from 0): linear
    warmup,
    then a half cosine down to ``min_lr`` (docs/MATH.md section 9d).

    .. math::

        \eta_{it} = \begin{cases}
          \eta_{max}\, it / it_{warm} & it \le it_{warm} \\
          \eta_{min} + \tfrac12 (\eta_{max} - \eta_{min})(1 + \cos(\pi\, \mathrm{prog}_{it})),\;
            \mathrm{prog}_{it} = \frac{it - 1 - it_{warm}}{\max(1, it_{end} - it_{warm})}
            & it_{warm} < it \le it_{end} \\
          \eta_{min} & it > it_{end}
        \end{cases}

    with \eta_{max} = ``max_lr``, \eta_{min} = ``min_lr``, it_{warm} = ``warmup`` and
    it_{end} = ``total`` steps.
    """
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * p))
