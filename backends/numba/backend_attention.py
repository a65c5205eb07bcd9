"""RoPE and causal GQA attention of the ``numba`` backend, a mixin of
:class:`~minillama.backends.numba.backend.NumbaBackend` (the paths are described in that module's
docstring): the checks and the choice of kernel in Python, the loops in :mod:`.kernels`. The
thresholds and tile sizes below are read at call time, so tests and benchmarks may set them."""

from __future__ import annotations

import math

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError

from ..numpy import threads as cpu_threads
from .backend_decode import in_prompt_rows

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

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


class AttentionOps:
    """RoPE and attention, forward and backward, on the Numba kernels (``self._k``) and OpenBLAS
    (``self._blas``)."""

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
        r"""RoPE (see :func:`minillama.core.ops.rope_forward`): for every pair i of every head,

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
        """(address, ilp64) of OpenBLAS's GEMM for dtype ``dt`` (see :mod:`.floats.blas`)."""
        return self._blas.gemm_address(dt)

    def attention_forward(self, q, k, v, start_pos=0):
        r"""Causal GQA attention (same contract as :func:`minillama.core.ops.attention_forward`):

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
        starts = np.array(  # a writable copy: one array type for the kernels
            np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,)))
        if starts.min(initial=0) < 0:
            raise MinillamaError(f"attention start positions must be >= 0, got {start_pos}")
        scale = dt.type(1.0 / math.sqrt(hd))
        out = np.empty((B, T, H, hd), dtype=dt)
        lse = np.empty((B, H, T), dtype=dt)
        if B * T * H and dt == np.float32 and in_prompt_rows():  # rows as the decode steps
            self._attend_rows_alike(q, k, v, starts, scale, out, lse)
        elif B * T * H:
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

    def _attend_rows_alike(self, q, k, v, starts, scale, out, lse):
        """Every query row as the decode steps attend
        (:func:`.floats.attention_forward.attend_rows`), within
        :meth:`~.backend_decode.FusedDecode.prompt_rows`; inference only (lse left NaN)."""
        T, S = q.shape[1], k.shape[1]
        if int(starts.max()) + T > S:
            raise MinillamaError(f"attention reads {int(starts.max()) + T} positions of a cache "
                                 f"of {S}")
        lse.fill(np.nan)
        self._qdecode.attend_rows(*(np.ascontiguousarray(a) for a in (q, k, v)), starts, scale,
                                  out)

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
