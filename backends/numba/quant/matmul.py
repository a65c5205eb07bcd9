r"""Products with a weight kept in its GGML blocks (:class:`minillama.core.quant.QuantMatrix`).

y = x W^T (:func:`qmatmul`) and dx = dy W (:func:`qmatmul_t`, for training through a frozen
quantized weight) read W's blocks directly; W is never held dequantized as a whole.

Method: each block is decoded into float32 values in registers (w = d q or w = d q - m with the
block's scales and small integer codes q) and dotted with float32 activations, summed in float32:
the result is the product with the dequantized matrix up to float32 rounding (docs/MATH.md,
"Quantized products"). Exception, by default: x times a type of :data:`.int8_dots.INT8_TYPES`
rounds x to 8-bit blocks and takes integer dots, :mod:`.int8_dots` for few rows, the integer GEMM
tiles of :mod:`.int8_gemm` for more (``MINILLAMA_QUANT_DOTS=float`` keeps both in float32).

* few rows in x (decoding, M <= :data:`GEMV_MAX_ROWS`): one call per (row of W, row of x) of a
  row kernel of :mod:`.unpack` (explicit LLVM vector code: unpack, convert, scale, FMA into a
  vector accumulator, one horizontal sum per row), the rows of W split over the Numba threads
  from :data:`PARALLEL_MIN_WORK` on;
* more rows (prefill, training), float32 activations: each thread dequantizes a tile of
  :data:`TILE_N` rows of W into its own float32 buffer (the same vector decoding, stored) and
  multiplies it by x with OpenBLAS's GEMM (:mod:`..floats.blas`), or NumPy's matmul when no OpenBLAS
  was found.

Every type of :data:`minillama.core.quant.QUANT_TYPES` is supported (:mod:`.block_types` has their
ids and block sizes as the kernels' constants); IQ4_XS (and IQ4_NL without AVX-512) runs plain Numba
loops, whose fp16 fields are read through a 65536-entry float32 table.
Imported only by the numba backend.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minillama.core.errors import MinillamaError
from minillama.core.quant import IQ4_GRID, QUANT_TYPES, QuantMatrix

from ...numpy import threads as cpu_threads
from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..floats import blas
from . import unpack
from .block_types import (
    IQ4_NL,
    IQ4_NL_BYTES,
    IQ4_XS,
    IQ4_XS_BYTES,
    Q2_K,
    Q2_K_BYTES,
    Q3_K,
    Q3_K_BYTES,
    Q4_0,
    Q4_0_BYTES,
    Q4_1,
    Q4_1_BYTES,
    Q4_K,
    Q4_K_BYTES,
    Q5_0,
    Q5_0_BYTES,
    Q5_1,
    Q5_1_BYTES,
    Q5_K,
    Q5_K_BYTES,
    Q6_K,
    Q6_K_BYTES,
    Q8_0,
    Q8_0_BYTES,
)

_opts = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")

#: whether 4-bit codes are looked up in AVX-512 tables (:data:`.unpack.LOOKUP`), as a plain
#: global: a kernel's branch on it is pruned, so the branch naming a kernel that does not exist
#: on other CPUs (``unpack.row_iq4_nl`` is None there) is never typed
_LOOKUP = unpack.LOOKUP

#: at most this many rows of x take the fused dot kernels; more rows dequantize tiles + GEMM
GEMV_MAX_ROWS = 8
#: rows of W per dequantized tile of the GEMM path
TILE_N = 64
#: the few-row kernel splits W's rows over the threads from this many weights x rows on
#: (about 0.1 ms of one core); below, one thread (waking the pool costs more)
PARALLEL_MIN_WORK = 1 << 20

#: the GGML type ids the kernels below decode (:func:`qcode` refuses the others)
KERNEL_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)

#: float32 value of every fp16 bit pattern
_F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
#: the 16 values of a 4-bit IQ4_NL / IQ4_XS code (the kernels' ``kv``): the core's table itself
_KVALUES = IQ4_GRID


# ---------------------------------------------------------------------------------------------
# block fields
# ---------------------------------------------------------------------------------------------
@njit(inline="always", **_opts)
def _h(w, n, o, lut):
    """The fp16 at bytes o, o+1 of row n, as float32."""
    return lut[np.int64(w[n, o]) | (np.int64(w[n, o + 1]) << 8)]


@njit(inline="always", **_opts)
def _u32(w, n, o):
    return (np.uint32(w[n, o]) | (np.uint32(w[n, o + 1]) << 8) | (np.uint32(w[n, o + 2]) << 16)
            | (np.uint32(w[n, o + 3]) << 24))


@njit(inline="always", **_opts)
def _i8(w, n, o):
    """The int8 at byte o of row n, as float32."""
    v = np.int64(w[n, o])
    return np.float32(v - ((v & 128) << 1))


@njit(inline="always", **_opts)
def _scale_min_k4(w, n, o, j):
    """6-bit (scale, min) of sub-block j of a Q4_K / Q5_K block whose 12 scale bytes start at o."""
    if j < 4:
        return np.int64(w[n, o + j] & 63), np.int64(w[n, o + j + 4] & 63)
    sc = (w[n, o + j + 4] & 15) | ((w[n, o + j - 4] >> 6) << 4)
    mn = (w[n, o + j + 4] >> 4) | ((w[n, o + j] >> 6) << 4)
    return np.int64(sc), np.int64(mn)


@njit(inline="always", **_opts)
def _scale_q3k(w, n, o, i):
    """Signed 6-bit scale i (0..15) of a Q3_K block whose 12 scale bytes start at o."""
    lo = (w[n, o + (i & 7)] >> (4 * (i >> 3))) & 15
    hi = (w[n, o + 8 + (i & 3)] >> (2 * (i >> 2))) & 3
    return np.int64(lo | (hi << 4)) - 32


# ---------------------------------------------------------------------------------------------
# dot of row n of W with row m of x: vector code of .unpack for every type but the IQ4 ones
# ---------------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS (a 16-entry table of values): Numba loops. L = 16 always, passed at run time:
# with a constant trip count LLVM unrolls the loop over a block and vectorises the loop over the
# blocks instead, gathering single bytes
@njit(**_opts)
def _dot_iq4_nl(w, n, x, m, lut, kv, L):
    acc = np.float32(0)
    for b in range(x.shape[1] // 32):
        o, p = b * IQ4_NL_BYTES, b * 32
        s = np.float32(0)
        for j in range(L):
            v = w[n, o + 2 + j]
            s += kv[v & 15] * x[m, p + j] + kv[v >> 4] * x[m, p + 16 + j]
        acc += _h(w, n, o, lut) * s
    return acc


@njit(**_opts)
def _dot_iq4_xs(w, n, x, m, lut, kv, L):
    acc = np.float32(0)
    for b in range(x.shape[1] // 256):
        o, p = b * IQ4_XS_BYTES, b * 256
        d = _h(w, n, o, lut)
        sh = np.int64(w[n, o + 2]) | (np.int64(w[n, o + 3]) << 8)
        for ib in range(8):
            ls = ((w[n, o + 4 + ib // 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
            q = o + 8 + 16 * ib
            s = np.float32(0)
            for j in range(L):
                v = w[n, q + j]
                s += kv[v & 15] * x[m, p + 32 * ib + j] + kv[v >> 4] * x[m, p + 32 * ib + 16 + j]
            acc += d * np.float32(np.int64(ls) - 32) * s
    return acc


@njit(inline="always", **_opts)
def _dot(qt, w, n, x, m, lut, kv, L):
    K = x.shape[1]
    pw = w.ctypes.data + n * w.shape[1]
    px = x.ctypes.data + m * K * 4
    if qt == Q8_0:
        return unpack.row_q8_0(pw, px, K // 32)
    if qt == Q4_0:
        return unpack.row_q4_0(pw, px, K // 32)
    if qt == Q4_1:
        return unpack.row_q4_1(pw, px, K // 32)
    if qt == Q5_0:
        return unpack.row_q5_0(pw, px, K // 32)
    if qt == Q5_1:
        return unpack.row_q5_1(pw, px, K // 32)
    if qt == IQ4_NL:
        if _LOOKUP:  # a global constant: Numba prunes the branch whose kernel does not exist
            return unpack.row_iq4_nl(pw, px, K // 32)
        return _dot_iq4_nl(w, n, x, m, lut, kv, L)
    if qt == IQ4_XS:
        return _dot_iq4_xs(w, n, x, m, lut, kv, L)
    if qt == Q4_K:
        return unpack.row_q4_k(pw, px, K // 256)
    if qt == Q5_K:
        return unpack.row_q5_k(pw, px, K // 256)
    if qt == Q6_K:
        return unpack.row_q6_k(pw, px, K // 256)
    if qt == Q3_K:
        return unpack.row_q3_k(pw, px, K // 256)
    return unpack.row_q2_k(pw, px, K // 256)


@njit(parallel=True, **_opts)
def _gemv_parallel(qt, x, w, y, lut, kv, L, parts):  # pragma: no cover - compiled
    N = w.shape[0]
    step = (N + parts - 1) // parts
    for t in prange(parts):
        for n in range(t * step, min(N, t * step + step)):
            for m in range(x.shape[0]):
                y[m, n] = _dot(qt, w, n, x, m, lut, kv, L)


@njit(**_opts)
def _gemv_serial(qt, x, w, y, lut, kv, L):  # pragma: no cover - compiled
    for n in range(w.shape[0]):
        for m in range(x.shape[0]):
            y[m, n] = _dot(qt, w, n, x, m, lut, kv, L)


# ---------------------------------------------------------------------------------------------
# dequantization of rows: out[r, :] = W[n0 + r, :]
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def _dequant_row(qt, w, n, out, r, lut, kv):  # pragma: no cover - compiled
    K = out.shape[1]
    pw = w.ctypes.data + n * w.shape[1]
    po = out.ctypes.data + r * K * 4
    if qt == Q8_0:
        unpack.deq_q8_0(pw, po, K // 32)
    elif qt == Q4_0:
        unpack.deq_q4_0(pw, po, K // 32)
    elif qt == Q4_1:
        unpack.deq_q4_1(pw, po, K // 32)
    elif qt == Q5_0:
        unpack.deq_q5_0(pw, po, K // 32)
    elif qt == Q5_1:
        unpack.deq_q5_1(pw, po, K // 32)
    elif qt == IQ4_NL:
        if _LOOKUP:  # a global constant: Numba prunes the branch whose kernel does not exist
            unpack.deq_iq4_nl(pw, po, K // 32)
        else:
            _dequant_row_loops(qt, w, n, out, r, lut, kv)
    elif qt == Q4_K:
        unpack.deq_q4_k(pw, po, K // 256)
    elif qt == Q5_K:
        unpack.deq_q5_k(pw, po, K // 256)
    elif qt == Q6_K:
        unpack.deq_q6_k(pw, po, K // 256)
    elif qt == Q3_K:
        unpack.deq_q3_k(pw, po, K // 256)
    elif qt == Q2_K:
        unpack.deq_q2_k(pw, po, K // 256)
    else:
        _dequant_row_loops(qt, w, n, out, r, lut, kv)


@njit(**_opts)
def _dequant_row_loops(qt, w, n, out, r, lut, kv):  # pragma: no cover - compiled
    """The same in Numba loops (the IQ4 types; IQ4_NL without AVX-512)."""
    K = out.shape[1]
    if qt == Q8_0:
        for b in range(K // 32):
            o, p = b * Q8_0_BYTES, b * 32
            d = _h(w, n, o, lut)
            for j in range(32):
                v = np.int32(w[n, o + 2 + j])
                out[r, p + j] = d * np.float32(v - ((v & 128) << 1))
    elif qt == Q4_0 or qt == Q4_1 or qt == IQ4_NL:
        # IQ4_NL has Q4_0's layout (d, 16 bytes of nibbles), only its levels differ
        size, q0 = (Q4_0_BYTES, 2) if qt != Q4_1 else (Q4_1_BYTES, 4)
        for b in range(K // 32):
            o, p = b * size, b * 32
            d = _h(w, n, o, lut)
            mn = _h(w, n, o + 2, lut) if qt == Q4_1 else np.float32(-8) * d
            for j in range(16):
                v = w[n, o + q0 + j]
                if qt == IQ4_NL:
                    out[r, p + j] = d * kv[v & 15]
                    out[r, p + 16 + j] = d * kv[v >> 4]
                else:
                    out[r, p + j] = d * np.float32(v & 15) + mn
                    out[r, p + 16 + j] = d * np.float32(v >> 4) + mn
    elif qt == Q5_0 or qt == Q5_1:
        size, q0 = (Q5_0_BYTES, 6) if qt == Q5_0 else (Q5_1_BYTES, 8)
        for b in range(K // 32):
            o, p = b * size, b * 32
            d = _h(w, n, o, lut)
            mn = _h(w, n, o + 2, lut) if qt == Q5_1 else np.float32(-16) * d
            qh = _u32(w, n, o + q0 - 4)
            for j in range(16):
                v = np.uint32(w[n, o + q0 + j])
                lo = (v & 15) | (((qh >> j) & 1) << 4)
                hi = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[r, p + j] = d * np.float32(lo) + mn
                out[r, p + 16 + j] = d * np.float32(hi) + mn
    elif qt == Q4_K or qt == Q5_K:
        size = Q4_K_BYTES if qt == Q4_K else Q5_K_BYTES
        q0 = 16 if qt == Q4_K else 48
        for b in range(K // 256):
            o, p = b * size, b * 256
            d, dmin = _h(w, n, o, lut), _h(w, n, o + 2, lut)
            for c in range(4):
                sc1, m1 = _scale_min_k4(w, n, o + 4, 2 * c)
                sc2, m2 = _scale_min_k4(w, n, o + 4, 2 * c + 1)
                d1, d2 = d * np.float32(sc1), d * np.float32(sc2)
                n1, n2 = dmin * np.float32(m1), dmin * np.float32(m2)
                for j in range(32):
                    v = w[n, o + q0 + 32 * c + j]
                    lo, hi = v & 15, v >> 4
                    if qt == Q5_K:
                        h = w[n, o + 16 + j] >> (2 * c)
                        lo |= (h & 1) << 4
                        hi |= (h & 2) << 3
                    out[r, p + 64 * c + j] = d1 * np.float32(lo) - n1
                    out[r, p + 64 * c + 32 + j] = d2 * np.float32(hi) - n2
    elif qt == Q6_K:
        for b in range(K // 256):
            o, p = b * Q6_K_BYTES, b * 256
            d = _h(w, n, o + 208, lut)
            for c in range(2):
                ql, qh, xp = o + 64 * c, o + 128 + 32 * c, p + 128 * c
                for l in range(32):
                    sc = o + 192 + 8 * c + l // 16
                    a = w[n, ql + l]
                    e = w[n, ql + 32 + l]
                    h = w[n, qh + l]
                    out[r, xp + l] = d * _i8(w, n, sc) * np.float32(
                        np.int64((a & 15) | ((h & 3) << 4)) - 32)
                    out[r, xp + 32 + l] = d * _i8(w, n, sc + 2) * np.float32(
                        np.int64((e & 15) | ((h & 12) << 2)) - 32)
                    out[r, xp + 64 + l] = d * _i8(w, n, sc + 4) * np.float32(
                        np.int64((a >> 4) | (h & 48)) - 32)
                    out[r, xp + 96 + l] = d * _i8(w, n, sc + 6) * np.float32(
                        np.int64((e >> 4) | ((h & 192) >> 2)) - 32)
    elif qt == Q3_K or qt == Q2_K:
        size = Q3_K_BYTES if qt == Q3_K else Q2_K_BYTES
        q0 = 32 if qt == Q3_K else 16
        for b in range(K // 256):
            o, p = b * size, b * 256
            if qt == Q3_K:
                d, dmin = _h(w, n, o + 108, lut), np.float32(0)
            else:
                d, dmin = _h(w, n, o + 80, lut), _h(w, n, o + 82, lut)
            for c in range(2):
                for g in range(4):
                    for half in range(2):
                        i = 8 * c + 2 * g + half
                        if qt == Q3_K:
                            dl, ml = d * np.float32(_scale_q3k(w, n, o + 96, i)), np.float32(0)
                        else:
                            dl = d * np.float32(w[n, o + i] & 15)
                            ml = dmin * np.float32(w[n, o + i] >> 4)
                        for l in range(16 * half, 16 * half + 16):
                            q = np.int64((w[n, o + q0 + 32 * c + l] >> (2 * g)) & 3)
                            if qt == Q3_K:
                                q += 4 * np.int64((w[n, o + l] >> (4 * c + g)) & 1) - 4
                            out[r, p + 128 * c + 32 * g + l] = dl * np.float32(q) - ml
    else:  # IQ4_XS
        for b in range(K // 256):
            o, p = b * IQ4_XS_BYTES, b * 256
            d = _h(w, n, o, lut)
            sh = np.int64(w[n, o + 2]) | (np.int64(w[n, o + 3]) << 8)
            for ib in range(8):
                ls = (((w[n, o + 4 + ib // 2] >> (4 * (ib % 2))) & 15)
                      | (((sh >> (2 * ib)) & 3) << 4))
                dl = d * np.float32(np.int64(ls) - 32)
                for j in range(16):
                    v = w[n, o + 8 + 16 * ib + j]
                    out[r, p + 32 * ib + j] = dl * kv[v & 15]
                    out[r, p + 32 * ib + 16 + j] = dl * kv[v >> 4]


@njit(parallel=True, **_opts)
def _dequant_rows(qt, w, n0, out, lut, kv):  # pragma: no cover - compiled
    for r in prange(out.shape[0]):
        _dequant_row(qt, w, n0 + r, out, r, lut, kv)


@njit(parallel=True, **_opts)
def _take_rows(qt, w, ids, out, lut, kv):  # pragma: no cover - compiled
    for r in prange(out.shape[0]):
        _dequant_row(qt, w, ids[r], out, r, lut, kv)


# ---------------------------------------------------------------------------------------------
# many rows: dequantized tiles of W times x by OpenBLAS, one tile per prange item
# ---------------------------------------------------------------------------------------------
@njit(parallel=True, **_opts)
def _gemm_tiles(qt, x, w, y, lut, kv, fn, ilp64, tile):  # pragma: no cover - compiled
    """y[:, n0:n1] = x W[n0:n1]^T for tiles of ``tile`` rows of W."""
    M, K = x.shape
    N = w.shape[0]
    nt = (N + tile - 1) // tile
    px, py = x.ctypes.data, y.ctypes.data
    one, zero = np.float32(1), np.float32(0)
    for t in prange(nt):
        n0 = t * tile
        rows = min(N, n0 + tile) - n0
        buf = np.empty((rows, K), dtype=np.float32)
        for r in range(rows):
            _dequant_row(qt, w, n0 + r, buf, r, lut, kv)
        blas.gemm(fn, ilp64, False, True, M, rows, K, one, px, K, buf.ctypes.data, K, zero,
                  py + n0 * 4, N)


@njit(parallel=True, **_opts)
def _gemm_t_tiles(qt, dy, w, acc, lut, kv, fn, ilp64, tile):  # pragma: no cover - compiled
    """acc[p] = sum over the tiles of part p of dy[:, n0:n1] W[n0:n1] (parts: acc.shape[0])."""
    M, N = dy.shape
    K = acc.shape[2]
    parts = acc.shape[0]
    nt = (N + tile - 1) // tile
    per = (nt + parts - 1) // parts
    pdy = dy.ctypes.data
    one = np.float32(1)
    for part in prange(parts):
        buf = np.empty((tile, K), dtype=np.float32)
        pa = acc[part].ctypes.data
        for t in range(part * per, min(nt, part * per + per)):
            n0 = t * tile
            rows = min(N, n0 + tile) - n0
            for r in range(rows):
                _dequant_row(qt, w, n0 + r, buf, r, lut, kv)
            blas.gemm(fn, ilp64, False, False, M, K, rows, one, pdy + n0 * 4, N,
                      buf.ctypes.data, K, one, pa, K)


# ---------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------
def _check(w: QuantMatrix, K: int, what: str) -> None:
    if K != w.shape[1 if what == "x" else 0]:
        raise ValueError(f"qmatmul: {what} has {K} columns, W is {w.shape}")


def dequantize_rows(w: QuantMatrix, n0: int = 0, n1: int | None = None) -> np.ndarray:
    """W[n0:n1] as float32 (n1 - n0, K)."""
    n1 = w.shape[0] if n1 is None else n1
    out = np.empty((n1 - n0, w.shape[1]), dtype=np.float32)
    _dequant_rows(qcode(w.qtype), w.data, n0, out, _F16, _KVALUES)
    return out


def has_kernel(qtype: str) -> bool:
    """Whether the kernels here read GGML type ``qtype`` (:data:`KERNEL_TYPES`)."""
    return qtype in QUANT_TYPES and QUANT_TYPES[qtype].type_id in KERNEL_TYPES


def take_rows(w: QuantMatrix, ids: np.ndarray) -> np.ndarray:
    """W[ids] as float32 (len(ids), K): each row dequantized by the kernel the fused decode
    steps read an embedding row with (:func:`_dequant_row`)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((ids.shape[0], w.shape[1]), dtype=np.float32)
    if ids.shape[0]:
        _take_rows(qcode(w.qtype), w.data, ids, out, _F16, _KVALUES)
    return out


def qcode(qtype: str) -> int:
    """The ``qt`` of the kernels for GGML type name ``qtype``: its GGML type id, checked to be
    one of :data:`KERNEL_TYPES` (another id would run another type's branch)."""
    qt = QUANT_TYPES[qtype].type_id
    if qt not in KERNEL_TYPES:
        raise MinillamaError(f"the numba backend has no kernel for GGML type {qtype}")
    return qt


def _parallel() -> bool:
    import numba

    return numba.get_num_threads() > 1


def qmatmul(x: np.ndarray, w: QuantMatrix) -> np.ndarray:
    r"""y = x W^T, y_{mn} = \sum_k x_{mk} W_{nk} from W's blocks: for a type of
    :data:`.int8_dots.INT8_TYPES` (unless :func:`.int8_dots.int8_enabled` says no) x rounded to
    8-bit blocks and integer dots (:mod:`.int8_dots` up to :data:`GEMV_MAX_ROWS` rows,
    :mod:`.int8_gemm` beyond or within :func:`.int8_dots.gemm_products`), else float32 sums of the
    dequantized blocks (row kernels, or tiles and a GEMM).
    x: float32 (M, K); W: QuantMatrix (N, K). Returns float32 (M, N)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    _check(w, K, "x")
    N = w.shape[0]
    qt = qcode(w.qtype)
    y = np.empty((M, N), dtype=np.float32)
    if M == 0 or N == 0:
        return y
    import numba

    from . import int8_dots, int8_lanes

    int8 = qt in int8_dots.INT8_TYPES and int8_dots.int8_enabled()
    if M <= GEMV_MAX_ROWS and not (int8 and int8_dots.gemm_only()):
        parts = numba.get_num_threads() if _parallel() and M * N * K >= PARALLEL_MIN_WORK else 1
        if int8 and qt in int8_lanes.LANE_TYPES:  # the integer GEMM's value of each output
            int8_lanes.gemv(qt, x, w.data, y, parts)
        elif int8:
            int8_dots.gemv(qt, x, w.data, y, parts)
        elif parts > 1:
            _gemv_parallel(qt, x, w.data, y, _F16, _KVALUES, 16, parts)
        else:
            _gemv_serial(qt, x, w.data, y, _F16, _KVALUES, 16)
        return y
    if int8:
        from . import int8_gemm

        int8_gemm.gemm(qt, x, w.data, y, numba.get_num_threads())
        return y
    if not blas.available():  # no OpenBLAS to call from the kernels: NumPy on dequantized tiles
        for n0 in range(0, N, 4 * TILE_N):
            n1 = min(N, n0 + 4 * TILE_N)
            np.matmul(x, dequantize_rows(w, n0, n1).T, out=y[:, n0:n1])
        return y
    fn, ilp64 = blas.gemm_address(np.float32)
    with cpu_threads.single_threaded_blas():
        _gemm_tiles(qt, x, w.data, y, _F16, _KVALUES, fn, ilp64, TILE_N)
    return y


def qmatmul_t(dy: np.ndarray, w: QuantMatrix) -> np.ndarray:
    r"""dx = dy W, dx_{mk} = \sum_n dy_{mn} W_{nk} (the input gradient of y = x W^T with W frozen).
    dy: float32 (M, N); W: QuantMatrix (N, K). Returns float32 (M, K)."""
    dy = np.ascontiguousarray(dy, dtype=np.float32)
    M, N = dy.shape
    _check(w, N, "dy")
    K = w.shape[1]
    if M == 0 or N == 0 or K == 0:
        return np.zeros((M, K), dtype=np.float32)
    if not blas.available():
        dx = np.zeros((M, K), dtype=np.float32)
        for n0 in range(0, N, 4 * TILE_N):
            n1 = min(N, n0 + 4 * TILE_N)
            dx += dy[:, n0:n1] @ dequantize_rows(w, n0, n1)
        return dx
    import numba

    nt = -(-N // TILE_N)
    parts = max(1, min(numba.get_num_threads(), nt))
    acc = np.zeros((parts, M, K), dtype=np.float32)
    fn, ilp64 = blas.gemm_address(np.float32)
    with cpu_threads.single_threaded_blas():
        _gemm_t_tiles(qcode(w.qtype), dy, w.data, acc, _F16, _KVALUES, fn, ilp64, TILE_N)
    return acc.sum(axis=0) if parts > 1 else acc[0]
