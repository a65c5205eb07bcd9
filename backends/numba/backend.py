r"""The ``numba`` backend: NumPy arrays, BLAS for every matrix product, and Numba-compiled loops
where plain NumPy wastes time or memory:

* RoPE, forward and backward: one pass over (B, T, heads, pairs) instead of strided slices and
  temporaries (in place when ``out=x`` is passed);
* causal GQA attention, forward and backward, FlashAttention-style: never a (T, S) score matrix.
  The forward streams over key tiles with an online softmax and keeps only the per-row
  log-sum-exp, (B, H, T); the backward recomputes the probabilities tile by tile from it with
  D_t = dO_t . O_t. Extra memory is O(T) per head instead of the reference's O(T S). Three paths:

  - T >= :data:`TILED_MIN_T`: BLAS-tiled, one (sequence, KV head) per ``prange`` item: the
    (BQ, BK) score tiles and the products with V, K, Q are OpenBLAS GEMMs called from the kernel
    on that item's thread (:mod:`.blas`), reading Q, K, V and writing O, dQ, dK, dV in
    their (B, T, heads, hd) layout; the softmax work between them runs in Numba loops. Causal
    tiles past a tile's last query are skipped.
  - short T (or no OpenBLAS found): all-Numba loop kernels, ``prange`` over B x KVH.
  - T <= :data:`DECODE_MAX_T` (decoding against a KV cache): one pass over the cache rows in
    memory order for all heads, split along the keys across threads when the batch is small.

* softmax cross-entropy: one fused pass per row (max, exponentials, sum, normalisation);
* linear layers with at most a few rows (decoding): a Numba GEMV (:mod:`.gemv`) that
  streams W near memory bandwidth; every other matrix product is OpenBLAS's GEMM with its rows
  split over the Numba threads (:mod:`.blas`), so a training step runs on one thread pool;
* AdamW: one fused pass per parameter buffer (:mod:`.optim`);
* a whole KV-cached decode step (one new token per sequence) in one compiled call,
  :meth:`NumbaBackend.decode_step` (:mod:`.decode`); prefill stays on the ops above.

Importing this module imports neither Numba nor the kernels; constructing :class:`NumbaBackend`
imports Numba (a clear :class:`~minillama.errors.MinillamaError` when it is missing) and each
kernel compiles on its first call (cached on disk). Threads: ``NUMBA_NUM_THREADS`` or the machine.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref

import numpy as np

from ... import ops
from ...errors import MinillamaError
from ...decoding import ChunkDecoder, nonfinite_error
from ...decoding import finite_logits as _finite
from ...quant import QuantMatrix
from ..numpy import threads as cpu_threads
from ..numpy.backend import NumpyBackend
from ..reference import (composed_linear_cross_entropy_backward,
                         composed_linear_cross_entropy_forward)

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: below this many multiply-adds (about a millisecond of one core) the serial twin of a kernel
#: runs: waking the thread pool costs more, and far more on a busy machine
PARALLEL_MIN_WORK = 1 << 22
#: RoPE is memory-bound: below this many elements one thread is as fast as two (measured on the
#: 2-core VM, 2026-11-23: a (16, 128, 4, 32) float32 rotation 0.30 ms serial, 0.20 ms on 2 threads)
ROPE_PARALLEL_MIN_SIZE = 1 << 16
#: at most this many query positions per call take the decode kernel (no K transpose)
DECODE_MAX_T = 4
#: from this many query positions on, attention runs BLAS-tiled (score tiles by OpenBLAS GEMMs
#: called from the Numba kernel, softmax work in Numba loops); below, the all-Numba loop kernels
TILED_MIN_T = 16
#: query positions and keys per tile of the BLAS-tiled path (one BQ x BK score tile per thread)
TILE_BQ = 64
TILE_BK = 256
#: the decode kernel splits the keys into chunks of at least this many when it splits them
DECODE_MIN_CHUNK = 256
#: config fields the fused decode step understands; any other field must keep its default
#: (a model variant with, e.g., biases or another norm falls back to the per-op path)
FUSED_DECODE_FIELDS = frozenset({"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                 "hidden_dim", "multiple_of", "ffn_dim_multiplier", "norm_eps",
                                 "rope_theta", "max_seq_len", "tie_embeddings", "head_dim"})


class NumbaBackend(NumpyBackend):
    """NumPy + BLAS, with Numba kernels for RoPE, attention and cross-entropy (forward and
    backward)."""

    name = "numba"

    def __init__(self) -> None:
        super().__init__()
        try:
            import numba  # noqa: PLC0415

            from . import kernels as numba_kernels  # noqa: PLC0415
        except ImportError as e:
            if (e.name or "numba").split(".")[0] not in ("numba", "llvmlite"):
                raise
            raise MinillamaError(
                "the numba backend needs Numba: pip install numba (or use --backend numpy)"
            ) from None
        self._numba = numba
        self._k = numba_kernels
        from . import gemv as numba_gemv  # noqa: PLC0415

        self._gemv = numba_gemv
        from . import blas as numba_blas  # noqa: PLC0415

        self._blas = numba_blas
        self._decode_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._cache_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def num_threads(self) -> int:
        """Threads of the parallel kernels (``NUMBA_NUM_THREADS``, default: the core count)."""
        return int(self._numba.get_num_threads())

    def _parallel(self, work: int) -> bool:
        return work >= PARALLEL_MIN_WORK and self.num_threads > 1

    # -----------------------------------------------------------------------------------------
    # linear: BLAS, except a Numba GEMV for up to four rows (decoding)
    # -----------------------------------------------------------------------------------------
    def linear_forward(self, x, w):
        r"""y = x W^T (x: (..., in), W: (out, in)); up to four rows (decoding) take the Numba
        GEMV of :mod:`.gemv`, which streams W at close to memory bandwidth; else BLAS. A
        :class:`~minillama.quant.QuantMatrix` W is multiplied from its GGML blocks
        (:func:`.quant.qmatmul`, float32)."""
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
        r"""dx = dy W, dW = dy^T x; for a :class:`~minillama.quant.QuantMatrix` W (frozen)
        dx = dy W from its blocks (:func:`.quant.qmatmul_t`) and dW is None."""
        x, w = ctx
        if isinstance(w, QuantMatrix) and dy.dtype == np.float32:
            N, K = w.shape
            dx = self._quant().qmatmul_t(dy.reshape(-1, N), w)
            return dx.astype(dy.dtype, copy=False).reshape(*dy.shape[:-1], K), None
        return super().linear_backward(dy, ctx)

    def linear_cross_entropy_forward(self, x, w, targets, ignore_index: int = -1):
        r"""The loss head z = x W^T, L = CE(z, y); a :class:`~minillama.quant.QuantMatrix` W
        takes the composed ops (:meth:`linear_forward` from its blocks, then the cross-entropy)."""
        if isinstance(w, QuantMatrix):
            return composed_linear_cross_entropy_forward(self, x, w, targets, ignore_index)
        return super().linear_cross_entropy_forward(x, w, targets, ignore_index)

    def linear_cross_entropy_backward(self, dloss, ctx):
        r"""Gradients of the loss head; (dx, None) for a quantized (frozen) W."""
        if isinstance(ctx, tuple) and isinstance(ctx[0][1], QuantMatrix):
            return composed_linear_cross_entropy_backward(self, dloss, ctx)
        return super().linear_cross_entropy_backward(dloss, ctx)

    _quant_module = None

    def _quant(self):
        """:mod:`.quant` (imported on first use: it compiles nothing until called)."""
        if self._quant_module is None:
            from . import quant as numba_quant  # noqa: PLC0415

            NumbaBackend._quant_module = numba_quant
        return self._quant_module

    def _gemm(self, a, b, out):
        """out = a b for every linear GEMM (forward and backward, see
        :meth:`.NumpyBackend.linear_forward`): the rows split over the Numba threads, each
        calling OpenBLAS on one thread (:func:`.blas.matmul`);
        :func:`..numpy.threads.split_gemm` where that does not apply (no OpenBLAS found, odd
        strides, other dtypes)."""
        if not self._blas.matmul(a, b, out, self.num_threads):
            cpu_threads.split_gemm(a, b, out)

    # -----------------------------------------------------------------------------------------
    # AdamW
    # -----------------------------------------------------------------------------------------
    _optim = None

    def adamw_update(self, param, grad, m, v, lr, beta1, beta2, eps, wd, step):
        r"""One AdamW step of one parameter in place, in one pass (see :mod:`.optim`):

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
            from . import optim as numba_optim  # noqa: PLC0415

            type(self)._optim = numba_optim
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

    # -----------------------------------------------------------------------------------------
    # the fused decode step
    # -----------------------------------------------------------------------------------------
    def _decode_plan(self, model):
        """The model's weights as the lists :func:`.decode.decode_step` takes, built once
        per model (the arrays themselves, so in-place updates are seen; rebuilt when a parameter
        array is replaced). None when the model is not a plain LLaMA this step implements."""
        plan = self._decode_plans.get(model)
        p = model.params
        if plan is not None and all(map(operator.is_, map(p.get, plan["keys"]), plan["arrays"])):
            return plan
        cfg = model.cfg
        if model.dtype not in _FLOATS or not dataclasses.is_dataclass(cfg):
            return None
        for f in dataclasses.fields(cfg):
            if f.name not in FUSED_DECODE_FIELDS and (
                    f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default):
                return None
        from ...model import param_shapes  # noqa: PLC0415

        shapes = param_shapes(cfg)
        if set(p) != set(shapes):
            return None
        if any(isinstance(a, QuantMatrix) for a in p.values()):
            plan = self._quant_plan(model, shapes)
            if plan is not None:
                self._decode_plans[model] = plan
            return plan
        if any(not isinstance(a, np.ndarray) for a in p.values()):
            return None
        dt = model.dtype

        def arr(a):  # C-contiguous and writeable: one array type for every list entry
            return np.require(a, dtype=dt, requirements=("C", "W"))

        typed_list = self._numba.typed.List

        def stack(name):  # a typed list: its type does not depend on L (one compilation)
            return typed_list([arr(p[f"layers.{i}.{name}"]) for i in range(cfg.n_layers)])

        plan = {
            "keys": list(shapes), "arrays": [p[k] for k in shapes],
            "emb": arr(p["tok_embeddings.weight"]),
            "out": arr(model.output_weight),
            "norm": arr(p["norm.weight"]),
            "layers": tuple(stack(n) for n in (
                "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")),
            "cos": arr(model.cos), "sin": arr(model.sin),
            "eps": float(cfg.norm_eps), "heads": int(cfg.n_heads), "zero": dt.type(0),
        }
        if self._decode is None:
            from . import decode as numba_decode  # noqa: PLC0415

            self._decode = numba_decode
        self._decode_plans[model] = plan
        return plan

    _decode = None
    _qdecode = None

    #: the linear weights of a layer in the order of :func:`.qdecode.decode_step_one_q`
    _QUANT_LINEAR = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                     "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight")

    def _quant_plan(self, model, shapes):
        """The decode plan of a float32 model whose linear weights are all GGML block matrices
        (:class:`~minillama.quant.QuantMatrix`; the embedding and the classifier may be either):
        the block arrays as typed lists and each matrix's type id. None otherwise."""
        p, cfg = model.params, model.cfg
        L = cfg.n_layers
        names = [f"layers.{i}.{n}" for i in range(L) for n in self._QUANT_LINEAR]
        if model.dtype != np.float32 or not all(isinstance(p[k], QuantMatrix) for k in names):
            return None
        q = self._quant()

        def side(w):  # (block data, type id, float matrix); type 0 for a float matrix
            if isinstance(w, QuantMatrix):
                return w.data, q.CODES[w.qtype], np.zeros((1, 1), np.float32)
            return np.zeros((1, 1), np.uint8), 0, np.require(w, np.float32, ("C", "W"))

        rest = [k for k in shapes if k not in names and k not in (
            "tok_embeddings.weight", "output.weight")]
        if any(not isinstance(p[k], np.ndarray) for k in rest):
            return None

        def arr(a):
            return np.require(a, dtype=np.float32, requirements=("C", "W"))

        lst = self._numba.typed.List
        mats = tuple(lst([p[f"layers.{i}.{n}"].data for i in range(L)])
                     for n in self._QUANT_LINEAR)
        if self._qdecode is None:
            from . import qdecode as numba_qdecode  # noqa: PLC0415

            NumbaBackend._qdecode = numba_qdecode
        return {
            "keys": list(shapes), "arrays": [p[k] for k in shapes], "quant": True,
            "V": cfg.vocab_size, "emb": side(p["tok_embeddings.weight"]),
            "out": side(model.output_weight),
            "codes": np.array([[q.CODES[p[f"layers.{i}.{n}"].qtype] for n in self._QUANT_LINEAR]
                               for i in range(L)], dtype=np.int64),
            "norm": arr(p["norm.weight"]),
            "g_att": lst([arr(p[f"layers.{i}.attention_norm.weight"]) for i in range(L)]),
            "g_ffn": lst([arr(p[f"layers.{i}.ffn_norm.weight"]) for i in range(L)]),
            "mats": mats, "cos": arr(model.cos), "sin": arr(model.sin),
            "eps": float(cfg.norm_eps), "heads": int(cfg.n_heads),
        }

    def _step_one(self, plan, tok, pos, kc, vc, logits, stop, ids):
        """One sequence's fused step(s): :func:`.decode.decode_step_one`, or
        :func:`.qdecode.decode_step_one_q` for a quantized plan. Returns its count."""
        if not plan.get("quant"):
            return self._decode.decode_step_one(tok, pos, *_model_args(plan, kc, vc), logits,
                                                self.num_threads, stop, ids)
        q = self._quant()
        wq, wk, wv, wo, w1, w2, w3 = plan["mats"]
        return self._qdecode.decode_step_one_q(
            tok, pos, *plan["emb"], *plan["out"], plan["codes"], plan["norm"], plan["g_att"],
            wq, wk, wv, wo, plan["g_ffn"], w1, w2, w3, kc, vc, plan["cos"], plan["sin"],
            plan["eps"], plan["heads"], logits, self.num_threads, stop, ids, q._F16,
            q._KVALUES)

    def _cache_lists(self, cache, dt):
        """The cache's per-layer K and V arrays as typed lists (built once per cache), or None
        when they are not C-contiguous writeable NumPy arrays of the model dtype."""
        got = self._cache_plans.get(cache)
        if got is not None and all(map(operator.is_, got[2], cache.k + cache.v)):
            return got[:2]
        arrays = list(cache.k) + list(cache.v)
        for a in arrays:
            if not (isinstance(a, np.ndarray) and a.dtype == dt and a.flags.c_contiguous
                    and a.flags.writeable):
                return None
        lst = self._numba.typed.List
        got = (lst(cache.k), lst(cache.v), arrays)
        self._cache_plans[cache] = got
        return got[:2]

    def decode_step(self, model, tok, start_pos, cache):
        r"""One KV-cached decode step of ``model`` in one compiled call, or None to decline.

        tok: (B, 1) token ids (checked by the model); start_pos: int or (B,) ints, the position
        p_b each token is written at; cache: the model's :class:`~minillama.kvcache.KVCache`.
        Computes exactly :meth:`minillama.model.Transformer.forward` at T = 1 with
        ``last_only`` (rmsnorm, linear, rope, attention over positions 0..p_b, swiglu, head;
        see :mod:`.decode`) and writes k, v at p_b. Returns logits (B, V). Declines
        (None: the model runs its per-op path) for model variants it does not implement, T > 1
        and caches it cannot write in place.
        """
        B, T = tok.shape
        if T != 1 or cache.batch_size != B:
            return None
        plan = self._decode_plan(model)
        if plan is None or (B > 1 and plan.get("quant")):  # quantized: one sequence only
            return None
        kv = self._cache_lists(cache, model.dtype)
        if kv is None:
            return None
        kc, vc = kv
        if isinstance(start_pos, (int, np.integer)):
            lo = hi = int(start_pos)
            pos = np.full(B, lo, dtype=np.int64)
        else:
            pos = np.ascontiguousarray(
                np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,)))
            lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= model.cfg.max_seq_len:
            raise MinillamaError(f"positions up to {hi} exceed the model context of "
                                 f"{model.cfg.max_seq_len}")
        if hi >= cache.max_seq_len:
            raise MinillamaError(f"sequence of {hi + 1} positions exceeds the KV cache length "
                                 f"{cache.max_seq_len}")
        logits = np.empty((B, _vocab(plan)), dtype=model.dtype)
        if B == 1:
            self._step_one(plan, np.ascontiguousarray(tok[:, 0], dtype=np.int64), pos, kc, vc,
                           logits, _NO_IDS, _NO_IDS)
        else:
            args = (np.ascontiguousarray(tok[:, 0], dtype=np.int64), pos,
                    *_model_args(plan, kc, vc), logits, self.num_threads)
            self._decode.decode_step(*args, _NO_IDS, _NO_IDS_2D)
        return logits

    def greedy_steps(self, model, tok, start_pos, cache, k: int):
        """Up to ``k`` greedy decode steps of B > 1 sequences in one compiled call, or None to
        decline (the caller steps one token at a time). tok: (B,) the tokens to feed; start_pos:
        (B,) their positions (each sequence then advances by one per step, capped at the cache's
        last slot). Returns ids (B, k'), k' <= k: the argmax of each step's logits per sequence;
        -1 where a row held NaN/inf (the call ended after that step)."""
        B = len(tok)
        plan = self._decode_plan(model)
        kv = self._cache_lists(cache, model.dtype) if plan is not None else None
        if B < 2 or kv is None or cache.batch_size != B or k < 1 or plan.get("quant"):
            return None
        pos = np.ascontiguousarray(start_pos, dtype=np.int64).reshape(B)
        if pos.min() < 0 or pos.max() >= cache.max_seq_len:
            raise MinillamaError(f"positions up to {int(pos.max())} exceed the KV cache length "
                                 f"{cache.max_seq_len}")
        ids = np.empty((B, int(k)), dtype=np.int64)
        logits = np.empty((B, _vocab(plan)), dtype=model.dtype)
        n = self._decode.decode_step(
            np.ascontiguousarray(tok, dtype=np.int64).reshape(B), pos, *_model_args(plan, *kv),
            logits, self.num_threads, _NO_IDS, ids)
        return ids[:, :n]

    def greedy_decoder(self, model, max_seq_len: int, stop_ids=()):
        """A :class:`GreedyDecoder` for one sequence of ``model`` and a cache of ``max_seq_len``
        positions (greedy decoding, several steps per compiled call, ending a call at a token
        of ``stop_ids``), or None where the fused step does not apply."""
        if self._decode_plan(model) is None:
            return None
        dec = GreedyDecoder(self, model, max_seq_len, stop_ids)
        return dec if self._cache_lists(dec.cache, model.dtype) is not None else None

    # -----------------------------------------------------------------------------------------
    # RMSNorm and SwiGLU: one Numba pass per row, row blocks over the Numba threads
    # -----------------------------------------------------------------------------------------
    def _parts(self, n_rows: int, n_elements: int) -> int:
        """Row blocks for a row-wise kernel: one per Numba thread, or 1 (run on the calling
        thread) below :data:`.cpu_threads.PARALLEL_MIN_ELEMENTS` elements."""
        if n_elements < cpu_threads.PARALLEL_MIN_ELEMENTS:
            return 1
        return max(1, min(self.num_threads, n_rows))

    def rmsnorm_forward(self, x, g, eps):
        r"""y = x r \odot g, r = 1/\sqrt{\mathrm{mean}(x^2) + \epsilon} (see
        :func:`minillama.ops.rmsnorm_forward`): one pass per row (Numba). x: (..., D); g: (D,).
        Returns (y (..., D), ctx (x, r (..., 1), g))."""
        dt = x.dtype
        if dt not in _FLOATS or g.dtype != dt or x.shape[-1] == 0 or g.shape != x.shape[-1:]:
            return super().rmsnorm_forward(x, g, eps)
        D = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, D)
        N = x2.shape[0]
        y = np.empty((N, D), dtype=dt)
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
        :func:`minillama.ops.swiglu_forward`): one pass (Numba); a, b and \sigma(a) are saved.
        a, b: (..., F). Returns (h (..., F), ctx)."""
        dt = a.dtype
        if dt not in _FLOATS or b.dtype != dt or a.shape != b.shape or a.size == 0:
            return super().swiglu_forward(a, b)
        F = a.shape[-1]
        a2 = np.ascontiguousarray(a).reshape(-1, F)
        b2 = np.ascontiguousarray(b).reshape(-1, F)
        N = a2.shape[0]
        h = np.empty((N, F), dtype=dt)
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

    # -----------------------------------------------------------------------------------------
    # RoPE
    # -----------------------------------------------------------------------------------------
    def _rope(self, x, cos, sin, inverse: bool, out):
        if x.ndim != 4 or x.shape[-1] % 2:
            raise MinillamaError(f"RoPE expects (B, T, nh, hd) with even hd, got {x.shape}")
        B, T, _, hd = x.shape
        cos = np.asarray(cos, dtype=x.dtype)
        sin = np.asarray(sin, dtype=x.dtype)
        if cos.ndim == 2:
            cos3, sin3, bsel = cos[None], sin[None], 0
        else:
            cos3, sin3, bsel = cos, sin, 1
        if (cos3.shape[1:] != (T, hd // 2) or cos3.shape[0] not in (1, B)
                or sin3.shape != cos3.shape):
            raise MinillamaError(
                f"RoPE tables of shape {cos.shape} do not match x of shape {x.shape}")
        if bsel and cos3.shape[0] != B:
            raise MinillamaError(f"per-sequence RoPE tables {cos.shape} need B={B} rows")
        if out is None:
            out = np.empty_like(x)
        par = x.size >= ROPE_PARALLEL_MIN_SIZE and self.num_threads > 1
        kern = self._k.rope_parallel if par else self._k.rope_serial
        kern(x, cos3, sin3, bsel, inverse, out)
        return out

    def rope_forward(self, x, cos, sin, out=None):
        r"""RoPE (see :func:`minillama.ops.rope_forward`): for every pair i of every head,

        y_{2i} = x_{2i} \cos(m\theta_i) - x_{2i+1} \sin(m\theta_i),
        y_{2i+1} = x_{2i} \sin(m\theta_i) + x_{2i+1} \cos(m\theta_i).

        x: (B, T, nh, hd); cos, sin: (T, hd/2) or (B, T, hd/2). Returns (y (B, T, nh, hd), ctx).
        ``out=x`` rotates in place (each pair is read before it is written).
        """
        if x.dtype not in _FLOATS:
            return ops.rope_forward(x, cos, sin)
        return self._rope(x, cos, sin, False, out), (cos, sin)

    def rope_backward(self, dy, ctx, out=None):
        r"""The inverse rotation: dx_{2i} = dy_{2i}\cos + dy_{2i+1}\sin,
        dx_{2i+1} = -dy_{2i}\sin + dy_{2i+1}\cos. dy: (B, T, nh, hd); ``out=dy`` works in place."""
        if dy.dtype not in _FLOATS:
            return ops.rope_backward(dy, ctx)
        cos, sin = ctx
        return self._rope(dy, cos, sin, True, out)

    # -----------------------------------------------------------------------------------------
    # attention
    # -----------------------------------------------------------------------------------------
    def _tiled(self, T: int) -> bool:
        """Whether attention over T query positions takes the BLAS-tiled kernels."""
        return T >= TILED_MIN_T and self._blas.available()

    def _gemm_fn(self, dt):
        """(address, ilp64) of OpenBLAS's GEMM for dtype ``dt`` (see :mod:`.blas`)."""
        return self._blas.gemm_address(dt)

    def attention_forward(self, q, k, v, start_pos=0):
        r"""Causal GQA attention (same contract as :func:`minillama.ops.attention_forward`):

        s_{tj} = q_t \cdot k_j / \sqrt{hd} for j \le p_b + t,
        o_t = \sum_j \mathrm{softmax}_j(s_t)_j v_j,

        query head h reading KV head h // G. q: (B, T, H, hd); k, v: (B, S, KVH, hd);
        start_pos: int or (B,) ints (query t of sequence b sits at p_b + t). Returns
        (o (B, T, H, hd), ctx) where ctx keeps q, k, v, o and the row log-sum-exp (B, H, T):
        O(B H T) beyond the inputs and output, never a (T, S) matrix.
        """
        if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
            raise MinillamaError(
                f"attention expects q (B,T,H,hd) and k, v (B,S,KVH,hd), got {q.shape}, "
                f"{k.shape}, {v.shape}")
        B, T, H, hd = q.shape
        S, KVH = k.shape[1], k.shape[2]
        if k.shape[0] != B or k.shape[3] != hd or KVH == 0 or H % KVH:
            raise MinillamaError(
                f"attention shapes do not fit: q {q.shape}, k/v {k.shape} (need same B and hd, "
                f"H a multiple of KVH)")
        dt = np.result_type(q.dtype, k.dtype, v.dtype)
        if dt not in _FLOATS:
            return ops.attention_forward(q, k, v, start_pos)
        q, k, v = (a if a.dtype == dt else a.astype(dt) for a in (q, k, v))
        starts = np.ascontiguousarray(
            np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,)))
        if starts.min(initial=0) < 0:
            raise MinillamaError(f"attention start positions must be >= 0, got {start_pos}")
        scale = dt.type(1.0 / math.sqrt(hd))
        out = np.empty((B, T, H, hd), dtype=dt)
        lse = np.empty((B, H, T), dtype=dt)
        if B * T * H:
            keys = int(min(S, int(starts.max()) + T))
            work = 2 * B * H * T * keys * hd
            par = self._parallel(work)
            if T <= DECODE_MAX_T:
                nsplit = 1
                if par and B < 2 * self.num_threads:
                    # few sequences: split the keys so that every thread gets work
                    nsplit = max(1, min(-(-2 * self.num_threads // B), keys // DECODE_MIN_CHUNK))
                pm = np.empty((B * nsplit, T * H), dtype=dt)
                pl = np.empty((B * nsplit, T * H), dtype=dt)
                pacc = np.empty((B * nsplit, T * H, hd), dtype=dt)
                kern = self._k.attn_dec_parallel if par else self._k.attn_dec_serial
                kern(q, k, v, starts, scale, nsplit, pm, pl, pacc, out, lse)
            elif self._tiled(T):
                q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
                fn, ilp64 = self._gemm_fn(dt)
                with cpu_threads.single_threaded_blas():
                    self._k.attn_fwd_blas(fn, ilp64, q, k, v, starts, scale, dt.type(1), TILE_BQ,
                                          TILE_BK, out, lse)
            else:
                kern = self._k.attn_fwd_parallel if par else self._k.attn_fwd_serial
                kern(q, k, v, starts, scale, out, lse)
        return out, (q, k, v, out, lse, starts, scale)

    def attention_backward(self, dout, ctx):
        r"""Gradients of causal GQA attention, recomputing P_{tj} = e^{s_{tj} - lse_t} tile by tile:

        D_t = dO_t \cdot O_t,  dS = P \odot (dO V^T - D),  dQ = dS K / \sqrt{hd},
        dK = \sum_{g} dS^T Q / \sqrt{hd},  dV = \sum_{g} P^T dO.

        dout: (B, T, H, hd). Returns (dq (B, T, H, hd), dk, dv (B, S, KVH, hd)).
        """
        if len(ctx) != 7:  # a reference ctx (non-float inputs fell back to the reference)
            return ops.attention_backward(dout, ctx)
        q, k, v, out, lse, starts, scale = ctx
        if dout.shape != q.shape:
            raise MinillamaError(f"attention dout shape {dout.shape} != output shape {q.shape}")
        dout = dout if dout.dtype == q.dtype else dout.astype(q.dtype)
        B, T, H, hd = q.shape
        S = k.shape[1]
        dq = np.empty_like(q, order="C")
        dk = np.empty(k.shape, dtype=q.dtype)
        dv = np.empty(k.shape, dtype=q.dtype)
        if self._tiled(T) and B * H:
            fn, ilp64 = self._gemm_fn(q.dtype)
            dout = np.ascontiguousarray(dout)
            with cpu_threads.single_threaded_blas():
                self._k.attn_bwd_blas(fn, ilp64, q, k, v, out, dout, lse, starts, scale,
                                      q.dtype.type(1), TILE_BQ, TILE_BK, dq, dk, dv)
            return dq, dk, dv
        keys = int(min(S, int(starts.max()) + T)) if B else 0
        work = 4 * B * H * T * keys * hd
        kern = self._k.attn_bwd_parallel if self._parallel(work) else self._k.attn_bwd_serial
        if B * H:
            kern(q, k, v, out, dout, lse, starts, scale, dq, dk, dv)
        return dq, dk, dv

    # -----------------------------------------------------------------------------------------
    # softmax cross-entropy
    # -----------------------------------------------------------------------------------------
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
        (see :func:`minillama.ops.cross_entropy_forward`):

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


_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS_2D = np.zeros((0, 0), dtype=np.int64)


def _vocab(plan) -> int:
    """V of a decode plan (float or quantized)."""
    return plan["V"] if plan.get("quant") else plan["emb"].shape[0]


def _model_args(plan, kc, vc):
    """The arguments of the :mod:`.decode` kernels between the positions and the logits:
    the weights of ``plan`` (:meth:`NumbaBackend._decode_plan`), the cache lists kc, vc, the
    RoPE tables and the constants."""
    return (plan["emb"], plan["out"], plan["norm"], *plan["layers"], kc, vc, plan["cos"],
            plan["sin"], plan["eps"], plan["heads"], plan["zero"])


class GreedyDecoder(ChunkDecoder):
    """Greedy decoding of one sequence on the numba backend, many steps per compiled call.

    :func:`.decode.decode_step_one` with an ``ids`` buffer of k entries runs k greedy
    steps (each token is the argmax of the previous step's logits) without returning to Python,
    so the per-token Python work of the eager loop (the model call, checks, the argmax and the
    bookkeeping, about 0.1 ms a token) is paid once per call. The interface is that of the
    CUDA-graph decoder (``prefill``, ``room``, ``more``, ``cache``, ``S``), driven by
    :func:`minillama.generate.stream_greedy`; ``stop`` ends a call early (the stop id is the
    last one returned)."""

    def __init__(self, backend, model, max_seq_len: int, stop_ids=()):
        self.backend = backend
        self.model = model
        self.cache = model.new_cache(1, max_seq_len)
        self.S = self.cache.max_seq_len
        self.stop = np.array(sorted({int(t) for t in stop_ids}), dtype=np.int64)
        self._P = None  # prompt length
        self._done = 0  # ids decoded so far, the prefill's included
        self._last = 0  # the last id decoded (fed at the next step)

    def prefill(self, prompt) -> np.ndarray:
        """Run the (1, P) prompt through the model (per-op path, BLAS), filling the cache; the
        first new id (argmax of the last position's logits), shape (1,)."""
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 2 or prompt.shape[0] != 1:
            raise MinillamaError(f"prompt must be (1, P) token ids, got {prompt.shape}")
        P = prompt.shape[1]
        if not 1 <= P <= self.S:
            raise MinillamaError(f"a prompt of {P} tokens does not fit the cache of {self.S}")
        z = _finite(self.model.forward(prompt, 0, self.cache, last_only=True), "the prompt")
        self._last = int(z[0].argmax())
        self._P, self._done = P, 1
        return np.array([self._last], dtype=np.int64)

    def more(self, k: int) -> np.ndarray:
        """Up to ``k`` more greedy ids, (1, k') with k' = k unless a stop id came first (then it
        is the last id). Raises on logits holding NaN/inf."""
        k = self._check_more(k)
        ids = np.empty(k, dtype=np.int64)
        if k == 0:
            return ids[None]
        be, m = self.backend, self.model
        plan = be._decode_plan(m)
        kc, vc = be._cache_lists(self.cache, m.dtype)
        p0 = self._P + self._done - 1  # where the last id goes
        logits = np.empty((1, _vocab(plan)), dtype=m.dtype)
        n = be._step_one(plan, np.array([self._last], dtype=np.int64),
                         np.array([p0], dtype=np.int64), kc, vc, logits, self.stop, ids)
        ids = ids[:n]
        if n and ids[-1] < 0:
            raise nonfinite_error(f"position {p0 + n - 1}")
        self._done += n
        self._last = int(ids[-1])
        return ids[None]
