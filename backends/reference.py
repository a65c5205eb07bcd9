"""The ``reference`` backend: NumPy arrays and the plain ops of :mod:`minillama.core.ops`,
nothing else.

No threads, no BLAS or allocator tuning: ``minillama generate --backend reference`` runs the math
exactly as ``minillama/core/ops.py`` writes it. The other backends derive from this class and
override only the op pairs they make faster (``numpy`` and ``numba`` on the CPU, ``cupy`` on a GPU).
"""

from __future__ import annotations

import contextlib

import numpy as np

from minillama.core import notes_ops, ops
from minillama.core.quant import QuantMatrix


class ReferenceBackend:
    """NumPy on the CPU, every op straight from :mod:`minillama.core.ops`."""

    name = "reference"
    device = "cpu"

    def __init__(self) -> None:
        self.xp = np

    # the named ops (forward and backward side by side, as in minillama.core.ops)
    embedding_forward = staticmethod(ops.embedding_forward)
    embedding_backward = staticmethod(ops.embedding_backward)
    linear_forward = staticmethod(ops.linear_forward)
    linear_backward = staticmethod(ops.linear_backward)
    lora_forward = staticmethod(ops.lora_forward)
    lora_backward = staticmethod(ops.lora_backward)
    bias_forward = staticmethod(ops.bias_forward)
    bias_backward = staticmethod(ops.bias_backward)
    rmsnorm_forward = staticmethod(ops.rmsnorm_forward)
    rmsnorm_backward = staticmethod(ops.rmsnorm_backward)
    rope_forward = staticmethod(ops.rope_forward)
    rope_backward = staticmethod(ops.rope_backward)
    attention_forward = staticmethod(ops.attention_forward)
    attention_backward = staticmethod(ops.attention_backward)
    swiglu_forward = staticmethod(ops.swiglu_forward)
    swiglu_backward = staticmethod(ops.swiglu_backward)
    cross_entropy_forward = staticmethod(ops.cross_entropy_forward)
    cross_entropy_backward = staticmethod(ops.cross_entropy_backward)
    linear_cross_entropy_forward = staticmethod(ops.linear_cross_entropy_forward)
    linear_cross_entropy_backward = staticmethod(ops.linear_cross_entropy_backward)
    # the notes' other pieces (model variants, cross/latent attention): reference code everywhere
    layernorm_forward = staticmethod(notes_ops.layernorm_forward)
    layernorm_backward = staticmethod(notes_ops.layernorm_backward)
    gelu_forward = staticmethod(notes_ops.gelu_forward)
    gelu_backward = staticmethod(notes_ops.gelu_backward)
    relu_forward = staticmethod(notes_ops.relu_forward)
    relu_backward = staticmethod(notes_ops.relu_backward)
    cross_attention_forward = staticmethod(notes_ops.cross_attention_forward)
    cross_attention_backward = staticmethod(notes_ops.cross_attention_backward)
    logit_scale_forward = staticmethod(notes_ops.logit_scale_forward)
    logit_scale_backward = staticmethod(notes_ops.logit_scale_backward)

    # a LoRA step's frozen weights: only the input gradient (a fast backend skips dW)
    def linear_backward_input(self, dy, ctx):
        r"""dx = dy W of :meth:`linear_backward` alone, W frozen (ctx from :meth:`linear_forward`;
        only its W is read). dy: (..., out). Returns dx (..., in)."""
        w = ctx[1]
        if isinstance(w, QuantMatrix):
            return self.linear_backward(dy, ctx)[0]  # a quantized W has no dW anyway
        return (dy.reshape(-1, dy.shape[-1]) @ w).reshape(*dy.shape[:-1], w.shape[1])

    def linear_cross_entropy_backward_input(self, dloss, ctx):
        r"""dx of :meth:`linear_cross_entropy_backward` alone, the head W frozen. Returns
        dx (N, D)."""
        return self.linear_cross_entropy_backward(dloss, ctx)[0]

    # helpers
    def asarray(self, a, dtype=None):
        """Move/convert ``a`` to this backend's array type (a :class:`QuantMatrix` stays as it
        is: its blocks are the weight)."""
        if isinstance(a, QuantMatrix):
            return a
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """A NumPy copy/view of ``a`` on the host."""
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    #: the bitwise identities of :mod:`minillama.identities.invariance` this backend keeps
    #: ("batch", "prefix_cache", "threads", "prefill_decode"): none here, whose NumPy products
    #: follow the BLAS library's blocking for the shapes at hand
    invariance: frozenset[str] = frozenset()

    def threads(self, n: int):
        """A context manager running this backend's ops on ``n`` threads in its ``with`` block
        (the reference has no pools of its own: nothing changes)."""
        return contextlib.nullcontext()

    def decode_threads(self, B: int):
        """A context manager around one cached decode step of B sequences (the model's per-op
        path at T = 1): a backend with thread pools picks their size for the step there. The
        reference has none."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"<minillama backend {self.name}>"


# the loss head composed of a backend's own linear and cross-entropy ops (bound as methods by the
# backends that have fast versions of those two but no fused head: cupy, mixed precision)
def composed_linear_cross_entropy_forward(self, x, w, targets, ignore_index: int = -1):
    r"""z = x W^T, L = CE(z, y) (:func:`minillama.core.ops.linear_cross_entropy_forward`) through
    ``self.linear_forward`` and ``self.cross_entropy_forward``. x: (N, D); w: (V, D);
    targets: (N,). Returns (0-d loss, ctx)."""
    z, c_lin = self.linear_forward(x, w)
    loss, c_ce = self.cross_entropy_forward(z, targets, ignore_index)
    return loss, (c_lin, c_ce)


def composed_linear_cross_entropy_backward(self, dloss, ctx):
    r"""dx = \bar{z} W, dW = \bar{z}^T x with \bar{z} from ``self.cross_entropy_backward``.
    Returns (dx (N, D), dW (V, D))."""
    c_lin, c_ce = ctx
    return self.linear_backward(self.cross_entropy_backward(dloss, c_ce), c_lin)
