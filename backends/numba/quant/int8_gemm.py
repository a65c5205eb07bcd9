r"""Many-row products y = x W^T with GGML block weights from 8-bit activations: integer GEMM
tiles (the prefill products of :func:`.matmul.qmatmul`), written as LLVM IR through Numba
intrinsics like :mod:`.int8_dots`.

Each weight of a sub-block of G values (G = 32, or 16 for Q6_K, Q3_K, Q2_K) is written
w = A u + C: u a small integer code (|u| < 128, Q8_0's signed q as they are), A the sub-block's
scale and C its offset (-o A for a code offset o, the min for Q4_1, Q5_1, Q4_K, Q5_K, Q2_K). The
rows of x are rounded to 8-bit blocks as for decoding (:func:`.int8_dots.quantize_row`,
x_k ~ d xq_k) and shifted to unsigned bytes xq + 128, so with S_b = \sum_{k in b} u_k,

    \sum_{k in b} w_k x_k ~ d A (\sum_{k in b} u_k (xq_k + 128) - 128 S_b) + C d \sum_{k in b} xq_k.

The first sum is an integer dot of unsigned by signed bytes (``vpdpbusd`` with VNNI, else the
portable IR of :mod:`.int8_dots`). A tile multiplies 4 rows of W by 32 rows of x: 16 rows of x in
the 16 lanes of a vector (4 bytes each, their consecutive k), each lane's 4 weight bytes broadcast
from the unpacked row, so every instruction does 64 multiply-adds and no weight byte is
shuffled. Per sub-block each of the 8 accumulators (4 rows of W by 2 vectors of x) starts at
-128 S_b, takes G / 4 integer dots, and is converted once and added into float32 with one fused
multiply-add for d A and one for C d \sum xq.

Work per call: x rounded and laid out by 16-row groups (``pack_x``); each thread unpacks its rows
of W 16 at a time (``unpack``: codes, A, C) and runs the tiles over all of x.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .block_types import BY_ID, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .int8_dots import (
    _OFFSET,
    _TYPES32,
    _TYPESK,
    VNNI,
    _b,
    _block32,
    _dot4,
    _kchunk,
    fits16,
    quantize_row,
)
from .unpack import _F32, _I8, _I32, _I64, _at, _fma, _half, _kscales, _load, _splat, _vec

#: the GGML type ids with an integer GEMM (those of :data:`.int8_dots.INT8_TYPES`)
GEMM8_TYPES = tuple(sorted(_TYPES32) + sorted(_TYPESK))
#: sub-block length G of each type
GROUP = {**{t: 32 for t in _TYPES32}, Q4_K: 32, Q5_K: 32, Q6_K: 16, Q3_K: 16, Q2_K: 16}


def _store(builder, v, addr, off):
    builder.store(v, _at(builder, addr, off, v.type), align=1)


# ---------------------------------------------------------------------------------------------
# unpacking one row of blocks into codes, A and C
# ---------------------------------------------------------------------------------------------
def _codes(qt, builder, blk, dst):
    """Store the codes of the block (K super-block) at blk to dst; return its (A, C): float
    scalars for a block of 32, vectors of one entry per sub-block for a K super-block."""
    if qt == Q8_0:  # the signed codes as stored, C = 0
        _store(builder, _b(builder, blk, 2, 32), dst, 0)
        return _half(builder, blk, 0), ir.Constant(_F32, 0.0)
    if qt in _TYPES32:
        u, a, c = _block32(qt, builder, blk)
        _store(builder, u, dst, 0)
        return a, c
    for c in range(4):
        _store(builder, _kchunk(qt, builder, blk, c), dst, 64 * c)
    return kaffine(qt, builder, blk)


def kaffine(qt, builder, blk):
    """(A, C) of the K super-block at blk: float vectors of one entry per sub-block, w = A u + C
    (C = -o A for a code offset o, else minus the min)."""
    A, B = _kscales(BY_ID[qt].name, builder, blk)
    n = A.type.count
    if B is None:
        return A, builder.fmul(A, _splat(builder, ir.Constant(_F32, -_OFFSET[qt]), n))
    return A, builder.fsub(_splat(builder, ir.Constant(_F32, 0.0), n), B)


def _unpack_ir(qt):
    size, per = BY_ID[qt].block_bytes, BY_ID[qt].block_elems

    def codegen(context, builder, signature, args):
        pw, pu, pa, pc, nb = args
        with cgutils.for_range(builder, nb) as loop:
            i = loop.index
            blk = builder.add(pw, builder.mul(i, ir.Constant(_I64, size)))
            A, C = _codes(qt, builder, blk, builder.add(pu, builder.mul(i, ir.Constant(_I64, per))))
            off = builder.mul(i, ir.Constant(_I64, 4 * (per // GROUP[qt])))
            _store(builder, A, builder.add(pa, off), 0)
            _store(builder, C, builder.add(pc, off), 0)
        return context.get_dummy_value()

    return codegen


def _make_unpack(qt):
    gen = _unpack_ir(qt)

    @intrinsic
    def unpack_row(typingctx, pw, pu, pa, pc, nblocks):
        """Codes (K bytes at pu), A and C (K / G float32 at pa, pc) of the ``nblocks`` blocks
        (K super-blocks) of the row at pw."""
        return types.none(types.int64, types.int64, types.int64, types.int64, types.int64), gen

    return unpack_row


# ---------------------------------------------------------------------------------------------
# the tile: 4 rows of W by 32 rows of x
# ---------------------------------------------------------------------------------------------
def _tile(G, vnni, fits):
    def codegen(context, builder, signature, args):
        px, pd, ps, pu, pa, pc, pus, nsub, K, out = args
        R, V = 4, 2
        facc = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 16), [0.0] * 16))
                 for _ in range(V)] for _ in range(R)]
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        nsub32 = builder.sdiv(builder.mul(nsub, c64(G)), c64(32))
        xstride = builder.mul(K, c64(16))  # bytes of one 16-row group of x
        with cgutils.for_range(builder, nsub) as loop:
            b = loop.index
            iacc = []
            for r in range(R):  # -128 S_b
                s = _load(builder, builder.add(pus, builder.mul(builder.add(
                    builder.mul(c64(r), nsub), b), c64(4))), 0, _I32, 4)
                init = _splat(builder, builder.mul(s, ir.Constant(_I32, -128)), 16)
                iacc.append([init] * V)
            for g in range(G // 4):
                col = builder.add(builder.mul(b, c64(G)), c64(4 * g))  # k of this group
                xv = [_load(builder, builder.add(builder.add(px, builder.mul(c64(v), xstride)),
                                                 builder.mul(col, c64(16))), 0, _vec(_I8, 64), 1)
                      for v in range(V)]
                for r in range(R):
                    wq = _load(builder, builder.add(builder.add(pu, builder.mul(c64(r), K)), col),
                               0, _I32, 1)
                    wv = builder.bitcast(_splat(builder, wq, 16), _vec(_I8, 64))
                    for v in range(V):
                        iacc[r][v] = _dot4(builder, xv[v], wv, vnni, iacc[r][v], fits)
            b32 = builder.sdiv(builder.mul(b, c64(G)), c64(32))
            dx, xs = [], []
            for v in range(V):
                dx.append(_load(builder, builder.add(pd, builder.mul(builder.add(
                    builder.mul(c64(v), nsub32), b32), c64(64))), 0, _vec(_F32, 16), 4))
                nsub16 = builder.sdiv(builder.mul(nsub, c64(G)), c64(16))
                j = builder.mul(b, c64(G // 16))
                row = builder.add(ps, builder.mul(builder.add(builder.mul(c64(v), nsub16), j),
                                                  c64(64)))
                s = _load(builder, row, 0, _vec(_F32, 16), 4)
                if G == 32:
                    s = builder.fadd(s, _load(builder, row, 64, _vec(_F32, 16), 4))
                xs.append(s)
            for r in range(R):
                at = builder.mul(builder.add(builder.mul(c64(r), nsub), b), c64(4))
                a = _splat(builder, _load(builder, builder.add(pa, at), 0, _F32, 4), 16)
                c = _splat(builder, _load(builder, builder.add(pc, at), 0, _F32, 4), 16)
                for v in range(V):
                    f = builder.sitofp(iacc[r][v], _vec(_F32, 16))
                    acc = _fma(builder, f, builder.fmul(dx[v], a), builder.load(facc[r][v]))
                    builder.store(_fma(builder, xs[v], c, acc), facc[r][v])
        for r in range(R):
            for v in range(V):
                _store(builder, builder.load(facc[r][v]), out, 4 * (32 * r + 16 * v))
        return context.get_dummy_value()

    return codegen


def _make_tile(G, vnni, fits=True):
    gen = _tile(G, vnni, fits)

    @intrinsic
    def tile(typingctx, px, pd, ps, pu, pa, pc, pus, nsub, K, out):
        r"""out (4, 32) float32: rows r of W (codes at pu + r K, A, C, S at pa, pc, pus +
        4 r nsub) times the 32 rows of x laid out by :func:`pack_x` at px, pd, ps."""
        return types.none(*([types.int64] * 10)), gen

    return tile


# Q8_0's codes take all 8 bits: its tiles sum byte pairs in two passes without VNNI
# (:func:`.int8_dots.fits16`); the types of sub-blocks of 16 all fit
tile32, tile16 = _make_tile(32, VNNI), _make_tile(16, VNNI)
tile32w = _make_tile(32, VNNI, fits16(Q8_0))
(unpack_q4_0, unpack_q4_1, unpack_q5_0, unpack_q5_1, unpack_q8_0, unpack_q2_k, unpack_q3_k,
 unpack_q4_k, unpack_q5_k, unpack_q6_k) = (
    _make_unpack(t) for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K))

_opts = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")


@njit(**_opts)
def _unpack(qt, w, n, u, a, c, s, G):  # pragma: no cover - compiled
    """Row n of w into codes u (K,) int8, A a and C c (K / G,) float32, code sums s (K / G,)."""
    pw = w.ctypes.data + n * w.shape[1]
    pu, pa, pc = u.ctypes.data, a.ctypes.data, c.ctypes.data
    nb = u.shape[0] // 32
    if qt == Q8_0:
        unpack_q8_0(pw, pu, pa, pc, nb)
    elif qt == Q4_0:
        unpack_q4_0(pw, pu, pa, pc, nb)
    elif qt == Q4_1:
        unpack_q4_1(pw, pu, pa, pc, nb)
    elif qt == Q5_0:
        unpack_q5_0(pw, pu, pa, pc, nb)
    elif qt == Q5_1:
        unpack_q5_1(pw, pu, pa, pc, nb)
    elif qt == Q2_K:
        unpack_q2_k(pw, pu, pa, pc, nb // 8)
    elif qt == Q3_K:
        unpack_q3_k(pw, pu, pa, pc, nb // 8)
    elif qt == Q4_K:
        unpack_q4_k(pw, pu, pa, pc, nb // 8)
    elif qt == Q5_K:
        unpack_q5_k(pw, pu, pa, pc, nb // 8)
    else:
        unpack_q6_k(pw, pu, pa, pc, nb // 8)
    # the sums with constant trip counts: LLVM turns them into vector reductions (a run-time G
    # left a scalar loop that took four fifths of the unpacking)
    if G == 32:
        for b in range(s.shape[0]):
            t = 0
            for k in range(32):
                t += u[32 * b + k]
            s[b] = t
    else:
        for b in range(s.shape[0]):
            t = 0
            for k in range(16):
                t += u[16 * b + k]
            s[b] = t


@njit(parallel=True, **_opts)
def pack_x(x, xt, dt, st):  # pragma: no cover - compiled
    """x (M, K) float32 rounded to 8-bit blocks (:func:`.int8_dots.quantize_row`), laid out by
    groups of 16 rows: xt (M16, K / 4, 16, 4) uint8 codes + 128 (row 16 i + l's k = 4 j + t at
    [i, j, l, t]), dt (M16, K / 32, 16) scales, st (M16, K / 16, 16) scaled sums of 16 codes;
    rows past M are zero."""
    M, K = x.shape
    x32 = xt.view(np.uint32)  # (M16, K / 4, 16, 1): the 4 codes of [i, j, l] as one word
    for i in prange(xt.shape[0]):
        xq = np.zeros(K, np.int8)
        xd = np.zeros(K // 32, np.float32)
        xs = np.zeros(K // 16, np.float32)
        q32 = xq.view(np.uint32)
        for lane in range(16):
            m = 16 * i + lane
            if m < M:
                quantize_row(x[m], xq, xd, xs)
            elif m == M:
                xq[:] = 0
                xd[:] = 0
                xs[:] = 0
            for j in range(K // 4):  # + 128 on each byte: its top bit flipped
                x32[i, j, lane, 0] = q32[j] ^ np.uint32(0x80808080)
            for j in range(K // 32):
                dt[i, j, lane] = xd[j]
            for j in range(K // 16):
                st[i, j, lane] = xs[j]


@njit(parallel=True, **_opts)
def _gemm(qt, xt, dt, st, w, y, parts, G):  # pragma: no cover - compiled
    M, N = y.shape
    K = xt.shape[1] * 4
    nsub = K // G
    step = (N + 16 * parts - 1) // (16 * parts) * 16
    for t in prange(parts):
        u = np.zeros((16, K), np.int8)
        a = np.zeros((16, nsub), np.float32)
        c = np.zeros((16, nsub), np.float32)
        s = np.zeros((16, nsub), np.int32)
        out = np.empty((4, 32), np.float32)
        for n0 in range(t * step, min(N, t * step + step), 16):
            rows = min(16, N - n0)
            for r in range(rows):
                _unpack(qt, w, n0 + r, u[r], a[r], c[r], s[r], G)
            for i2 in range(xt.shape[0] // 2):
                for r0 in range(0, rows, 4):
                    args = (xt[2 * i2:].ctypes.data, dt[2 * i2:].ctypes.data,
                            st[2 * i2:].ctypes.data, u[r0].ctypes.data, a[r0].ctypes.data,
                            c[r0].ctypes.data, s[r0].ctypes.data, nsub, K, out.ctypes.data)
                    if G == 32 and qt == Q8_0:
                        tile32w(*args)
                    elif G == 32:
                        tile32(*args)
                    else:
                        tile16(*args)
                    for r in range(min(4, rows - r0)):
                        for lane in range(min(32, M - 32 * i2)):
                            y[32 * i2 + lane, n0 + r0 + r] = out[r, lane]


def gemm(qt: int, x: np.ndarray, w: np.ndarray, y: np.ndarray, parts: int) -> None:
    """y = x W^T for the block matrix w (uint8 rows of a type in :data:`GEMM8_TYPES`) and
    float32 x (M, K) rounded to 8-bit blocks; W's rows split over ``parts`` threads."""
    M, K = x.shape
    M16 = -(-M // 32) * 2
    xt = np.empty((M16, K // 4, 16, 4), np.uint8)
    dt = np.empty((M16, K // 32, 16), np.float32)
    st = np.empty((M16, K // 16, 16), np.float32)
    pack_x(x, xt, dt, st)
    _gemm(qt, xt, dt, st, w, y, max(1, parts), GROUP[qt])
