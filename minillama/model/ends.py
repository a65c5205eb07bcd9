"""The two ends of the stack, a mixin of :class:`~minillama.model.transformer.Transformer`: the
embedding (with sinusoidal positions when the config has them) and the head (final norm, output
matrix or the tied embedding, logit scale), forward first, then each backward. It reads
``self.cfg``, ``self.backend``, ``self.params`` and the position table ``self.pos_table``."""

from __future__ import annotations

import math


class EndsWiring:
    """The embedding and the head, forward and backward, of
    :class:`~minillama.model.transformer.Transformer`."""

    def _embed(self, tok, start_pos=0):
        r"""h_0 = E_{\mathrm{tok}}: (B, T) ids -> (B, T, D). With sinusoidal positions, as in the
        vanilla transformer, h_0 = \sqrt{D}\, E_{\mathrm{tok}} + E^{pos}_m at the positions m
        (E^{pos} is fixed; without the \sqrt{D} the unit-amplitude E^{pos} drowns embeddings of
        std 0.02). Returns (h_0, ctx)."""
        h, ctx = self.backend.embedding_forward(self.params["tok_embeddings.weight"],
                                                self.backend.asarray(tok))
        h = h.astype(self.dtype, copy=False)  # a quantized table's rows come as float32
        if self.cfg.pos_encoding == "sinusoidal":
            h = h * math.sqrt(self.cfg.dim) + self.pos_table[self._positions(start_pos,
                                                                               tok.shape[1])]
        return h, ctx

    def _head(self, x):
        r"""z = s\, \mathrm{Norm}(x; g) W_{out}^T (s = ``cfg.logit_scale``, skipped when 1):
        (..., D) -> (..., V). Returns (z, ctx)."""
        be = self.backend
        hn, c_n = self._norm(x, "norm")
        logits, c_out = be.linear_forward(hn, self.output_weight)
        c_s = None
        if self.cfg.logit_scale != 1.0:
            logits, c_s = be.logit_scale_forward(logits, self.cfg.logit_scale)
        return logits, (c_n, c_out, c_s)

    def _head_backward(self, dlogits, ctx, grads):
        """dz (B, T, V) -> dx (B, T, D); sets the final norm's gradients, returns (dx, dW_out)."""
        c_n, c_out, c_s = ctx
        if c_s is not None:
            dlogits = self.backend.logit_scale_backward(dlogits, c_s)
        if self.lora is not None:  # a frozen head
            dhn, dw_out = self.backend.linear_backward_input(dlogits, c_out), None
        else:
            dhn, dw_out = self.backend.linear_backward(dlogits, c_out)
        return self._norm_backward(dhn, c_n, "norm", grads), dw_out

    def _embed_backward(self, dx, ctx, dw_out, grads) -> None:
        r"""Scatter dx (B, T, D) into dE (V, D) (times \sqrt{D} with sinusoidal positions); a tied
        head adds its dW_out to the same matrix."""
        if self.cfg.pos_encoding == "sinusoidal":
            dx = dx * math.sqrt(self.cfg.dim)
        d_emb = self.backend.embedding_backward(dx, ctx)  # None for a quantized (frozen) table
        if self.cfg.tie_embeddings:
            if d_emb is not None:
                d_emb += dw_out  # the tied matrix collects both gradients
        else:
            grads["output.weight"] = dw_out
        grads["tok_embeddings.weight"] = d_emb
