r"""The ``numba`` backend: NumPy arrays, BLAS for every matrix product, and Numba-compiled loops
where plain NumPy wastes time or memory:

* RoPE, forward and backward: one pass over (B, T, heads, pairs) instead of strided slices and
  temporaries (in place when ``out=x`` is passed);
* causal GQA attention, forward and backward, FlashAttention-style: never a (T, S) score matrix.
  The forward streams over key tiles with an online softmax and keeps only the per-row
  log-sum-exp, (B, H, T); the backward recomputes the probabilities tile by tile from it with
  D_t = dO_t . O_t. Extra memory is O(T) per head instead of the reference's O(T S). Three paths:

  - T >= :data:`.backend_attention.TILED_MIN_T`: BLAS-tiled, one (sequence, KV head) per ``prange``
    item: the (BQ, BK) score tiles and the products with V, K, Q are OpenBLAS GEMMs called from the
    kernel on that item's thread (:mod:`.floats.blas`), reading Q, K, V and writing O, dQ, dK, dV in
    their (B, T, heads, hd) layout; the softmax work between them runs in Numba loops. Causal tiles
    past a tile's last query are skipped.
  - short T (or no OpenBLAS found): all-Numba loop kernels, ``prange`` over B x KVH.
  - T <= :data:`.backend_attention.DECODE_MAX_T` (decoding against a KV cache): one pass over
    the cache rows in memory order for all heads, split along the keys across threads when the
    batch is small.

* softmax cross-entropy: one fused pass per row (max, exponentials, sum, normalisation);
* linear layers with at most a few rows (decoding): a Numba GEMV (:mod:`.floats.gemv`) that
  streams W near memory bandwidth; every other matrix product is OpenBLAS's GEMM with its rows
  split over the Numba threads (:mod:`.floats.blas`), so a training step runs on one thread pool;
* AdamW: one fused pass per parameter buffer (:mod:`.floats.adamw`);
* a whole KV-cached decode step (one new token per sequence) in one compiled call,
  :meth:`.backend_decode.FusedDecode.decode_step` (:mod:`.decode.float_step`); prefill stays on the
  ops above.

Importing this module imports neither Numba nor the kernels; constructing :class:`NumbaBackend`
imports Numba (a clear :class:`~minillama.core.errors.MinillamaError` when it is missing) and each
kernel compiles on its first call (cached on disk). Threads: ``NUMBA_NUM_THREADS`` or the machine.

This file holds the setup, the thread count, the linear layers and AdamW; the other ops are
mixins, one concern each: :class:`.backend_attention.AttentionOps` (RoPE, attention),
:class:`.backend_rows.RowOps` (RMSNorm, SwiGLU, cross-entropy) and
:class:`.backend_decode.FusedDecode` (the fused decode step, greedy decoding); the jitted
kernels they call are in the other modules of this folder.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix

from ..numpy import threads as cpu_threads
from ..numpy.backend import NumpyBackend
from ..reference import (
    composed_linear_cross_entropy_backward,
    composed_linear_cross_entropy_forward,
)
from .backend_attention import AttentionOps
from .backend_decode import FusedDecode
from .backend_rows import RowOps

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: below this many multiply-adds (about a millisecond of one core) the serial twin of a kernel
#: runs: waking the thread pool costs more, and far more on a busy machine
PARALLEL_MIN_WORK = 1 << 22


class CompileWatch:
    """What Numba's ``numba:compile`` events showed (see :meth:`NumbaBackend.watch_compiles`):
    ``started`` counts the compilations begun of kernels with a disk cache (``cache=True``: each
    a cache miss, compiled once), ``compiled`` those finished, ``names`` their qualified names
    in the order they finished; ``uncached`` counts those of functions without one (Numba's
    own helpers, e.g. of ``numba.typed.List``, compiled anew in every process); ``on_first``,
    when set, is called (in the compiling thread) as the first of the former begins."""

    def __init__(self) -> None:
        self.on_first = None
        self.started = 0
        self.compiled = 0
        self.uncached = 0
        self.names: list[str] = []

    @staticmethod
    def cached(data) -> bool:
        """Whether the event's dispatcher keeps its kernels in a disk cache."""
        cache = getattr((data or {}).get("dispatcher"), "_cache", None)
        return cache is not None and type(cache).__name__ != "NullCache"

    def ended(self, data) -> None:
        """One compilation finished (``data``: the event's, with its ``dispatcher``)."""
        if not self.cached(data):
            self.uncached += 1
            return
        self.compiled += 1
        func = getattr(data.get("dispatcher"), "py_func", None)
        self.names.append(getattr(func, "__qualname__", "?"))


@contextlib.contextmanager
def watch_compiles():
    """A :class:`CompileWatch` counting the kernels Numba compiles (each a cache miss: Numba's
    ``numba:compile`` event, which a kernel loaded from the disk cache does not fire) in the
    ``with`` block, in any thread."""
    from numba.core import event

    watch = CompileWatch()

    class Relay(event.Listener):
        def on_start(self, ev):
            if CompileWatch.cached(ev.data):
                watch.started += 1
                if watch.started == 1 and watch.on_first is not None:
                    watch.on_first()

        def on_end(self, ev):
            watch.ended(ev.data)

    relay = Relay()
    event.register("numba:compile", relay)
    try:
        yield watch
    finally:
        event.unregister("numba:compile", relay)


class NumbaBackend(AttentionOps, RowOps, FusedDecode, NumpyBackend):
    """NumPy + BLAS, with Numba kernels for RoPE, attention and cross-entropy (forward and
    backward)."""

    name = "numba"

    def __init__(self) -> None:
        super().__init__()
        try:
            import numba

            from . import kernels as numba_kernels
        except ImportError as e:
            if (e.name or "numba").split(".")[0] not in ("numba", "llvmlite"):
                raise
            raise MinillamaError(
                "the numba backend needs Numba: pip install numba (or use --backend numpy)"
            ) from None
        self._numba = numba
        self._k = numba_kernels
        from .floats import gemv as numba_gemv

        self._gemv = numba_gemv
        from .floats import blas as numba_blas

        self._blas = numba_blas
        self._decode_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._cache_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def num_threads(self) -> int:
        """Threads of the parallel kernels (``NUMBA_NUM_THREADS``, default: the core count)."""
        return int(self._numba.get_num_threads())

    def watch_compiles(self):
        """A :class:`CompileWatch` counting the kernels Numba compiles in the ``with`` block, in
        any thread (:func:`watch_compiles`)."""
        return watch_compiles()

    @contextlib.contextmanager
    def _numba_team(self, threads: int):
        """Numba's parallel kernels on ``threads`` threads in the ``with`` block."""
        before = self._numba.get_num_threads()
        self._numba.set_num_threads(min(int(threads), int(self._numba.config.NUMBA_NUM_THREADS)))
        try:
            yield
        finally:
            self._numba.set_num_threads(before)

    @contextlib.contextmanager
    def _team(self, threads: int):
        """Every pool of this backend's ops (Numba's, the row threads, OpenBLAS's) on
        ``threads`` threads in the ``with`` block."""
        with self._numba_team(threads), super()._team(threads):
            yield

    def _most_threads(self) -> int:
        """The full thread count of a per-op decode step (Numba's team; see
        :meth:`NumpyBackend.decode_threads`, which numba's :meth:`_team` makes set all pools)."""
        return self.num_threads

    def _parallel(self, work: int) -> bool:
        return work >= PARALLEL_MIN_WORK and self.num_threads > 1

    def embedding_forward(self, weight, tokens):
        r"""h_{b,t} = E_{tok_{b,t}} (:func:`minillama.core.ops.embedding_forward`); the rows of a
        :class:`~minillama.core.quant.QuantMatrix` E dequantized by the kernel the fused decode
        steps read them with (:func:`.quant.matmul.take_rows`), so a token's embedding is the
        same float32 in a prefill and in a decode step."""
        if isinstance(weight, QuantMatrix) and self._quant().has_kernel(weight.qtype):
            tok = np.asarray(tokens)
            rows = self._quant().take_rows(weight, tok)
            return rows.reshape(*tok.shape, weight.shape[1]), (tokens, None)
        return super().embedding_forward(weight, tokens)

    # -----------------------------------------------------------------------------------------
    # linear: BLAS, except a Numba GEMV for up to four rows (decoding)
    # -----------------------------------------------------------------------------------------
    def linear_forward(self, x, w):
        r"""y = x W^T (x: (..., in), W: (out, in)); up to four rows (decoding) take the Numba
        GEMV of :mod:`.floats.gemv`, which streams W at close to memory bandwidth; else BLAS. A
        :class:`~minillama.core.quant.QuantMatrix` W is multiplied from its GGML blocks
        (:func:`.quant.matmul.qmatmul`, float32)."""
        if isinstance(w, QuantMatrix):
            if x.dtype != np.float32:  # the kernels dot in float32: float64 takes the exact tiles
                return super().linear_forward(x, w)
            K = w.shape[1]
            y = self._quant().qmatmul(x.reshape(-1, K), w)
            return y.astype(x.dtype, copy=False).reshape(*x.shape[:-1], w.shape[0]), (x, w)
        K = x.shape[-1]
        rows = x.size // K if K else 0
        if (0 < rows <= self._gemv.GEMV_MAX_ROWS and x.dtype == w.dtype and x.dtype in _FLOATS
                and w.flags.c_contiguous):
            y = self._gemv.gemv(x.reshape(rows, K), w)
            return y.reshape(*x.shape[:-1], w.shape[0]), (x, w)
        return super().linear_forward(x, w)

    def linear_backward(self, dy, ctx):
        r"""dx = dy W, dW = dy^T x; for a :class:`~minillama.core.quant.QuantMatrix` W (frozen)
        dx = dy W from its blocks (:func:`.quant.matmul.qmatmul_t`) and dW is None."""
        x, w = ctx
        if isinstance(w, QuantMatrix) and dy.dtype == np.float32:
            N, K = w.shape
            dx = self._quant().qmatmul_t(dy.reshape(-1, N), w)
            return dx.astype(dy.dtype, copy=False).reshape(*dy.shape[:-1], K), None
        return super().linear_backward(dy, ctx)

    def linear_cross_entropy_forward(self, x, w, targets, ignore_index: int = -1):
        r"""The loss head z = x W^T, L = CE(z, y); a :class:`~minillama.core.quant.QuantMatrix` W
        takes the composed ops (:meth:`linear_forward` from its blocks, then the cross-entropy)."""
        if isinstance(w, QuantMatrix):
            return composed_linear_cross_entropy_forward(self, x, w, targets, ignore_index)
        return super().linear_cross_entropy_forward(x, w, targets, ignore_index)

    def linear_cross_entropy_backward(self, dloss, ctx):
        r"""Gradients of the loss head; (dx, None) for a quantized (frozen) W."""
        if isinstance(ctx, tuple) and isinstance(ctx[0][1], QuantMatrix):
            return composed_linear_cross_entropy_backward(self, dloss, ctx)
        return super().linear_cross_entropy_backward(dloss, ctx)

    def exact_products(self):
        """A context in which products with GGML block matrices keep float32 activations
        (:func:`.quant.int8_dots.exact_products`); the model's training forward runs in it."""
        from .quant import int8_dots

        return int8_dots.exact_products()

    def lora_forward(self, x, w, a, b, scale: float, drop=None):
        """:meth:`.NumpyBackend.lora_forward`, its quantized base product exact (a training op)."""
        with self.exact_products():
            return super().lora_forward(x, w, a, b, scale, drop)

    _quant_module = None

    def _quant(self):
        """:mod:`.quant.matmul` (imported on first use: it compiles nothing until called)."""
        if self._quant_module is None:
            from .quant import matmul as numba_quant

            NumbaBackend._quant_module = numba_quant
        return self._quant_module

    def _gemm(self, a, b, out):
        """out = a b for every linear GEMM (forward and backward, see
        :meth:`.NumpyBackend.linear_forward`): the rows split over the Numba threads, each
        calling OpenBLAS on one thread (:func:`.floats.blas.matmul`);
        :func:`..numpy.threads.split_gemm` where that does not apply (no OpenBLAS found, odd
        strides, other dtypes)."""
        if not self._blas.matmul(a, b, out, self.num_threads):
            cpu_threads.split_gemm(a, b, out)

    # -----------------------------------------------------------------------------------------
    # AdamW
    # -----------------------------------------------------------------------------------------
    _optim = None

    def adamw_update(self, param, grad, m, v, lr, beta1, beta2, eps, wd, step):
        r"""One AdamW step of one parameter in place, in one pass (see :mod:`.floats.adamw`):

        m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
        \theta \leftarrow \theta (1 - \eta\lambda) - \frac{\eta}{1-\beta_1^t}
            \frac{m}{\sqrt{v/(1-\beta_2^t)} + \epsilon}

        param, grad, m, v: NumPy arrays of one shape and float dtype, param/m/v C-contiguous
        (updated in place); ``wd`` = 0 for parameters without decay; step t >= 1.
        """
        dt = param.dtype
        if not (param.shape == grad.shape == m.shape == v.shape):
            raise MinillamaError(f"adamw_update: shapes differ: param {param.shape}, grad "
                                 f"{grad.shape}, m {m.shape}, v {v.shape}")
        for label, a in (("param", param), ("m", m), ("v", v)):
            if not (isinstance(a, np.ndarray) and a.dtype == dt and a.flags.c_contiguous
                    and a.flags.writeable):
                raise MinillamaError(f"adamw_update: {label} must be a writeable C-contiguous "
                                     f"NumPy array of the parameter dtype")
        if dt not in _FLOATS:
            raise MinillamaError(f"adamw_update: float32/float64 parameters only, got {dt}")
        step = int(step)
        if step < 1:
            raise MinillamaError(f"adamw_update: step must be >= 1, got {step}")
        if self._optim is None:
            from .floats import adamw as numba_adamw

            type(self)._optim = numba_adamw
        k = self._optim
        g = np.ascontiguousarray(grad, dtype=dt).reshape(-1)
        f = dt.type
        b1, b2 = float(beta1), float(beta2)
        args = (param.reshape(-1), g, m.reshape(-1), v.reshape(-1), f(1.0 - lr * wd), f(b1),
                f(1.0 - b1), f(b2), f(1.0 - b2), f(1.0 / math.sqrt(1.0 - b2 ** step)), f(eps),
                f(lr / (1.0 - b1 ** step)))
        threads = self.num_threads
        if param.size >= k.PARALLEL_MIN_SIZE and threads > 1:
            k.adamw_parallel(*args, threads)
        else:
            k.adamw_serial(*args)
