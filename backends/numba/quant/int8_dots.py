r"""Integer dot products of GGML block rows with activations rounded to 8-bit blocks, written as
LLVM IR through Numba intrinsics (the decode matvecs of :mod:`.matmul` and
:mod:`..decode.quant_step`).

The activation row x (K values) is rounded once per product to blocks of 32 (the layout of
:func:`quantize_row`): int8 codes ``xq`` with x_k ~ d_b xq_k, d_b = max_{k in b} |x_k| / 127 in
float32 (``xd``), and the sum of each 16 consecutive codes times its block's d (``xs``, float32,
K / 16 entries).

Every weight is written w = A (u - o) - B with u an unsigned byte code, o a constant offset of
the type and A, B the scales (and mins) of its block or sub-block, so

    \sum_k w_k x_k ~ \sum_b d_b A_b \sum_{k in b} u_k xq_k - (o A_b + B_b) d_b \sum_{k in b} xq_k.

The first sum is an integer dot of unsigned by signed bytes: ``vpdpbusd`` (AVX512-VNNI, 64
products into 16 lanes of 4) where the host has it; else, with AVX2, ``vpmaddubsw`` (pairs of
products into 16 bits) then ``vpmaddwd`` against ones (pairs of pairs into 32 bits), exact
where no pair can leave 16 bits (the codes of every type but Q8_0; Q8_0's bytes are split into
their low 7 bits and their top bit, two such dots); else portable IR (widen to i32, multiply,
add groups of 4) that LLVM lowers for any target. All three give the same integers. Each
group of 4 products is converted to float32 and multiplied by its scale with a fused
multiply-add, the second term by one more fused multiply-add against ``xs``; one horizontal sum
per row. The 16-lane accumulators hold 64 values (two blocks of 32, or two 32-runs of a K
super-block).

Q8_0's signed codes become u = q + 128 (o = 128), Q4_0 o = 8, Q5_0 o = 16, Q6_K o = 32,
Q3_K u = q + 4 (o = 4); the types with mins (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) have o = 0 and B.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .block_types import BY_ID, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .unpack import (
    _F32,
    _I8,
    _I32,
    _I64,
    _at,
    _const,
    _fma,
    _fn,
    _half,
    _kscales,
    _load,
    _reduce,
    _shuf,
    _splat,
    _vec,
)

_FEATS = _cache.target_features()
#: unsigned-by-signed byte dots by ``vpdpbusd`` (zmm); else the portable IR
VNNI = "+avx512vnni" in _FEATS and "+avx512bw" in _FEATS
#: per-byte affine maps by ``vgf2p8affineqb`` (zmm) unpack nibbles in the VNNI build (else a
#: select)
GFNI = "+gfni" in _FEATS and "+avx512bw" in _FEATS
#: LLVM 21 on takes the byte operands of the VNNI intrinsics as byte vectors (before: i32 lanes)
_VNNI_BYTES = binding.llvm_version_info[0] >= 21
#: without VNNI, byte pairs by ``vpmaddubsw`` and ``vpmaddwd`` (ymm) where the host has AVX2
AVX2 = "+avx2" in _FEATS

#: the GGML type ids with an integer kernel, blocks of 32 and K super-blocks of 256
_TYPES32 = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
_TYPESK = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K)
#: the GGML type ids with an integer kernel (the others take the float32 kernels of .matmul)
INT8_TYPES = tuple(sorted(_TYPES32 + _TYPESK))


_EXACT = threading.local()
_ROWS = threading.local()


@contextlib.contextmanager
def _switched_on(flag):
    """``flag.on`` (a thread-local) True within the block, as it was after it."""
    before = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = before


def exact_products():
    """Within it (in this thread) every product with a block matrix keeps float32 activations:
    the forward that gradients are taken of (training, LoRA) stays exact to float32 rounding."""
    return _switched_on(_EXACT)


def gemm_products():
    """Within it (in this thread) every 8-bit product takes the integer GEMM of :mod:`.int8_gemm`
    whatever its row count, so a row's result does not depend on how many rows are multiplied
    with it (the GEMM's sums per output do not; the row kernels' order is another): the rows
    of a prompt (:meth:`~.backend_decode.FusedDecode.prompt_rows`)."""
    return _switched_on(_ROWS)


def gemm_only() -> bool:
    """Whether :func:`gemm_products` is on in this thread."""
    return getattr(_ROWS, "on", False)


def int8_enabled() -> bool:
    """Whether the float32 products of block matrices round the activations to 8 bits (the
    default for inference; ``MINILLAMA_QUANT_DOTS=float`` or :func:`exact_products` keeps
    float32 activations)."""
    if getattr(_EXACT, "on", False):
        return False
    return os.environ.get("MINILLAMA_QUANT_DOTS", "int8").strip().lower() != "float"


# ---------------------------------------------------------------------------------------------
# IR pieces
# ---------------------------------------------------------------------------------------------
def fits16(qt):
    """Whether every pair u_k s_k + u_{k+1} s_{k+1} of GGML type qt's dots lies in 16 bits, in
    the row kernels (u its codes, at most 63; s the activations' codes, |s| <= 127) and in the
    GEMM of :mod:`.int8_gemm` (u the activations' codes + 128, at most 255; s the signed codes,
    |s| <= 32): every type but Q8_0, whose codes take all 8 bits."""
    return qt != Q8_0


def _pairs(builder, name, width, a, b, ret):
    """An x86 pairwise multiply-add intrinsic ``name`` (``width`` lanes of a's type per call)
    over the vectors a and b, by chunks, the results concatenated (of element type ret)."""
    n = a.type.count
    outs = []
    for c in range(0, n, width):
        ac, bc = (_shuf(builder, v, range(c, c + width)) if width < n else v for v in (a, b))
        fn = _fn(builder, name, _vec(ret, width // 2), [ac.type, bc.type])
        outs.append(builder.call(fn, [ac, bc]))
    while len(outs) > 1:
        outs = [_cat(builder, outs[i], outs[i + 1]) for i in range(0, len(outs), 2)]
    return outs[0]


def _dot4_avx2(builder, u, s, fits16):
    """:func:`_dot4` by ``vpmaddubsw`` (u_k s_k + u_{k+1} s_{k+1} in 16 bits, saturating) and
    ``vpmaddwd`` (adjacent 16-bit sums times 1 or 128, added in 32 bits). ``fits16``: the caller
    knows every pair sum lies in 16 bits, so one pass is exact; else u = (u & 127) + 128 (u >> 7),
    two passes, each exact since |s| <= 128 (127 * 128 * 2 = 32512)."""
    n = u.type.count
    w = 32 if n % 32 == 0 else 16
    ub = ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.ssse3.pmadd.ub.sw.128")[w == 16]
    wd = ("llvm.x86.avx2.pmadd.wd", "llvm.x86.sse2.pmadd.wd")[w == 16]
    I16 = ir.IntType(16)

    def part(v, scale):
        return _pairs(builder, wd, w // 2, _pairs(builder, ub, w, v, s, I16),
                      _const(I16, n // 2, [scale] * (n // 2)), _I32)

    if fits16:
        return part(u, 1)
    lo = builder.and_(u, _const(_I8, n, [127] * n))
    hi = builder.lshr(u, _const(_I8, n, [7] * n))
    return builder.add(part(lo, 1), part(hi, 128))


def _dot4(builder, u, s, vnni, acc=None, fits16=False):
    """Sums of 4 consecutive products u_k s_k (u unsigned, s signed bytes with |s| <= 128,
    <n x i8>) as <n/4 x i32>, added to acc (<n/4 x i32>) when given. ``fits16``: the caller
    knows |u_k s_k + u_{k+1} s_{k+1}| < 2^15 for every pair (:func:`fits16`: a shorter AVX2
    path)."""
    n = u.type.count
    if not vnni and AVX2 and n % 16 == 0:
        out = _dot4_avx2(builder, u, s, fits16)
        return out if acc is None else builder.add(acc, out)
    if vnni:
        t = _vec(_I32, n // 4)
        name = f"llvm.x86.avx512.vpdpbusd.{n * 8}"
        if _VNNI_BYTES:
            args = [u, s]
        else:
            args = [builder.bitcast(u, t), builder.bitcast(s, t)]
        fnty = ir.FunctionType(t, [t, args[0].type, args[1].type])
        fn = builder.module.globals.get(name) or ir.Function(builder.module, fnty, name)
        return builder.call(fn, [acc or ir.Constant(t, [0] * (n // 4))] + args)
    p = builder.mul(builder.zext(u, _vec(_I32, n)), builder.sext(s, _vec(_I32, n)))
    parts = [_shuf(builder, p, range(j, n, 4)) for j in range(4)]
    out = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    return out if acc is None else builder.add(acc, out)


def _cat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _const(_I32, 2 * n, range(2 * n)))


def _b(builder, addr, off, n):
    return _load(builder, addr, off, _vec(_I8, n))


def _and(builder, v, m):
    return builder.and_(v, _const(_I8, v.type.count, m))


def _shr(builder, v, k):
    if isinstance(k, int) and k == 0:
        return v
    return builder.lshr(v, _const(_I8, v.type.count, k))


def _shl(builder, v, k):
    return builder.shl(v, _const(_I8, v.type.count, k))


def _nib32(builder, blk, off):
    """The 32 4-bit codes of 16 bytes (low nibbles, then high) as <32 x i8>."""
    a = _b(builder, blk, off, 16)
    return _cat(builder, _and(builder, a, 15), _shr(builder, a, 4))


def _affine_rows(f):
    """The GF(2) 8x8 matrix of a byte map (result bit i = input bit j where f(i, j)) as the 8
    bytes of a ``vgf2p8affineqb`` qword (byte 7 - i holds row i), signed."""
    q = sum(sum(1 << j for j in range(8) if f(i, j)) << (8 * (7 - i)) for i in range(8))
    return [((q >> (8 * b)) & 255) - (256 if (q >> (8 * b)) & 128 else 0) for b in range(8)]


#: the low nibble and the high nibble of a byte as affine maps
_LOW4 = _affine_rows(lambda i, j: i < 4 and j == i)
_HIGH4 = _affine_rows(lambda i, j: i < 4 and j == i + 4)


def _nib64(builder, p0, p1, gfni):
    """The 4-bit codes of the 16 bytes at p0 and the 16 at p1 as <64 x i8>: low nibbles of p0,
    high of p0, low of p1, high of p1. The 16 bytes of each run are loaded twice into adjacent
    lanes, and one per-lane affine map (``gfni``: ``vgf2p8affineqb``) or a select of a mask and
    a shift keeps the nibble each lane wants, so no lane shuffles the unpacked halves."""
    v = builder.shuffle_vector(_b(builder, p0, 0, 16), _b(builder, p1, 0, 16),
                               _const(_I32, 64, [k % 16 + 16 * (k >= 32) for k in range(64)]))
    if gfni:
        t = _vec(_I8, 64)
        fn = _fn(builder, "llvm.x86.vgf2p8affineqb.512", t, [t, t, _I8])
        rows = [b for k in range(8) for b in (_LOW4 if k % 4 < 2 else _HIGH4)]
        return builder.call(fn, [v, ir.Constant(t, rows), ir.Constant(_I8, 0)])
    low = _const(ir.IntType(1), 64, [(k // 16) % 2 == 0 for k in range(64)])
    return builder.select(low, _and(builder, v, 15), _shr(builder, v, 4))


def _qh_bits(builder, blk, off):
    """Bit l of the little-endian u32 at blk + off for l = 0..31, shifted to 16, <32 x i8>."""
    a = _shuf(builder, _b(builder, blk, off, 4), [k // 8 for k in range(32)])
    bit = _and(builder, builder.lshr(a, _const(_I8, 32, [k % 8 for k in range(32)])), 1)
    return _shl(builder, bit, 4)


# blocks of 32: (u <32 x i8>, A, M) with M = -(o A + B) as float scalars


#: byte offsets in a block of 32 of its nibbles and (Q5) of its 32 fifth bits
_NIBBLES_AT = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8}
_HIGH_BITS_AT = {Q5_0: 2, Q5_1: 4}


def _block32(qt, builder, blk):
    d = _half(builder, blk, 0)
    if qt == Q8_0:
        u = builder.xor(_b(builder, blk, 2, 32), _const(_I8, 32, 128 - 256))
        return u, d, builder.fmul(d, ir.Constant(_F32, -128.0))
    u = _nib32(builder, blk, _NIBBLES_AT[qt])
    if qt in _HIGH_BITS_AT:
        u = builder.or_(u, _qh_bits(builder, blk, _HIGH_BITS_AT[qt]))
    if qt in (Q4_1, Q5_1):  # w = d q + m
        return u, d, _half(builder, blk, 2)
    return u, d, builder.fmul(d, ir.Constant(_F32, -8.0 if qt == Q4_0 else -16.0))


def _pair32(qt, builder, blk0, gfni):
    """Blocks blk0 and the next as (u <64 x i8>, A <2 x float>, M <2 x float>): those of
    :func:`_block32`, with the nibbles of both unpacked at once by :func:`_nib64` (``gfni``: by
    GFNI; the codes :func:`_block32` builds are then unused and dropped by LLVM)."""
    size = BY_ID[qt].block_bytes
    (u0, a0, m0), (u1, a1, m1) = (_block32(qt, builder, builder.add(blk0, ir.Constant(
        _I64, size * j))) for j in range(2))
    if qt == Q8_0:
        u = _cat(builder, u0, u1)
    else:
        at = _NIBBLES_AT[qt]
        u = _nib64(builder, builder.add(blk0, ir.Constant(_I64, at)),
                   builder.add(blk0, ir.Constant(_I64, size + at)), gfni)
        if qt in _HIGH_BITS_AT:
            off = _HIGH_BITS_AT[qt]
            u = builder.or_(u, _cat(builder, _qh_bits(builder, blk0, off),
                                    _qh_bits(builder, blk0, size + off)))

    def two(v0, v1):
        return builder.insert_element(_splat(builder, v0, 2), v1, ir.Constant(_I32, 1))

    return u, two(a0, a1), two(m0, m1)


def _rows32(qt, vnni):
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        pw, pq, pd, ps, nb = args
        acc = cgutils.alloca_once_value(builder, _const(_F32, 16, 0.0))
        acc_m = cgutils.alloca_once_value(builder, _const(_F32, 4, 0.0))
        npair = builder.sdiv(nb, ir.Constant(_I64, 2))
        lanes = [0] * 8 + [1] * 8

        def at(base, i, step):
            return builder.add(base, builder.mul(i, ir.Constant(_I64, step)))

        with cgutils.for_range(builder, npair) as loop:  # blocks 2i, 2i + 1
            i = loop.index
            u, a, m = _pair32(qt, builder, at(pw, i, 2 * size), vnni and GFNI)
            xs = _load(builder, at(pq, i, 64), 0, _vec(_I8, 64))
            p = builder.sitofp(_dot4(builder, u, xs, vnni, fits16=fits16(qt)), _vec(_F32, 16))
            dx = _load(builder, at(pd, i, 8), 0, _vec(_F32, 2), 4)
            builder.store(_fma(builder, p, _shuf(builder, builder.fmul(a, dx), lanes),
                               builder.load(acc)), acc)
            sums = _load(builder, at(ps, i, 16), 0, _vec(_F32, 4), 4)
            builder.store(_fma(builder, sums, _shuf(builder, m, [0, 0, 1, 1]),
                               builder.load(acc_m)), acc_m)
        total = builder.fadd(_reduce(builder, builder.load(acc)),
                             _reduce(builder, builder.load(acc_m)))
        last = builder.sub(nb, ir.Constant(_I64, 1))
        odd = builder.icmp_signed("!=", builder.mul(npair, ir.Constant(_I64, 2)), nb)
        out = cgutils.alloca_once_value(builder, total)
        with builder.if_then(odd):
            u, a, m = _block32(qt, builder, at(pw, last, size))
            xs = _load(builder, at(pq, last, 32), 0, _vec(_I8, 32))
            p = builder.sitofp(_dot4(builder, u, xs, vnni, fits16=fits16(qt)), _vec(_F32, 8))
            dx = _load(builder, at(pd, last, 4), 0, _F32, 4)
            sums = _reduce(builder, _load(builder, at(ps, last, 8), 0, _vec(_F32, 2), 4))
            v = _reduce(builder, builder.fmul(p, _splat(builder, builder.fmul(a, dx), 8)))
            builder.store(builder.fadd(total, builder.fadd(v, builder.fmul(sums, m))), out)
        return builder.load(out)

    return codegen


def _rows32_multi(qt, vnni, R):
    """The codegen of :func:`_rows32` for R activation rows at once: each pair of blocks of W is
    decoded once and dotted with the R rows (the same operations per row, in the same order, so
    each result equals :func:`_rows32`'s bit for bit); the R sums are stored, not returned."""
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        pw, pq, pd, ps, nb, sq, sd, ss, py, sy = args
        acc = [cgutils.alloca_once_value(builder, _const(_F32, 16, 0.0)) for _ in range(R)]
        acc_m = [cgutils.alloca_once_value(builder, _const(_F32, 4, 0.0)) for _ in range(R)]
        npair = builder.sdiv(nb, ir.Constant(_I64, 2))
        lanes = [0] * 8 + [1] * 8

        def at(base, i, step):
            return builder.add(base, builder.mul(i, ir.Constant(_I64, step)))

        def row(base, stride, r):
            return builder.add(base, builder.mul(stride, ir.Constant(_I64, r)))

        with cgutils.for_range(builder, npair) as loop:  # blocks 2i, 2i + 1
            i = loop.index
            u, a, m = _pair32(qt, builder, at(pw, i, 2 * size), vnni and GFNI)
            m = _shuf(builder, m, [0, 0, 1, 1])
            for r in range(R):
                xs = _load(builder, at(row(pq, sq, r), i, 64), 0, _vec(_I8, 64))
                p = builder.sitofp(_dot4(builder, u, xs, vnni, fits16=fits16(qt)), _vec(_F32, 16))
                dx = _load(builder, at(row(pd, sd, r), i, 8), 0, _vec(_F32, 2), 4)
                builder.store(_fma(builder, p, _shuf(builder, builder.fmul(a, dx), lanes),
                                   builder.load(acc[r])), acc[r])
                sums = _load(builder, at(row(ps, ss, r), i, 16), 0, _vec(_F32, 4), 4)
                builder.store(_fma(builder, sums, m, builder.load(acc_m[r])), acc_m[r])
        last = builder.sub(nb, ir.Constant(_I64, 1))
        odd = builder.icmp_signed("!=", builder.mul(npair, ir.Constant(_I64, 2)), nb)
        out = []
        for r in range(R):
            total = builder.fadd(_reduce(builder, builder.load(acc[r])),
                                 _reduce(builder, builder.load(acc_m[r])))
            out.append(cgutils.alloca_once_value(builder, total))
        with builder.if_then(odd):
            u, a, m = _block32(qt, builder, at(pw, last, size))
            for r in range(R):
                xs = _load(builder, at(row(pq, sq, r), last, 32), 0, _vec(_I8, 32))
                p = builder.sitofp(_dot4(builder, u, xs, vnni, fits16=fits16(qt)), _vec(_F32, 8))
                dx = _load(builder, at(row(pd, sd, r), last, 4), 0, _F32, 4)
                sums = _reduce(builder, _load(builder, at(row(ps, ss, r), last, 8), 0,
                                              _vec(_F32, 2), 4))
                v = _reduce(builder, builder.fmul(p, _splat(builder, builder.fmul(a, dx), 8)))
                builder.store(builder.fadd(builder.load(out[r]),
                                           builder.fadd(v, builder.fmul(sums, m))), out[r])
        for r in range(R):
            builder.store(builder.load(out[r]), _at(builder, row(py, sy, r), 0, _F32), align=4)
        return context.get_dummy_value()

    return codegen


def _make_multi(qt, vnni, R):
    gen = _rows32_multi(qt, vnni, R)

    @intrinsic
    def irows(typingctx, pw, pq, pd, ps, nblocks, sq, sd, ss, py, sy):
        r"""y_r = \sum_k W_k x_{rk} for the R activation rows r at pq + r sq (codes), pd + r sd
        (scales), ps + r ss (scaled sums of 16), stored as float32 at py + r sy: R results of
        :func:`irow` from one pass over ``nblocks`` blocks of the row at pw."""
        return types.none(*([types.int64] * 10)), gen

    return irows


#: rows of activations per call of the multi-row kernels (:func:`idot_rows`)
ROWS = 4
irows_q8_0, irows_q4_0, irows_q4_1, irows_q5_0, irows_q5_1 = (_make_multi(t, VNNI, ROWS)
                                                              for t in _TYPES32)


# K-quants: chunk c (0..3) of a super-block is the values 64c .. 64c + 63 (32-runs 2c, 2c + 1)
# the code offset o of the K types without mins
_OFFSET = {Q6_K: 32.0, Q3_K: 4.0}


def _kchunk(qt, builder, blk, c):
    """The unsigned codes u of chunk c of the super-block at blk, <64 x i8>."""
    if qt in (Q4_K, Q5_K):  # 32 bytes, low nibbles run 2c, high run 2c + 1
        a = _b(builder, blk, (16 if qt == Q4_K else 48) + 32 * c, 32)
        u = _cat(builder, _and(builder, a, 15), _shr(builder, a, 4))
        if qt == Q5_K:  # fifth bits: bit r of the 32 bytes at 16
            h = _b(builder, blk, 16, 32)
            hb = _cat(builder, _and(builder, _shr(builder, h, 2 * c), 1),
                      _and(builder, _shr(builder, h, 2 * c + 1), 1))
            u = builder.or_(u, _shl(builder, hb, 4))
        return u
    half, k = divmod(c, 2)
    if qt == Q6_K:  # runs 4 half + 2k + {0, 1}: ql at 64 half (+32), nibble k
        lo = _cat(builder, _and(builder, _shr(builder, _b(builder, blk, 64 * half, 32), 4 * k), 15),
                  _and(builder, _shr(builder, _b(builder, blk, 64 * half + 32, 32), 4 * k), 15))
        h = _b(builder, blk, 128 + 32 * half, 32)
        hi = _cat(builder, _and(builder, _shr(builder, h, 4 * k), 3),
                  _and(builder, _shr(builder, h, 4 * k + 2), 3))
        return builder.or_(lo, _shl(builder, hi, 4))
    # Q3_K / Q2_K: 2-bit fields of the 32 bytes at q0 + 32 half, shifts 2 g, g = 2k, 2k + 1
    a = _b(builder, blk, (32 if qt == Q3_K else 16) + 32 * half, 32)
    u = _cat(builder, _and(builder, _shr(builder, a, 4 * k), 3),
             _and(builder, _shr(builder, a, 4 * k + 2), 3))
    if qt == Q3_K:  # + 4 where bit r of hmask byte l is set (runs r = 2c, 2c + 1)
        h = _b(builder, blk, 0, 32)
        hb = _cat(builder, _and(builder, _shr(builder, h, 2 * c), 1),
                  _and(builder, _shr(builder, h, 2 * c + 1), 1))
        u = builder.or_(u, _shl(builder, hb, 2))
    return u


def _rowsk(qt, vnni):
    size, kind = BY_ID[qt].block_bytes, BY_ID[qt].name

    def codegen(context, builder, signature, args):
        pw, pq, pd, ps, nb = args
        # two accumulators for the chunks (two chains of fused multiply-adds), one for the mins
        accs = [cgutils.alloca_once_value(builder, _const(_F32, 16, 0.0)) for _ in range(3)]
        with cgutils.for_range(builder, nb) as loop:
            i = loop.index
            blk = builder.add(pw, builder.mul(i, ir.Constant(_I64, size)))
            qx = builder.add(pq, builder.mul(i, ir.Constant(_I64, 256)))
            dx = _load(builder, builder.add(pd, builder.mul(i, ir.Constant(_I64, 32))), 0,
                       _vec(_F32, 8), 4)
            A, B = _kscales(kind, builder, blk)
            n = A.type.count  # 8 (per 32-run) or 16 (per 16-run)
            if n == 16:
                dx = _shuf(builder, dx, [j // 2 for j in range(16)])
            AD = builder.fmul(A, dx)
            a = [builder.load(accs[0]), builder.load(accs[1])]
            for c in range(4):
                lanes = [2 * c + j // 8 for j in range(16)] if n == 8 else \
                    [4 * c + j // 4 for j in range(16)]
                xs = _load(builder, qx, 64 * c, _vec(_I8, 64))
                p = builder.sitofp(_dot4(builder, _kchunk(qt, builder, blk, c), xs, vnni,
                                         fits16=True), _vec(_F32, 16))
                a[c % 2] = _fma(builder, p, _shuf(builder, AD, lanes), a[c % 2])
            builder.store(a[0], accs[0])
            builder.store(a[1], accs[1])
            M = builder.fmul(A, _const(_F32, n, -_OFFSET[qt])) if qt in _OFFSET else None
            if B is not None:
                M = builder.fsub(_const(_F32, n, 0.0), B)
            if M is not None:  # - (o A + B) times the scaled sums of each 16 codes
                if n == 8:
                    M = _shuf(builder, M, [j // 2 for j in range(16)])
                sums = _load(builder, builder.add(ps, builder.mul(i, ir.Constant(_I64, 64))), 0,
                             _vec(_F32, 16), 4)
                builder.store(_fma(builder, sums, M, builder.load(accs[2])), accs[2])
        v = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                         builder.load(accs[2]))
        return _reduce(builder, v)

    return codegen


def _make(qt, vnni):
    gen = _rowsk(qt, vnni) if qt in _TYPESK else _rows32(qt, vnni)

    @intrinsic
    def irow(typingctx, pw, pq, pd, ps, nblocks):
        r"""\sum_k W_k x_k over ``nblocks`` blocks (K super-blocks) of row bytes at pw and the
        8-bit activation blocks at pq (codes), pd (scales), ps (scaled sums of 16)."""
        return types.float32(types.int64, types.int64, types.int64, types.int64,
                             types.int64), gen

    return irow


irow_q8_0, irow_q4_0, irow_q4_1, irow_q5_0, irow_q5_1 = (_make(t, VNNI) for t in _TYPES32)
irow_q4_k, irow_q5_k, irow_q6_k, irow_q3_k, irow_q2_k = (_make(t, VNNI) for t in _TYPESK)

_opts = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")


# ---------------------------------------------------------------------------------------------
# activations to 8-bit blocks, and the dot of one row
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def quantize_row(x, xq, xd, xs):  # pragma: no cover - compiled
    """x (K,) float32 -> xq (K,) int8, xd (K/32,) float32 block scales, xs (K/16,) float32:
    xs_j = d_b (xq_{16j} + ... + xq_{16j+15}); x_k ~ d_b xq_k, |x_k - d_b xq_k| <= d_b / 2."""
    for b in range(x.shape[0] // 32):
        o = 32 * b
        amax = np.float32(0)
        for k in range(32):
            amax = max(amax, abs(x[o + k]))
        d = amax / np.float32(127)
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        xd[b] = d
        for j in range(2):
            s = 0
            for k in range(16 * j, 16 * j + 16):
                q = np.int32(np.rint(x[o + k] * inv))
                xq[o + k] = q
                s += q
            xs[2 * b + j] = d * np.float32(s)


@njit(inline="always", **_opts)
def idot(qt, w, n, xq, xd, xs):  # pragma: no cover - compiled
    """Row n of the block matrix w (a type of :data:`INT8_TYPES`) times the 8-bit activation
    row (xq, xd, xs) (1-d arrays or rows), float32."""
    pw = w.ctypes.data + n * w.shape[1]
    pq, pd, ps = xq.ctypes.data, xd.ctypes.data, xs.ctypes.data
    nb = xd.shape[0]
    if qt == Q8_0:
        return irow_q8_0(pw, pq, pd, ps, nb)
    if qt == Q4_0:
        return irow_q4_0(pw, pq, pd, ps, nb)
    if qt == Q4_1:
        return irow_q4_1(pw, pq, pd, ps, nb)
    if qt == Q5_0:
        return irow_q5_0(pw, pq, pd, ps, nb)
    if qt == Q5_1:
        return irow_q5_1(pw, pq, pd, ps, nb)
    if qt == Q4_K:
        return irow_q4_k(pw, pq, pd, ps, nb // 8)
    if qt == Q5_K:
        return irow_q5_k(pw, pq, pd, ps, nb // 8)
    if qt == Q6_K:
        return irow_q6_k(pw, pq, pd, ps, nb // 8)
    if qt == Q3_K:
        return irow_q3_k(pw, pq, pd, ps, nb // 8)
    return irow_q2_k(pw, pq, pd, ps, nb // 8)


@njit(inline="always", **_opts)
def idot_rows(qt, w, n, xq, xd, xs, b, y, c):  # pragma: no cover - compiled
    """y[b + r, c] = :func:`idot` of row n of w with activation row b + r of (xq, xd, xs) (2-d,
    rows of 8-bit blocks) for r < :data:`ROWS`, W's row read once; a type of blocks of 32
    (``qt`` in _TYPES32: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)."""
    pw = w.ctypes.data + n * w.shape[1]
    pq = xq.ctypes.data + b * xq.strides[0]
    pd = xd.ctypes.data + b * xd.strides[0]
    ps = xs.ctypes.data + b * xs.strides[0]
    py = y.ctypes.data + b * y.strides[0] + c * 4
    args = (pw, pq, pd, ps, xd.shape[1], xq.strides[0], xd.strides[0], xs.strides[0], py,
            y.strides[0])
    if qt == Q8_0:
        irows_q8_0(*args)
    elif qt == Q4_0:
        irows_q4_0(*args)
    elif qt == Q4_1:
        irows_q4_1(*args)
    elif qt == Q5_0:
        irows_q5_0(*args)
    else:
        irows_q5_1(*args)


# ---------------------------------------------------------------------------------------------
# few-row products y = x W^T (the decode matvecs of .matmul.qmatmul)
# ---------------------------------------------------------------------------------------------
@njit(**_opts)
def quantize_rows(x, xq, xd, xs):  # pragma: no cover - compiled
    """:func:`quantize_row` of every row of x (M, K) into xq (M, K), xd (M, K/32), xs (M, K/16)."""
    for m in range(x.shape[0]):
        quantize_row(x[m], xq[m], xd[m], xs[m])


@njit(parallel=True, **_opts)
def _gemv_parallel(qt, xq, xd, xs, w, y, parts):  # pragma: no cover - compiled
    N = w.shape[0]
    step = (N + parts - 1) // parts
    for t in prange(parts):
        for n in range(t * step, min(N, t * step + step)):
            for m in range(xq.shape[0]):
                y[m, n] = idot(qt, w, n, xq[m], xd[m], xs[m])


@njit(**_opts)
def _gemv_serial(qt, xq, xd, xs, w, y):  # pragma: no cover - compiled
    for n in range(w.shape[0]):
        for m in range(xq.shape[0]):
            y[m, n] = idot(qt, w, n, xq[m], xd[m], xs[m])


def gemv(qt: int, x: np.ndarray, w: np.ndarray, y: np.ndarray, parts: int) -> None:
    """y = x W^T for the block matrix w (uint8 rows of GGML type qt in :data:`INT8_TYPES`) and
    float32 x (M, K) rounded to 8-bit blocks; over ``parts`` threads (1: serial)."""
    M, K = x.shape
    xq = np.empty((M, K), dtype=np.int8)
    xd = np.empty((M, K // 32), dtype=np.float32)
    xs = np.empty((M, K // 16), dtype=np.float32)
    quantize_rows(x, xq, xd, xs)
    if parts > 1:
        _gemv_parallel(qt, xq, xd, xs, w, y, parts)
    else:
        _gemv_serial(qt, xq, xd, xs, w, y)
