"""The row-wise ops of the ``numba`` backend, a mixin of
:class:`~minillama.backends.numba.backend.NumbaBackend`: RMSNorm and SwiGLU (one Numba pass per
row, row blocks over the Numba threads) and the softmax cross-entropy (one fused pass per row),
forward and backward; the loss head's blocks with OpenBLAS's GEMMs called from the kernel."""

from __future__ import annotations

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError

from ..numpy import threads as cpu_threads

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: the ctx of RMSNorm and SwiGLU run inside ``prompt_rows()`` (inference: their kernels keep
#: nothing that a backward reads)
PROMPT_ROWS_CTX = ("prompt rows", "inference only")


def forward_kept(ctx, op: str) -> None:
    """Raise a clear error where ``op``'s forward ran inside ``prompt_rows()`` (nothing kept)."""
    if ctx is PROMPT_ROWS_CTX:
        raise MinillamaError(f"{op} backward: its forward ran inside prompt_rows(), which keeps "
                             "nothing for a backward (inference only)")


class RowOps:
    """RMSNorm, SwiGLU and cross-entropy on the Numba kernels (``self._k``)."""

    def _parts(self, n_rows: int, n_elements: int) -> int:
        """Row blocks for a row-wise kernel: one per Numba thread, or 1 (run on the calling
        thread) below :data:`.cpu_threads.PARALLEL_MIN_ELEMENTS` elements."""
        if n_elements < cpu_threads.PARALLEL_MIN_ELEMENTS:
            return 1
        return max(1, min(self.num_threads, n_rows))

    def rmsnorm_forward(self, x, g, eps):
        r"""y = x r \odot g, r = 1/\sqrt{\mathrm{mean}(x^2) + \epsilon} (see
        :func:`minillama.core.ops.rmsnorm_forward`): one pass per row (Numba). x: (..., D); g: (D,).
        Returns (y (..., D), ctx (x, r (..., 1), g))."""
        dt = x.dtype
        if dt not in _FLOATS or g.dtype != dt or x.shape[-1] == 0 or g.shape != x.shape[-1:]:
            return super().rmsnorm_forward(x, g, eps)
        D = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, D)
        N = x2.shape[0]
        y = np.empty((N, D), dtype=dt)
        from .backend_decode import in_prompt_rows
        if in_prompt_rows() and dt == np.float32:
            self._qdecode.rmsnorm_step_rows(x2, np.ascontiguousarray(g), float(eps), y)
            return y.reshape(x.shape), PROMPT_ROWS_CTX
        rstd = np.empty(N, dtype=dt)
        gc = np.ascontiguousarray(g)
        e, inv_d = dt.type(eps), dt.type(1.0 / D)
        parts = self._parts(N, x2.size)
        if parts > 1:
            self._k.rmsnorm_fwd_par(x2, gc, e, inv_d, y, rstd, parts)
        else:
            self._k.rmsnorm_fwd_rows(x2, gc, e, inv_d, y, rstd, 0, N)
        return y.reshape(x.shape), (x2, rstd.reshape(*x.shape[:-1], 1), gc)

    def rmsnorm_backward(self, dy, ctx):
        r"""dx = r (u - \hat{x}\, \mathrm{mean}(u \odot \hat{x})), u = dy \odot g,
        dg = \sum_{rows} dy \odot \hat{x}: one pass per row (Numba), dg summed per thread block.
        dy: (..., D). Returns (dx (..., D), dg (D,))."""
        forward_kept(ctx, "rmsnorm")
        x2, rstd, g = ctx
        dt = x2.dtype
        if dy.dtype != dt or x2.ndim != 2 or dt not in _FLOATS or g.dtype != dt:
            return super().rmsnorm_backward(dy, ctx)
        D = x2.shape[1]
        dy2 = np.ascontiguousarray(dy).reshape(-1, D)
        N = x2.shape[0]
        r = rstd.reshape(-1)
        dx = np.empty((N, D), dtype=dt)
        inv_d = dt.type(1.0 / D)
        parts = self._parts(N, x2.size)
        dgp = np.zeros((parts, D), dtype=dt)
        if parts > 1:
            self._k.rmsnorm_bwd_par(dy2, x2, r, g, inv_d, dx, dgp)
        else:
            self._k.rmsnorm_bwd_rows(dy2, x2, r, g, inv_d, dx, dgp[0], 0, N)
        return dx.reshape(dy.shape), dgp.sum(axis=0)

    def swiglu_forward(self, a, b):
        r"""h = \mathrm{silu}(a) \odot b, \mathrm{silu}(a) = a \sigma(a) (see
        :func:`minillama.core.ops.swiglu_forward`): one pass (Numba); a, b and \sigma(a) are saved.
        a, b: (..., F). Returns (h (..., F), ctx)."""
        dt = a.dtype
        if dt not in _FLOATS or b.dtype != dt or a.shape != b.shape or a.size == 0:
            return super().swiglu_forward(a, b)
        F = a.shape[-1]
        a2 = np.ascontiguousarray(a).reshape(-1, F)
        b2 = np.ascontiguousarray(b).reshape(-1, F)
        N = a2.shape[0]
        h = np.empty((N, F), dtype=dt)
        from .backend_decode import in_prompt_rows
        if in_prompt_rows() and dt == np.float32:
            self._qdecode.swiglu_step_rows(a2, b2, h)
            return h.reshape(a.shape), PROMPT_ROWS_CTX
        sig = np.empty((N, F), dtype=dt)
        one = dt.type(1)
        parts = self._parts(N, a2.size)
        if parts > 1:
            self._k.swiglu_fwd_par(a2, b2, one, h, sig, parts)
        else:
            self._k.swiglu_fwd_rows(a2, b2, one, h, sig, 0, N)
        return h.reshape(a.shape), ("numba", a2, b2, sig)

    def swiglu_backward(self, dh, ctx):
        r"""db = dh \odot \mathrm{silu}(a), da = dh \odot b \odot \sigma(a)(1 + a(1 - \sigma(a))),
        \sigma(a) from the forward (Numba, one pass). dh: (..., F). Returns (da, db)."""
        forward_kept(ctx, "swiglu")
        if len(ctx) != 4 or ctx[0] != "numba":
            return super().swiglu_backward(dh, ctx)
        _, a2, b2, sig = ctx
        N, F = a2.shape
        dh2 = np.ascontiguousarray(dh, dtype=a2.dtype).reshape(N, F)
        da = np.empty((N, F), dtype=a2.dtype)
        db = np.empty((N, F), dtype=a2.dtype)
        one = a2.dtype.type(1)
        parts = self._parts(N, a2.size)
        if parts > 1:
            self._k.swiglu_bwd_par(dh2, a2, b2, sig, one, da, db, parts)
        else:
            self._k.swiglu_bwd_rows(dh2, a2, b2, sig, one, da, db, 0, N)
        return da.reshape(dh.shape), db.reshape(dh.shape)

    def _lce_blocks(self, x, w, targets, valid, scale, dz, dx, row_loss, R):
        """The loss head's forward blocks (see :meth:`.NumpyBackend._lce_blocks`) in one Numba
        kernel over the Numba threads, OpenBLAS's GEMMs called from it
        (:func:`.kernels.lce_fwd_blas`)."""
        N = dz.shape[0]
        if not (self._blas.available() and x.flags.c_contiguous and w.flags.c_contiguous):
            return super()._lce_blocks(x, w, targets, valid, scale, dz, dx, row_loss, R)
        fn, ilp64 = self._gemm_fn(dz.dtype)
        parts = self._parts(N, dz.size)
        with cpu_threads.single_threaded_blas():
            self._k.lce_fwd_blas(fn, ilp64, x, w, targets, valid, scale, dz.dtype.type(1), dz,
                                 dx, row_loss, R, parts)

    def _xent_grad_rows(self, z, targets, valid, scale, row_loss):
        """The loss head's per-block softmax pass (see
        :meth:`.NumpyBackend.linear_cross_entropy_forward`): the Numba kernel
        :func:`.kernels.xent_grad_rows`, one thread per block."""
        self._k.xent_grad_rows(z, targets, valid, scale, row_loss)

    def cross_entropy_forward(self, logits, targets, ignore_index: int = -1):
        r"""Mean softmax cross-entropy over the rows whose target is not ``ignore_index``
        (see :func:`minillama.core.ops.cross_entropy_forward`):

        \ell_n = \log \sum_v e^{z_{nv}} - z_{n, y_n},
        L = \frac{1}{|\mathcal{V}|} \sum_{n \in \mathcal{V}} \ell_n.

        logits: (N, V) float32/float64; targets: (N,) ints. Two reads of each row (max, then
        the sum of exponentials) and no (N, V) temporary: ctx keeps the logits and the row
        log-sum-exp (N,), and the backward recomputes the probabilities.
        Returns (0-d loss, ctx).
        """
        if logits.dtype not in _FLOATS or logits.ndim != 2 or logits.shape[1] == 0:
            return ops.cross_entropy_forward(logits, targets, ignore_index)
        N, V = logits.shape
        targets = np.asarray(targets).reshape(-1)
        if targets.shape[0] != N:
            raise MinillamaError(f"cross-entropy: {targets.shape[0]} targets for {N} rows")
        valid = targets != ignore_index
        safe_t = np.where(valid, targets, 0).astype(np.int64)
        if safe_t.size and (safe_t.min() < 0 or safe_t.max() >= V):
            raise MinillamaError(f"cross-entropy targets must lie in [0, {V}) or equal the "
                                 f"ignore index {ignore_index}")
        lse = np.empty(N, dtype=logits.dtype)
        row_loss = np.empty(N, dtype=logits.dtype)
        if N:
            self._k.xent_fwd(logits, safe_t, valid, lse, row_loss)
        count = max(int(valid.sum()), 1)
        loss = np.asarray(row_loss.sum() / count, dtype=logits.dtype)
        return loss, (logits, lse, safe_t, valid, count)

    def cross_entropy_backward(self, dloss, ctx):
        r"""\partial L / \partial z_{nv} = (p_{nv} - [v = y_n]) \cdot dloss / |\mathcal{V}| for kept
        rows, 0 for ignored rows, with p_{nv} = e^{z_{nv} - lse_n} recomputed from the saved
        logits and row log-sum-exp (one pass). Returns dlogits (N, V)."""
        if len(ctx) != 5:  # a reference ctx (the forward fell back to the reference)
            return ops.cross_entropy_backward(dloss, ctx)
        logits, lse, safe_t, valid, count = ctx
        dz = np.empty(logits.shape, dtype=logits.dtype)
        scale = logits.dtype.type(float(np.asarray(dloss)) / count)
        if logits.shape[0]:
            self._k.xent_bwd(logits, lse, safe_t, valid, scale, dz)
        return dz
