"""The embedding, RMSNorm, SwiGLU and cross-entropy of the CuPy backend, a mixin of
:class:`~minillama.backends.cupy.backend.CupyBackend`: gather and scatter-add, one block per row
for the norms and the log-sum-exp, elementwise kernels for SwiGLU (``kernels/*.cu``); any other
dtype falls back to the reference ops."""

from __future__ import annotations

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix

from ..reference import (
    composed_linear_cross_entropy_backward,
    composed_linear_cross_entropy_forward,
)
from . import build as cb
from .common import _c, _i32, _KCtx, _launch, _scalar, _supported, cp


class RowOps:
    """Embedding, RMSNorm, SwiGLU and cross-entropy, forward and backward, on CUDA kernels."""

    # --- embedding ------------------------------------------------------------------------------
    def embedding_forward(self, weight, tokens):
        r"""h_{b,t} = E[x_{b,t}] (gather kernel). weight: (V, D); tokens: (B, T).
        Returns (B, T, D). A Q8_0 / Q4_K / Q6_K table on the device: the tokens' rows of blocks
        gathered, then dequantized (quant.cu), all on the device."""
        if isinstance(weight, QuantMatrix) and isinstance(weight.data, cp.ndarray):
            tok = cp.asarray(tokens).astype(cp.int64, copy=False)
            rows = QuantMatrix(weight.qtype, (tok.size, weight.shape[1]),
                               weight.data[tok.reshape(-1)])
            out = self._dequantize(rows, np.float32)
            # a frozen table: the reference's (tokens, None), whose backward is None
            return out.reshape(tuple(tok.shape) + (weight.shape[1],)), (tok, None)
        if not _supported(weight):
            return ops.embedding_forward(weight, tokens)
        tok = _c(cp.asarray(tokens).astype(cp.int64, copy=False))
        V, D = weight.shape
        N = tok.size
        out = cp.empty(tuple(tok.shape) + (D,), dtype=weight.dtype)
        grid, block = cb.row_launch(N, D)
        _launch("embedding", "embedding_fwd", weight.dtype, grid, block,
                (_c(weight), tok, out, _i32(N), _i32(D)))
        return out, _KCtx((tok, weight.shape))

    def embedding_backward(self, dout, ctx):
        r"""dE_v = \sum_{(b,t): x_{b,t} = v} dh_{b,t}, summed in a fixed order (tokens sorted on the
        device, one block per run of equal tokens; no atomics, so repeatable bit for bit).
        dout: (B, T, D) -> (V, D)."""
        if not (isinstance(ctx, _KCtx) and _supported(dout)):
            return ops.embedding_backward(dout, ctx)
        tok, shape = ctx
        D = shape[1]
        flat = tok.reshape(-1)
        N = flat.size
        dw = cp.zeros(shape, dtype=dout.dtype)
        if N == 0:
            return dw
        order = _c(cp.argsort(flat).astype(cp.int64, copy=False))
        sorted_tok = _c(flat[order])
        grid, block = cb.row_launch(N, D)
        _launch("embedding", "embedding_bwd", dout.dtype, grid, block,
                (_c(dout), sorted_tok, order, dw, _i32(N), _i32(D)))
        return dw

    # --- RMSNorm --------------------------------------------------------------------------------
    def rmsnorm_forward(self, x, g, eps):
        r"""y = x r g, r = 1/\sqrt{\mathrm{mean}(x^2) + \epsilon}. x: (..., D); g: (D,).

        Saves (x, r (..., 1), g), the reference ctx layout."""
        if not _supported(x, g):
            return ops.rmsnorm_forward(x, g, eps)
        xc, gc = _c(x), _c(g)
        D = x.shape[-1]
        N = x.size // D if D else 0
        y = cp.empty_like(xc)
        rstd = cp.empty(tuple(x.shape[:-1]) + (1,), dtype=x.dtype)
        if N:
            grid, block = cb.row_launch(N, D)
            _launch("rmsnorm", "rmsnorm_fwd", x.dtype, grid, block,
                    (xc, gc, y, rstd, _i32(N), _i32(D), _scalar(x.dtype, eps)))
        return y, (xc, rstd, gc)

    def rmsnorm_backward(self, dy, ctx):
        r"""dx = r (u - \hat{x}\,\mathrm{mean}(u \hat{x})), u = dy g; dg = \sum_{rows} dy \hat{x}.

        dy: (..., D). Returns (dx: (..., D), dg: (D,))."""
        x, rstd, g = ctx
        if not _supported(dy, x, rstd, g):
            return ops.rmsnorm_backward(dy, ctx)
        dyc, xc, rc = _c(dy), _c(x), _c(rstd)
        D = x.shape[-1]
        N = x.size // D if D else 0
        dx = cp.empty_like(xc)
        if N == 0:
            return dx, cp.zeros_like(g)
        grid, block = cb.row_launch(N, D)
        _launch("rmsnorm", "rmsnorm_bwd_dx", x.dtype, grid, block,
                (dyc, xc, rc, _c(g), dx, _i32(N), _i32(D)))
        grid, block, parts = cb.rms_dg_launch(N, D)
        part = cp.empty((parts, D), dtype=x.dtype)
        _launch("rmsnorm", "rmsnorm_bwd_dg", x.dtype, grid, block,
                (dyc, xc, rc, part, _i32(N), _i32(D)))
        dg = part[0] if parts == 1 else part.sum(axis=0)
        return dx, dg

    # --- SwiGLU ---------------------------------------------------------------------------------
    def swiglu_forward(self, a, b):
        r"""h = \mathrm{silu}(a) \odot b, \mathrm{silu}(a) = a\sigma(a).
        a, b: (..., F) -> h (..., F)."""
        if not _supported(a, b) or a.shape != b.shape:
            return ops.swiglu_forward(a, b)
        ac, bc = _c(a), _c(b)
        h = cp.empty_like(ac)
        n = a.size
        if n:
            grid, block = cb.elementwise_launch(n)
            _launch("swiglu", "swiglu_fwd", a.dtype, grid, block, (ac, bc, h, np.int64(n)))
        return h, _KCtx((ac, bc))

    def swiglu_backward(self, dh, ctx):
        r"""db = dh\,\mathrm{silu}(a), da = dh\, b\, \sigma(a)(1 + a(1 - \sigma(a))).
        dh: (..., F). Returns (da, db)."""
        if not (isinstance(ctx, _KCtx) and _supported(dh)):
            return ops.swiglu_backward(dh, ctx)
        ac, bc = ctx
        dhc = _c(dh)
        da, db = cp.empty_like(ac), cp.empty_like(ac)
        n = ac.size
        if n:
            grid, block = cb.elementwise_launch(n)
            _launch("swiglu", "swiglu_bwd", ac.dtype, grid, block,
                    (dhc, ac, bc, da, db, np.int64(n)))
        return da, db

    # --- cross-entropy --------------------------------------------------------------------------
    def cross_entropy_forward(self, logits, targets, ignore_index: int = -1):
        r"""L = \frac{1}{|\mathcal{V}|}\sum_{n \in \mathcal{V}} (\log\sum_v e^{z_{nv}} - z_{n,y_n}),
        \mathcal{V} the rows whose target is not ``ignore_index`` (L = 0 when none is kept).

        logits: (N, V); targets: (N,). Returns the loss (0-d device array) and saves the row
        log-sum-exp (N,) instead of the probabilities."""
        if not _supported(logits) or logits.ndim != 2:
            return ops.cross_entropy_forward(logits, targets, ignore_index)
        N, V = logits.shape
        z = _c(logits)
        t = _c(cp.asarray(targets).reshape(-1).astype(cp.int64, copy=False))
        if t.size != N:
            raise MinillamaError(f"cross_entropy: {t.size} targets for {N} rows of logits")
        lse = cp.empty(N, dtype=z.dtype)
        rows = cp.empty(N, dtype=z.dtype)
        if N:
            grid, block = cb.row_launch(N, V)
            _launch("cross_entropy", "xent_fwd", z.dtype, grid, block,
                    (z, t, lse, rows, _i32(N), _i32(V), np.int64(ignore_index)))
        count = cp.maximum((t != ignore_index).sum(), 1)
        loss = (rows.sum() / count).astype(z.dtype)
        return loss, _KCtx((z, t, lse, count, int(ignore_index)))

    # the loss head: this backend's linear and cross-entropy kernels one after the other
    linear_cross_entropy_forward = composed_linear_cross_entropy_forward
    linear_cross_entropy_backward = composed_linear_cross_entropy_backward

    def cross_entropy_backward(self, dloss, ctx):
        r"""\partial L/\partial z_{nv} = dL\,(p_{nv} - [v = y_n]) / |\mathcal{V}| for kept rows,
        0 for ignored ones, p = e^{z - \mathrm{lse}} (one fused pass). Returns dlogits: (N, V)."""
        if not isinstance(ctx, _KCtx):
            return ops.cross_entropy_backward(dloss, ctx)
        z, t, lse, count, ignore_index = ctx
        N, V = z.shape
        scale = (cp.asarray(dloss, dtype=z.dtype) / count).astype(z.dtype).reshape(1)
        dz = cp.empty_like(z)
        if N:
            grid, block = cb.row_launch(N, V)
            _launch("cross_entropy", "xent_bwd", z.dtype, grid, block,
                    (z, t, lse, scale, dz, _i32(N), _i32(V), np.int64(ignore_index)))
        return dz
