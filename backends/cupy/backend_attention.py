"""RoPE and causal GQA attention of the CuPy backend, a mixin of
:class:`~minillama.backends.cupy.backend.CupyBackend`: the rotation kernel, and attention tiled
with an online softmax (the SIMT kernels of attention.cu, a decode kernel for T = 1 against the KV
cache, the tensor-core kernels of flash_attention.cu on sm_80 and newer)."""

from __future__ import annotations

import math

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError

from . import build as cb
from .common import _aligned16, _c, _i32, _KCtx, _launch, _scalar, _supported, cp


class AttentionOps:
    """RoPE and attention, forward and backward, on CUDA kernels."""

    # --- RoPE -----------------------------------------------------------------------------------
    def _rope(self, x, cos, sin, sign: float, out=None):
        B, T, nh, hd = x.shape
        half = hd // 2
        xc, cc, sc = _c(x), _c(cos), _c(sin)
        if out is None:
            out = cp.empty_like(xc)
        elif out is not x or not x.flags.c_contiguous:
            raise MinillamaError("rope out= must be x itself (a C-contiguous array)")
        cs_bstride = 0 if cos.ndim == 2 else T * half
        n_pairs = x.size // 2
        if n_pairs:
            grid, block = cb.elementwise_launch(n_pairs)
            _launch("rope", "rope_apply", x.dtype, grid, block,
                    (xc, out, cc, sc, np.int64(n_pairs), _i32(T), _i32(nh), _i32(half),
                     np.int64(cs_bstride), _scalar(x.dtype, sign)))
        return out

    @staticmethod
    def _rope_shapes_ok(x, cos, sin) -> bool:
        if x.ndim != 4 or x.shape[-1] % 2 or cos.shape != sin.shape:
            return False
        B, T, _, hd = x.shape
        if cos.ndim == 2:
            return cos.shape == (T, hd // 2)
        return cos.ndim == 3 and cos.shape == (B, T, hd // 2)

    def rope_forward(self, x, cos, sin, out=None):
        r"""y_{2i} = x_{2i}\cos(m\theta_i) - x_{2i+1}\sin(m\theta_i),
        y_{2i+1} = x_{2i}\sin(m\theta_i) + x_{2i+1}\cos(m\theta_i).

        x: (B, T, nh, hd); cos, sin: (T, hd/2) or (B, T, hd/2). ``out=x`` rotates in place.
        Returns y: (B, T, nh, hd)."""
        if not (_supported(x, cos, sin) and self._rope_shapes_ok(x, cos, sin)):
            return ops.rope_forward(x, cos, sin)
        return self._rope(x, cos, sin, 1.0, out), _KCtx((cos, sin))

    def rope_backward(self, dy, ctx):
        r"""dx = R(-m\theta_i) dy (the inverse rotation). dy: (B, T, nh, hd) -> dx (same)."""
        cos, sin = ctx
        if not (isinstance(ctx, _KCtx) and _supported(dy, cos, sin)
                and self._rope_shapes_ok(dy, cos, sin)):
            return ops.rope_backward(dy, ctx)
        return self._rope(dy, cos, sin, -1.0)

    # --- attention ------------------------------------------------------------------------------
    @staticmethod
    def _kv_layout(k, v):
        """(k, v, batch stride in elements): reads a KV-cache view (B, S, KVH, hd) in place when
        its last three axes are packed and both share one batch stride; copies otherwise."""
        B, S, KVH, hd = k.shape
        isz = k.dtype.itemsize
        packed = (KVH * hd * isz, hd * isz, isz)

        def ok(a):
            return (a.strides[1:] == packed or S == 1 and a.strides[2:] == packed[1:]) \
                and a.strides[0] % isz == 0 and a.strides[0] >= 0

        if ok(k) and ok(v) and k.strides[0] == v.strides[0]:
            bs = k.strides[0] // isz if B > 1 else S * KVH * hd
            return k, v, bs
        k, v = _c(k), _c(v)
        return k, v, S * KVH * hd

    def _flash_expr(self, dtype, hd: int, T: int):
        """``"<hd,split>"`` of the flash_attention.cu kernels for this call, or None (SIMT
        kernels of attention.cu: float64, other head dimensions, T = 1, GPUs before sm_80)."""
        if not self.flash or np.dtype(dtype) != np.float32 or hd not in cb.FLASH_HEAD_DIMS \
                or T < 2:
            return None
        return f"<{hd},{'false' if self.attention_precision == 'tf32' else 'true'}>"

    def attention_forward(self, q, k, v, start_pos=0):
        r"""Causal GQA attention, S_{tj} = q_t \cdot k_j / \sqrt{hd} (-\infty for j > p + t),
        P = \mathrm{softmax}_j(S), o_t = \sum_j P_{tj} v_j; query head h reads KV head h // G.

        q: (B, T, H, hd); k, v: (B, S, KVH, hd) (a KV-cache view is fine); start_pos: int or (B,).
        Returns o: (B, T, H, hd). Saves q, k, v, o and the row log-sum-exp (B, H, T)."""
        if not _supported(q, k, v) or q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
            return ops.attention_forward(q, k, v, start_pos)
        B, T, H, hd = q.shape
        S, KVH = k.shape[1], k.shape[2]
        if hd > cb.ATTN_MAX_HD or hd < 1 or KVH < 1 or H % KVH or k.shape[0] != B \
                or k.shape[3] != hd or S < 1 or T < 1:
            return ops.attention_forward(q, k, v, start_pos)
        G = H // KVH
        dt = q.dtype
        qc = _c(q)
        kk, vv, kv_bs = self._kv_layout(k, v)
        start_arr, start_s, use_arr = self._start_args(start_pos, B)
        scale = 1.0 / math.sqrt(hd)
        out = cp.empty((B, T, H, hd), dtype=dt)
        lse = cp.empty((B, H, T), dtype=dt)
        common = (start_arr, start_s, use_arr)
        flash = self._flash_expr(dt, hd, T)
        if flash is not None and not (_aligned16(qc, kk, vv) and kv_bs % 4 == 0):
            qc = qc.copy() if not _aligned16(qc) else qc
            if not (_aligned16(kk, vv) and kv_bs % 4 == 0):
                kk, vv = kk.copy(order="C"), vv.copy(order="C")
                kv_bs = S * KVH * hd
        if flash is not None:
            grid, block = cb.flash_launch("fwd", B, T, S, KVH, G)
            cb.launch_expr("flash_attention", f"flash_fwd{flash}", grid, block,
                           (qc, kk, vv, out, lse, *common, _i32(T), _i32(S), _i32(H), _i32(KVH),
                            np.int64(kv_bs), _scalar(dt, scale)), cb.flash_smem("fwd", hd))
        elif T == 1:
            grid, block = cb.attn_decode_launch(B, KVH, G, dt)
            _launch("attention", "attn_decode", dt, grid, block,
                    (qc, kk, vv, out, lse, *common, _i32(S), _i32(H), _i32(KVH), _i32(hd),
                     np.int64(kv_bs), _scalar(dt, scale)))
        else:
            grid, block = cb.attn_fwd_launch(B, T, KVH, G, dt)
            _launch("attention", "attn_fwd", dt, grid, block,
                    (qc, kk, vv, out, lse, *common, _i32(T), _i32(S), _i32(H), _i32(KVH),
                     _i32(hd), np.int64(kv_bs), _scalar(dt, scale)))
        return out, _KCtx((qc, kk, vv, kv_bs, out, lse, common, scale))

    def attention_backward(self, dout, ctx):
        r"""dP = dO V^T, dS = P \odot (dP - D), D_t = dO_t \cdot o_t, dQ = dS K / \sqrt{hd},
        dK = \sum_{g} dS^T Q / \sqrt{hd}, dV = \sum_{g} P^T dO with P recomputed from the saved
        log-sum-exp. dout: (B, T, H, hd). Returns (dq (B, T, H, hd), dk, dv (B, S, KVH, hd))."""
        if not (isinstance(ctx, _KCtx) and _supported(dout)):
            return ops.attention_backward(dout, ctx)
        qc, kk, vv, kv_bs, out, lse, common, scale = ctx
        B, T, H, hd = qc.shape
        S, KVH = kk.shape[1], kk.shape[2]
        G = H // KVH
        dt = qc.dtype
        doc = _c(dout)
        dsum = cp.empty((B, H, T), dtype=dt)
        grid, block = cb.attn_dsum_launch(B * T * H)
        _launch("attention", "attn_bwd_dsum", dt, grid, block,
                (doc, out, dsum, _i32(B), _i32(T), _i32(H), _i32(hd)))
        dq = cp.empty_like(qc)
        dk = cp.empty((B, S, KVH, hd), dtype=dt)
        dv = cp.empty((B, S, KVH, hd), dtype=dt)
        flash = self._flash_expr(dt, hd, T)
        if flash is not None:
            if not _aligned16(doc):
                doc = doc.copy()
            sizes = (_i32(T), _i32(S), _i32(H), _i32(KVH), np.int64(kv_bs), _scalar(dt, scale))
            grid, block = cb.flash_launch("dq", B, T, S, KVH, G)
            cb.launch_expr("flash_attention", f"flash_bwd_dq{flash}", grid, block,
                           (qc, kk, vv, doc, lse, dsum, dq, *common, *sizes),
                           cb.flash_smem("dq", hd))
            grid, block = cb.flash_launch("dkdv", B, T, S, KVH, G)
            nsplit, r_chunk = cb.flash_dkdv_split(grid[0] * grid[1], T * G)
            if nsplit > 1:
                dk = cp.empty((nsplit, B, S, KVH, hd), dtype=dt)
                dv = cp.empty((nsplit, B, S, KVH, hd), dtype=dt)
            cb.launch_expr("flash_attention", f"flash_bwd_dkdv{flash}", grid + (nsplit,), block,
                           (qc, kk, vv, doc, lse, dsum, dk, dv, *common, *sizes, _i32(r_chunk)),
                           cb.flash_smem("dkdv", hd))
            if nsplit > 1:  # the row shares' partial sums, added in a fixed order
                dk, dv = dk.sum(axis=0), dv.sum(axis=0)
            return dq, dk, dv
        sizes = (_i32(T), _i32(S), _i32(H), _i32(KVH), _i32(hd), np.int64(kv_bs),
                 _scalar(dt, scale))
        grid, block = cb.attn_dq_launch(B, T, KVH, G, dt)
        _launch("attention", "attn_bwd_dq", dt, grid, block,
                (qc, kk, vv, doc, lse, dsum, dq, *common, *sizes))
        grid, block = cb.attn_dkdv_launch(B, S, KVH, dt)
        _launch("attention", "attn_bwd_dkdv", dt, grid, block,
                (qc, kk, vv, doc, lse, dsum, dk, dv, *common, *sizes))
        return dq, dk, dv
