"""One residual block's wiring, a mixin of :class:`~minillama.model.transformer.Transformer`: the
attention and FFN sublayers and the block (pre-norm or post-norm), forward first, then the backward
of each in reverse. The single pieces (norm, linear, attention pair) come from
:class:`~minillama.model.variants.VariantPieces`."""

from __future__ import annotations


class BlockWiring:
    """The forward and backward of one block for
    :class:`~minillama.model.transformer.Transformer`."""

    def _attention_sublayer(self, layer: int, h, cos, sin, cache, start_pos):
        r"""\mathrm{Attn}(h) = \mathrm{attn}(\mathrm{RoPE}(h W_q^T), \mathrm{RoPE}(h W_k^T),
        h W_v^T)\, W_o^T (rows; no RoPE when ``cos`` is None), h the block's (pre-norm:
        normalised, \hat{h} in docs/MATH.md) input.

        h: (B, T, D). With a ``cache`` the new K/V are written at ``start_pos`` and attention reads
        every cached position. Returns the branch output (B, T, D) (not yet added to x) and ctx.
        """
        be, cfg = self.backend, self.cfg
        pre = f"layers.{layer}."
        B, T, _ = h.shape
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, c_q = self._proj(pre, "attention.wq", h)
        k, c_k = self._proj(pre, "attention.wk", h)
        v, c_v = self._proj(pre, "attention.wv", h)
        q, k = q.reshape(B, T, H, hd), k.reshape(B, T, KVH, hd)
        c_rq = c_rk = None
        if cos is not None:
            q, c_rq = be.rope_forward(q, cos, sin)  # (B, T, H, hd)
            k, c_rk = be.rope_forward(k, cos, sin)  # (B, T, KVH, hd)
        v = v.reshape(B, T, KVH, hd)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)  # (B, S, KVH, hd)
            k, v, start_pos = self._window_keys(k, v, start_pos)
        att_forward, att_backward = self._attention_ops(k.shape[1])
        a, c_att = att_forward(q, k, v, start_pos)
        o, c_o = self._proj(pre, "attention.wo", a.reshape(B, T, H * hd))
        return o, (c_q, c_k, c_v, c_rq, c_rk, (att_backward, c_att), c_o)

    def _ffn_sublayer(self, layer: int, n):
        r"""\mathrm{FFN}(\hat{h}) = (\mathrm{silu}(\hat{h} W_1^T) \odot \hat{h} W_3^T) W_2^T
        (SwiGLU),
        or the two-matrix \mathrm{act}(\hat{h} W_1^T) W_2^T with \mathrm{act} = GELU or ReLU
        (``cfg.ffn``); rows, \hat{h} the normalised input (the argument ``n``).

        n: (B, T, D). Returns the branch output (B, T, D) (not yet added to x) and ctx.
        """
        be, ffn = self.backend, self.cfg.ffn
        pre = f"layers.{layer}."
        a1, c_1 = self._proj(pre, "feed_forward.w1", n)  # (B, T, F)
        if ffn == "swiglu":
            b3, c_3 = self._proj(pre, "feed_forward.w3", n)  # (B, T, F)
            g, c_act = be.swiglu_forward(a1, b3)
        else:
            c_3 = None
            g, c_act = getattr(be, ffn + "_forward")(a1)
        f, c_2 = self._proj(pre, "feed_forward.w2", g)   # (B, T, D)
        return f, (c_1, c_3, c_act, c_2)

    def _block_forward(self, layer: int, x, cos, sin, cache, start_pos):
        """One residual block. Pre-norm (LLaMA): a = x + Attn(Norm(x)), x' = a + FFN(Norm(a)).
        Post-norm (the original transformer): a = Norm(x + Attn(x)), x' = Norm(a + FFN(a)).

        x: (B, T, D). Returns (x', ctx) with ctx = (norm 1, attention, norm 2, FFN ctx)."""
        pre = f"layers.{layer}."
        if self.cfg.norm_position == "pre":
            h, c_n1 = self._norm(x, pre + "attention_norm")
            o, c_attn = self._attention_sublayer(layer, h, cos, sin, cache, start_pos)
            x = x + o
            h, c_n2 = self._norm(x, pre + "ffn_norm")
            f, c_ffn = self._ffn_sublayer(layer, h)
            return x + f, (c_n1, c_attn, c_n2, c_ffn)
        o, c_attn = self._attention_sublayer(layer, x, cos, sin, cache, start_pos)
        x, c_n1 = self._norm(x + o, pre + "attention_norm")
        f, c_ffn = self._ffn_sublayer(layer, x)
        x, c_n2 = self._norm(x + f, pre + "ffn_norm")
        return x, (c_n1, c_attn, c_n2, c_ffn)

    def _ffn_sublayer_backward(self, layer: int, df, ctx, grads):
        """Gradient of the FFN branch: df (B, T, D) -> d(its input n) (B, T, D); fills the w1, w2
        (and w3) gradients of ``layer``."""
        be, pre = self.backend, f"layers.{layer}."
        c_1, c_3, c_act, c_2 = ctx
        dg = self._proj_backward(pre, "feed_forward.w2", df, c_2, grads)
        if c_3 is None:
            da1 = getattr(be, self.cfg.ffn + "_backward")(dg, c_act)
            return self._proj_backward(pre, "feed_forward.w1", da1, c_1, grads)
        da1, db3 = be.swiglu_backward(dg, c_act)
        dn = self._proj_backward(pre, "feed_forward.w1", da1, c_1, grads)
        dn3 = self._proj_backward(pre, "feed_forward.w3", db3, c_3, grads)
        dn += dn3  # fresh arrays: the gradient sums are accumulated in place
        return dn

    def _attention_sublayer_backward(self, layer: int, do, ctx, grads):
        """Gradient of the attention branch: do (B, T, D) -> d(its input h) (B, T, D); fills the
        wq, wk, wv and wo gradients of ``layer``."""
        be, cfg, pre = self.backend, self.cfg, f"layers.{layer}."
        B, T, _ = do.shape
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        c_q, c_k, c_v, c_rq, c_rk, c_att, c_o = ctx
        da = self._proj_backward(pre, "attention.wo", do, c_o, grads)
        att_backward, c_att = c_att
        dq, dk, dv = att_backward(da.reshape(B, T, H, hd), c_att)
        if c_rq is not None:
            dq = be.rope_backward(dq, c_rq)
            dk = be.rope_backward(dk, c_rk)
        dh = self._proj_backward(pre, "attention.wq", dq.reshape(B, T, H * hd), c_q, grads)
        dhk = self._proj_backward(pre, "attention.wk", dk.reshape(B, T, KVH * hd), c_k, grads)
        dhv = self._proj_backward(pre, "attention.wv", dv.reshape(B, T, KVH * hd), c_v, grads)
        dh += dhk
        dh += dhv
        return dh

    def _block_backward(self, layer: int, dx, ctx, grads):
        """Gradient through one residual block, last sublayer first: dx (B, T, D) -> dx (B, T, D).
        Pre-norm: each residual adds its branch's gradient (through the norm) to the gradient that
        skips it. Post-norm: the gradient first passes the norm, then splits over the sum."""
        pre = f"layers.{layer}."
        c_n1, c_attn, c_n2, c_ffn = ctx
        if self.cfg.norm_position == "pre":
            dn = self._ffn_sublayer_backward(layer, dx, c_ffn, grads)
            dx += self._norm_backward(dn, c_n2, pre + "ffn_norm", grads)
            dh = self._attention_sublayer_backward(layer, dx, c_attn, grads)
            dx += self._norm_backward(dh, c_n1, pre + "attention_norm", grads)
            return dx
        ds = self._norm_backward(dx, c_n2, pre + "ffn_norm", grads)  # d(a + FFN(a))
        ds += self._ffn_sublayer_backward(layer, ds, c_ffn, grads)
        ds = self._norm_backward(ds, c_n1, pre + "attention_norm", grads)  # d(x + Attn(x))
        ds += self._attention_sublayer_backward(layer, ds, c_attn, grads)
        return ds
