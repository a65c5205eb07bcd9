"""The pieces of a block that the config's variants swap, a mixin of
:class:`~minillama.model.transformer.Transformer`: the norm (RMSNorm | LayerNorm), a linear with its
optional bias and LoRA adapter, and the attention pair with a sliding window; forward first, then
each backward. It reads ``self.cfg``, ``self.backend``, ``self.params`` and ``self.lora``."""

from __future__ import annotations

import numpy as np

from minillama.core import ops
from minillama.model import packing


class VariantPieces:
    """Norm, linear and attention-pair choices for
    :class:`~minillama.model.transformer.Transformer`."""

    def _norm(self, x, name: str):
        r"""RMSNorm(x; g) or LayerNorm(x; g, b) (``cfg.norm``) with the parameters ``name``.weight
        (and ``name``.bias). x: (..., D). Returns (y, ctx)."""
        be, p, eps = self.backend, self.params, self.cfg.norm_eps
        if self.cfg.norm == "layernorm":
            return be.layernorm_forward(x, p[name + ".weight"], p[name + ".bias"], eps)
        return be.rmsnorm_forward(x, p[name + ".weight"], eps)

    def _proj(self, pre: str, name: str, x):
        """One linear layer ``pre + name`` of the block: y = x W^T (+ b when the config has that
        bias). Returns (y, ctx)."""
        be, p, key = self.backend, self.params, pre + name + ".weight"
        if self.lora is not None and key in self.lora.targets:
            y, c_w = self.lora.forward(key, x, p[key])
        else:
            y, c_w = be.linear_forward(x, p[key])
        if pre + name + ".bias" in p:
            y, _ = be.bias_forward(y, p[pre + name + ".bias"])
        return y, c_w

    def _window_keys(self, k, v, start_pos):
        """With a sliding window W and one start position p, only cached keys p - W + 1 onwards
        can be read: drop the older ones (positions shift by the same amount for queries and
        keys, so the mask is unchanged). A decode step then reads W keys, not p + 1."""
        W = self.cfg.sliding_window
        if W is None or np.ndim(start_pos) != 0 or int(start_pos) - W + 1 <= 0:
            return k, v, start_pos
        lo = int(start_pos) - W + 1
        return k[:, lo:], v[:, lo:], int(start_pos) - lo

    def _attention_ops(self, S: int):
        """The attention (forward, backward) pair for S keys: the backend's, or with a sliding
        window that hides some of them, the reference with the window (kernels lack it); packed
        rows the pair with their segment mask (:func:`minillama.model.packing.attention_ops`)."""
        W = self.cfg.sliding_window
        if self.segments is not None:
            return packing.attention_ops(self, S, W if W is not None and S > W else None)
        if W is None or S <= W:
            return self.backend.attention_forward, self.backend.attention_backward
        return (lambda q, k, v, start_pos: ops.attention_forward(q, k, v, start_pos, window=W),
                ops.attention_backward)


    def _norm_backward(self, dy, ctx, name: str, grads):
        """Gradient of :meth:`_norm`: returns dx and fills the ``name`` gain (and bias) gradient."""
        be = self.backend
        if self.cfg.norm == "layernorm":
            dx, grads[name + ".weight"], grads[name + ".bias"] = be.layernorm_backward(dy, ctx)
        else:
            dx, grads[name + ".weight"] = be.rmsnorm_backward(dy, ctx)
        return dx

    def _proj_backward(self, pre: str, name: str, dy, ctx, grads):
        """Gradient of :meth:`_proj`: dy (..., out) -> dx (..., in); fills its weight (and bias)
        gradients."""
        if pre + name + ".bias" in self.params:
            grads[pre + name + ".bias"] = self.backend.bias_backward(dy, None)
        key = pre + name + ".weight"
        if self.lora is not None:  # the base weights are frozen: no dW
            if key in self.lora.targets:
                return self.lora.backward(key, dy, ctx, grads)
            return self.backend.linear_backward_input(dy, ctx)
        dx, grads[key] = self.backend.linear_backward(dy, ctx)
        return dx
