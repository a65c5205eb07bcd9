r"""LoRA adapters on a :class:`~minillama.model.transformer.Transformer`.

A :class:`LoRA` holds one pair (A (r, in), B (out, r)) per targeted linear weight W (out, in) of
every block; attached to a model (``model.lora = lora``) each targeted layer computes
y = x W^T + s (x A^T) B^T (:func:`minillama.core.ops.lora_forward`, s = alpha / r, or
alpha / \sqrt{r} with rsLoRA) and the backward fills only the adapters' gradients: W, the norms,
the embedding and the head stay frozen and get neither gradients nor optimizer state.

Adapter names: ``layers.{l}.{weight}.lora_A`` / ``.lora_B`` with ``{weight}`` the base weight's
name without ``.weight`` (``layers.0.attention.wq.lora_A``). Their files, as PEFT writes them, are
read and written by :mod:`minillama.io.peft`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix, dequantize

#: short target name -> (minillama weight inside a block, PEFT / transformers module name)
TARGETS = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
}


@dataclass
class LoRAConfig:
    """Rank r, alpha, the targeted linears (short names of :data:`TARGETS`), adapter-input
    dropout and rsLoRA's scale."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    dropout: float = 0.0
    rslora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """s = alpha / r, or alpha / \\sqrt{r} (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise MinillamaError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise MinillamaError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise MinillamaError(f"LoRA dropout must lie in [0, 1), got {self.dropout!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise MinillamaError(f"LoRA targets must be among {', '.join(TARGETS)}; got "
                                 f"{', '.join(bad) or 'none'}")


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q,k,v"`` -> ("q", "k", "v"); ``all`` is every target."""
    if text.strip() == "all":
        return tuple(TARGETS)
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise MinillamaError(f"--lora-targets: {', '.join(bad) or 'nothing'} is not among "
                             f"{', '.join(TARGETS)} (or all)")
    return tuple(dict.fromkeys(names))


class LoRA:
    """The adapters of one model: ``params`` {adapter name: array} on the model's backend, and
    ``targets`` {base weight name: (A name, B name)}.

    New adapters are initialised as PEFT does: A ~ U(-1/\\sqrt{in}, 1/\\sqrt{in}) (Kaiming-uniform
    with a = \\sqrt{5}), B = 0, so the adapted model starts equal to the base.
    """

    def __init__(self, model, lc: LoRAConfig, params: dict[str, Any] | None = None,
                 seed: int = 0):
        lc.validate()
        self.lc = lc
        self.cfg = model.cfg
        self.backend = model.backend
        self.training = False
        self.rng = np.random.default_rng([seed, 1])  # the dropout masks
        self.targets: dict[str, tuple[str, str]] = {}
        shapes = {}
        for layer in range(self.cfg.n_layers):
            for t in lc.targets:
                w = f"layers.{layer}.{TARGETS[t][0]}"
                out, inp = model.params[w + ".weight"].shape
                self.targets[w + ".weight"] = (w + ".lora_A", w + ".lora_B")
                shapes[w + ".lora_A"], shapes[w + ".lora_B"] = (lc.rank, inp), (out, lc.rank)
        if params is None:
            rng = np.random.default_rng(seed)
            params = {}
            for name, shape in shapes.items():
                bound = 1.0 / math.sqrt(shape[1])
                params[name] = (rng.uniform(-bound, bound, size=shape) if name.endswith("_A")
                                else np.zeros(shape))
        missing = [k for k in shapes if k not in params]
        extra = [k for k in params if k not in shapes]
        if missing or extra:
            what = "missing " + missing[0] if missing else "unexpected " + extra[0]
            raise MinillamaError(f"adapter tensors do not fit the model: {what}")
        for k, shape in shapes.items():
            if tuple(params[k].shape) != shape:
                raise MinillamaError(f"adapter {k} has shape {tuple(params[k].shape)}, the model "
                                     f"needs {shape}")
        self.params = {k: self.backend.asarray(params[k], dtype=model.dtype) for k in shapes}

    def attach(self, model) -> LoRA:
        """Make ``model`` run with these adapters (and train only them)."""
        model.lora = self
        return self

    # --- the model's hooks -------------------------------------------------------------------
    def forward(self, key: str, x, w):
        """The targeted linear ``key`` (its base weight ``w``) on x (..., in): (y, ctx)."""
        a, b = self.targets[key]
        drop = None
        p = float(self.lc.dropout)
        if self.training and p > 0:
            keep = self.rng.random(x.shape) >= p
            drop = self.backend.asarray(keep / (1.0 - p), dtype=x.dtype)
        return self.backend.lora_forward(x, w, self.params[a], self.params[b], self.lc.scale,
                                         drop)

    def backward(self, key: str, dy, ctx, grads):
        """dy (..., out) -> dx (..., in); sets the gradients of ``key``'s A and B in ``grads``."""
        a, b = self.targets[key]
        dx, grads[a], grads[b] = self.backend.lora_backward(dy, ctx)
        return dx

    # --- merging -----------------------------------------------------------------------------
    def merged(self, params: dict[str, Any]) -> dict[str, np.ndarray]:
        """Host float copies of ``params`` with every targeted W replaced by W + s B A (weights
        kept in GGML blocks are dequantized: the merged model is a float model)."""
        host = self.backend.to_numpy
        out = {k: dequantize(v) if isinstance(v, QuantMatrix) else np.array(host(v))
               for k, v in params.items()}
        for key, (a, b) in self.targets.items():
            A = self.backend.to_numpy(self.params[a]).astype(np.float64)
            B = self.backend.to_numpy(self.params[b]).astype(np.float64)
            out[key] = (out[key] + self.lc.scale * (B @ A)).astype(out[key].dtype)
        return out
