r"""The frozen-weight ops of a LoRA step on the CPU backends: the adapted linear
(:func:`minillama.core.ops.lora_forward` / ``lora_backward``), dx = dy W for a frozen linear, and
the input gradient alone of a frozen loss head.

Same equations as the reference ops (held to them by ``tests/model/test_lora_fast.py``); what is
faster:

* every product through the backend's GEMM (:attr:`NumpyBackend._gemm`: rows split over the
  threads, single-threaded BLAS each) instead of NumPy's ``@`` on OpenBLAS's own threads, whose
  workers spin after each call and take a core from the threaded ops in between;
* the rank-r terms added into the frozen product in the same pass by a GEMM with beta 1
  (:meth:`_gemm_acc`): y = x W^T, then y += (s u) B^T; dx = dy W, then dx += \bar{u} A. The
  scale s is applied to the (N, r) matrix u, not to an (N, out) one;
* no weight gradient for a frozen W: ``linear_backward_input`` is only dx = dy W (the frozen
  loss head's counterpart, ``linear_cross_entropy_backward_input``, is in :mod:`.backend`).
"""

from __future__ import annotations

import numpy as np

from minillama.core import ops
from minillama.core.quant import QuantMatrix

from . import threads
from .cblas import gemm_acc
from .threads import parallel_rows, single_threaded_blas


class _LoRACtx:
    """What :meth:`LoRAOps.lora_backward` needs: the input's shape, W, A, B, s, the dropout mask,
    \\tilde{x} (N, in) and s u (N, r)."""

    __slots__ = ("shape", "w", "a", "b", "scale", "drop", "xa", "su")

    def __init__(self, shape, w, a, b, scale, drop, xa, su):
        self.shape, self.w, self.a, self.b, self.scale = shape, w, a, b, scale
        self.drop, self.xa, self.su = drop, xa, su


def _fits(dt, *arrays) -> bool:
    return dt in (np.float32, np.float64) and all(
        isinstance(t, np.ndarray) and t.dtype == dt for t in arrays)


def _forward_rows(x2, xa, w, a, b, s, y, su) -> None:
    """The adapted linear's forward as one region of row threads: per block of rows,
    su = s xa A^T, y = x W^T, y += su B^T (one wake-up of the threads instead of three)."""

    def rows(lo, hi):
        np.matmul(xa[lo:hi], a.T, out=su[lo:hi])
        su[lo:hi] *= s
        np.matmul(x2[lo:hi], w.T, out=y[lo:hi])
        gemm_acc(su[lo:hi], b.T, y[lo:hi], split=False)

    with single_threaded_blas():
        parallel_rows(rows, x2.shape[0], x2.shape[0] * w.shape[0] * 8)


def _backward_rows(dy2, c, dx, du):
    """The adapted linear's backward as one region of row threads: per block of rows,
    dx = dy W, du = s dy B, dx += m (du A), and the block's shares of dB = dy^T (s u) and
    dA = du^T xa, summed after (in block order). Returns (dA, dB)."""
    drop = None if c.drop is None else c.drop.reshape(dx.shape)
    s = c.su.dtype.type(c.scale)
    parts = {}

    def rows(lo, hi):
        d = dy2[lo:hi]
        np.matmul(d, c.w, out=dx[lo:hi])
        np.matmul(d, c.b, out=du[lo:hi])
        du[lo:hi] *= s
        if drop is None:
            gemm_acc(du[lo:hi], c.a, dx[lo:hi], split=False)
        else:
            dx[lo:hi] += (du[lo:hi] @ c.a) * drop[lo:hi]
        parts[lo] = (du[lo:hi].T @ c.xa[lo:hi], d.T @ c.su[lo:hi])

    with single_threaded_blas():
        parallel_rows(rows, dx.shape[0], dx.shape[0] * c.w.shape[0] * 8)
    blocks = [parts[k] for k in sorted(parts)]
    da, db = blocks[0]
    for pa, pb in blocks[1:]:
        da += pa
        db += pb
    return da, db


class LoRAOps:
    """Mixin of :class:`.backend.NumpyBackend` (and so of the numba backend): the LoRA step's
    ops on :attr:`_gemm` and :meth:`_gemm_acc`."""

    def _gemm_acc(self, a, b, out) -> None:
        """out += a b (2-D; :func:`.cblas.gemm_acc`)."""
        gemm_acc(a, b, out)

    def _row_split(self, w, N: int) -> bool:
        """Whether a LoRA layer runs as one region of the numpy backend's row threads
        (:func:`_forward_rows`, :func:`_backward_rows`): its GEMMs are this backend's row split
        (not the numba backend's), W is a float matrix and the layer as large as
        :func:`.threads.split_gemm` splits."""
        return (self._gemm is threads.split_gemm and threads.THREADED_LINEAR
                and isinstance(w, np.ndarray) and N >= threads.SPLIT_GEMM_MIN_ROWS
                and threads.num_threads() > 1
                and N * w.shape[0] * w.shape[1] >= threads.SPLIT_GEMM_MIN_MACS)

    def _gemm_thin(self, a, b, out) -> None:
        """out = a b for the rank-r products: by :attr:`_gemm` when large enough to split over
        the threads, else on the calling thread with BLAS single-threaded (OpenBLAS's own
        threads would spin after the call and take a core from the ops that follow)."""
        M, K = a.shape
        if M >= threads.SPLIT_GEMM_MIN_ROWS and M * K * b.shape[1] >= threads.SPLIT_GEMM_MIN_MACS:
            self._gemm(a, b, out)
        else:
            with single_threaded_blas():
                np.matmul(a, b, out=out)

    def lora_forward(self, x, w, a, b, scale: float, drop=None):
        r"""y = x W^T + s (\tilde{x} A^T) B^T (:func:`minillama.core.ops.lora_forward`); the base
        product by :meth:`linear_forward` (a quantized W by its tiles), the adapter's term added
        into it. x: (..., in). Returns (y (..., out), ctx)."""
        dt = np.result_type(x, a, b)
        if not _fits(dt, x, a, b) or (drop is not None and not _fits(dt, drop)) or x.ndim < 1 \
                or (not isinstance(w, QuantMatrix) and not _fits(dt, w)):
            return ops.lora_forward(x, w, a, b, scale, drop)
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 if drop is None else x2 * drop.reshape(x2.shape)
        su = np.empty((x2.shape[0], a.shape[0]), dtype=dt)
        if self._row_split(w, x2.shape[0]):
            y = np.empty((x2.shape[0], w.shape[0]), dtype=dt)
            _forward_rows(x2, xa, w, a, b, dt.type(scale), y, su)
        else:
            self._gemm_thin(xa, a.T, su)
            su *= dt.type(scale)
            y, _ = self.linear_forward(x2, w)
            self._gemm_acc(su, b.T, y)
        return (y.reshape(*x.shape[:-1], w.shape[0]),
                _LoRACtx(x.shape, w, a, b, scale, drop, xa, su))

    def lora_backward(self, dy, ctx):
        r"""\bar{u} = s \bar{y} B, \bar{B} = \bar{y}^T (s u), \bar{A} = \bar{u}^T \tilde{x},
        \bar{x} = \bar{y} W + m \odot (\bar{u} A) (:func:`minillama.core.ops.lora_backward`); never
        \bar{W}. Returns (dx (..., in), dA (r, in), dB (out, r))."""
        if not isinstance(ctx, _LoRACtx):  # the forward took the reference op
            return ops.lora_backward(dy, ctx)
        c = ctx
        dt = c.su.dtype
        dy2 = np.ascontiguousarray(dy.reshape(-1, dy.shape[-1]), dtype=dt)
        N, r = c.su.shape
        du = np.empty((N, r), dtype=dt)
        if self._row_split(c.w, N):
            dx = np.empty((N, c.w.shape[1]), dtype=dt)
            da, db = _backward_rows(dy2, c, dx, du)
            return dx.reshape(c.shape), da, db
        self._gemm_thin(dy2, c.b, du)
        du *= dt.type(c.scale)
        db = np.empty(c.b.shape, dtype=dt)
        self._gemm_thin(dy2.T, c.su, db)
        da = np.empty(c.a.shape, dtype=dt)
        self._gemm_thin(du.T, c.xa, da)  # r rows: on the calling thread
        dx = self.linear_backward_input(dy2, (None, c.w))
        if c.drop is None:
            self._gemm_acc(du, c.a, dx)
        else:
            dxa = np.empty_like(dx)
            self._gemm_thin(du, c.a, dxa)
            dxa *= c.drop.reshape(dx.shape)
            dx += dxa
        return dx.reshape(c.shape), da, db

    def linear_backward_input(self, dy, ctx):
        r"""dx = dy W alone (W frozen: no dW). dy: (..., out); ctx from :meth:`linear_forward`
        (only its W is read). Returns dx (..., in)."""
        w = ctx[1]
        if isinstance(w, QuantMatrix):  # the backend's tiles; a quantized W has no dW anyway
            return self.linear_backward(dy, ctx)[0]
        if not _fits(np.result_type(dy, w), dy, w):
            return super().linear_backward_input(dy, ctx)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = np.empty((dy2.shape[0], w.shape[1]), dtype=dy.dtype)
        self._gemm(dy2, w, dx)
        return dx.reshape(*dy.shape[:-1], w.shape[1])
