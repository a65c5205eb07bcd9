r"""Integer dot products of GGML block rows with activations rounded to 8-bit blocks, written as
LLVM IR through Numba intrinsics (the decode matvecs of :mod:`.quant` and :mod:`.qdecode`).

The activation row x (K values) is rounded once per product to blocks of 32 (the layout of
:func:`quantize_row`): int8 codes ``xq`` with x_k ~ d_b xq_k, d_b = max_{k in b} |x_k| / 127 in
float32 (``xd``), and the sum of each 16 consecutive codes times its block's d (``xs``, float32,
K / 16 entries).

Every weight is written w = A (u - o) - B with u an unsigned byte code, o a constant offset of
the type and A, B the scales (and mins) of its block or sub-block, so

    \sum_k w_k x_k ~ \sum_b d_b A_b \sum_{k in b} u_k xq_k - (o A_b + B_b) d_b \sum_{k in b} xq_k.

The first sum is an integer dot of unsigned by signed bytes: ``vpdpbusd`` (AVX512-VNNI, 64
products into 16 lanes of 4) where the host has it, else portable IR (widen to i32, multiply,
add groups of 4) that LLVM lowers for any target. Each group of 4 products is converted to
float32 and multiplied by its scale with a fused multiply-add, the second term by one more
fused multiply-add against ``xs``; one horizontal sum per row. The 16-lane accumulators hold
64 values (two blocks of 32, or two 32-runs of a K super-block).

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

from . import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .qsimd import (
    _F32,
    _I8,
    _I32,
    _I64,
    EXACT,
    _at,
    _const,
    _fma,
    _fn,
    _half,
    _kscales,
    _load,
    _shuf,
    _splat,
    _vec,
)
from .qtypes import BY_ID, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


def _host_features() -> str:
    try:
        return binding.get_host_cpu_features().flatten()
    except Exception:  # no feature string: the portable code
        return ""


_FEATS = _host_features()
#: unsigned-by-signed byte dots by ``vpdpbusd`` (zmm); else the portable IR
VNNI = "+avx512vnni" in _FEATS and "+avx512bw" in _FEATS
#: per-byte affine maps by ``vgf2p8affineqb`` (zmm) unpack nibbles in the VNNI build (else a
#: select)
GFNI = "+gfni" in _FEATS and "+avx512bw" in _FEATS
#: LLVM 21 on takes the byte operands of the VNNI intrinsics as byte vectors (before: i32 lanes)
_VNNI_BYTES = binding.llvm_version_info[0] >= 21

#: the GGML type ids with an integer kernel, blocks of 32 and K super-blocks of 256
_TYPES32 = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
_TYPESK = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K)
#: the GGML type ids with an integer kernel (the others take the float32 kernels of .quant)
INT8_TYPES = tuple(sorted(_TYPES32 + _TYPESK))


_EXACT = threading.local()


@contextlib.contextmanager
def exact_products():
    """Within it (in this thread) every product with a block matrix keeps float32 activations:
    the forward that gradients are taken of (training, LoRA) stays exact to float32 rounding."""
    before = getattr(_EXACT, "on", False)
    _EXACT.on = True
    try:
        yield
    finally:
        _EXACT.on = before


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
def _dot4(builder, u, s, vnni, acc=None):
    """Sums of 4 consecutive products u_k s_k (u unsigned, s signed bytes, <n x i8>) as
    <n/4 x i32>, added to acc (<n/4 x i32>) when given."""
    n = u.type.count
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
        return u, d, builder.fmul(d, ir.Constant(_F32, -128.0), flags=EXACT)
    u = _nib32(builder, blk, _NIBBLES_AT[qt])
    if qt in _HIGH_BITS_AT:
        u = builder.or_(u, _qh_bits(builder, blk, _HIGH_BITS_AT[qt]))
    if qt in (Q4_1, Q5_1):  # w = d q + m
        return u, d, _half(builder, blk, 2)
    return u, d, builder.fmul(d, ir.Constant(_F32, -8.0 if qt == Q4_0 else -16.0),
                                 flags=EXACT)


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


# ---------------------------------------------------------------------------------------------
# the one float order: a sequential chain over the sub-blocks (shared with .qgemm8's tiles)
# ---------------------------------------------------------------------------------------------
def _fma1(builder, a, b, c):
    """fma(a, b, c) of float scalars (one rounding), called on one-lane vectors: Numba's
    fastmath pass adds its flags to calls that return a float scalar, and with them LLVM may
    split or reassociate the product."""
    t = _vec(_F32, 1)
    one = [builder.insert_element(ir.Constant(t, None), v, ir.Constant(_I32, 0)) for v in (a, b, c)]
    out = builder.call(_fn(builder, "llvm.fma.v1f32", t, [t] * 3), one)
    return builder.extract_element(out, ir.Constant(_I32, 0))


def _isum(builder, p, lo, n):
    """The integer sum of lanes lo .. lo + n - 1 of p (<16 x i32>): exact in any order."""
    part = _shuf(builder, p, range(lo, lo + n))
    fn = _fn(builder, f"llvm.vector.reduce.add.v{n}i32", _I32, [part.type])
    return builder.call(fn, [part])


def _chain(builder, acc, isum, dA, X, C):
    r"""acc + I dA + X C as two fused multiply-adds, in this order: the step of one sub-block in
    the float order every 8-bit product follows (:mod:`.qgemm8`'s tiles too), so a result does
    not depend on the kernel, the rows beside it or the thread that computes it."""
    acc = _fma1(builder, builder.sitofp(isum, _F32), dA, acc)
    return _fma1(builder, X, C, acc)


def _el(builder, v, i):
    return builder.extract_element(v, ir.Constant(_I32, i))


def _q8_signed(builder, q, xs):
    """(|q|, xs with the sign of q) for Q8_0's signed codes q: their unsigned-by-signed dot is
    the dot of q and xs (|-128| = 128 as an unsigned byte)."""
    n = q.type.count
    zero = _const(_I8, n, 0)
    neg = builder.icmp_signed("<", q, zero)
    return (builder.select(neg, builder.sub(zero, q), q),
            builder.select(neg, builder.sub(zero, xs), xs))


def _blocks32(qt, builder, blk, npair_blocks, gfni):
    """(u, A, C) of one block (npair_blocks 1) or of a pair (2) of a type of blocks of 32, in
    the form of :mod:`.qgemm8` (w = A u + C): Q8_0 as its signed codes q with A = d, C = 0
    (its unsigned-by-signed dot is taken by :func:`_q8_signed`), the others as
    :func:`_block32` builds them. A and C are float vectors of npair_blocks entries."""
    size = BY_ID[qt].block_bytes
    if qt == Q8_0:
        qs = [_b(builder, blk, size * j + 2, 32) for j in range(npair_blocks)]
        ds = [_half(builder, blk, size * j) for j in range(npair_blocks)]
        q = qs[0] if npair_blocks == 1 else _cat(builder, qs[0], qs[1])
        A = ir.Constant(_vec(_F32, npair_blocks), None)
        for j, d in enumerate(ds):
            A = builder.insert_element(A, d, ir.Constant(_I32, j))
        return q, A, _const(_F32, npair_blocks, 0.0)
    if npair_blocks == 2:
        return _pair32(qt, builder, blk, gfni)
    u, a, m = _block32(qt, builder, blk)
    return u, _splat(builder, a, 1), _splat(builder, m, 1)


def _step32(qt, builder, acc, blk, pq, pd, ps, nblocks, vnni):
    """acc chained through the nblocks (1 or 2) blocks of 32 at blk with the activation blocks
    at pq (codes), pd (scales), ps (scaled sums of 16)."""
    u, A, C = _blocks32(qt, builder, blk, nblocks, vnni and GFNI)
    xs = _load(builder, pq, 0, _vec(_I8, 32 * nblocks))
    if qt == Q8_0:
        u, xs = _q8_signed(builder, u, xs)
    p = _dot4(builder, u, xs, vnni)
    dx = _load(builder, pd, 0, _vec(_F32, nblocks), 4)
    dA = builder.fmul(dx, A, flags=EXACT)
    sums = _load(builder, ps, 0, _vec(_F32, 2 * nblocks), 4)
    for j in range(nblocks):
        X = builder.fadd(_el(builder, sums, 2 * j), _el(builder, sums, 2 * j + 1), flags=EXACT)
        acc = _chain(builder, acc, _isum(builder, p, 8 * j, 8), _el(builder, dA, j), X,
                     _el(builder, C, j))
    return acc


def _rows32(qt, vnni, R=1):
    r"""The codegen of \sum_k W_k x_{rk} for a row of blocks of 32 and R activation rows, the
    row of W decoded once per pair of blocks: per block b, I_b = \sum_{k in b} u_k xq_k (an
    exact integer dot), then acc = fma(I_b, d_b A_b, acc), acc = fma(X_b, C_b, acc) with X_b
    the scaled code sum of the activation block (:func:`_chain`). R = 1 returns the sum; R > 1
    stores the R sums (each equal to the R = 1 result bit for bit)."""
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        if R == 1:
            pw, pq, pd, ps, nb = args
            sq = sd = ss = ir.Constant(_I64, 0)
        else:
            pw, pq, pd, ps, nb, sq, sd, ss, py, sy = args
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(R)]
        npair = builder.sdiv(nb, ir.Constant(_I64, 2))

        def at(base, i, step):
            return builder.add(base, builder.mul(i, ir.Constant(_I64, step)))

        def row(base, stride, r):
            return builder.add(base, builder.mul(stride, ir.Constant(_I64, r)))

        def step(i, n):  # blocks n i .. n i + n - 1 (n = 2: a pair) into every row's chain
            for r in range(R):
                builder.store(_step32(qt, builder, builder.load(accs[r]), at(pw, i, n * size),
                                      at(row(pq, sq, r), i, 32 * n),
                                      at(row(pd, sd, r), i, 4 * n),
                                      at(row(ps, ss, r), i, 8 * n), n, vnni), accs[r])

        with cgutils.for_range(builder, npair) as loop:
            step(loop.index, 2)
        with builder.if_then(builder.icmp_signed("!=", builder.mul(npair, ir.Constant(_I64, 2)),
                                                 nb)):
            step(builder.sub(nb, ir.Constant(_I64, 1)), 1)
        if R == 1:
            return builder.load(accs[0])
        for r in range(R):
            builder.store(builder.load(accs[r]), _at(builder, row(py, sy, r), 0, _F32), align=4)
        return context.get_dummy_value()

    return codegen


def _make_multi(qt, vnni, R):
    gen = _rows32(qt, vnni, R)

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


def _prefetch(builder, addr):
    """A read prefetch of the cache line at addr (the same place in the next rows of W: from
    memory, the chains of a few rows alone keep too few loads in flight)."""
    i8p = ir.IntType(8).as_pointer()
    fn = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, _I32, _I32, _I32])
    builder.call(fn, [builder.inttoptr(addr, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                      ir.Constant(_I32, 1)])


def _sums_by_row(builder, ps, per):
    """The integer sums of each run of ``per`` lanes of every vector of ps (one per row of W,
    equal lengths) as one vector in run-major order: lane j R + r holds the sum of run j of
    ps[r] (R = len(ps)). Adjacent lanes are summed pairwise across two vectors at a time
    (integer sums: exact in any order)."""
    n, runs, R = ps[0].type.count, ps[0].type.count // per, len(ps)

    def pairs(a, b, m):  # lanes 2i + 2i+1 of a then of b (m lanes out)
        ev = builder.shuffle_vector(a, b, _const(_I32, m, range(0, 2 * m, 2)))
        od = builder.shuffle_vector(a, b, _const(_I32, m, range(1, 2 * m, 2)))
        return builder.add(ev, od)

    vs = list(ps)
    while len(vs) > 1:  # each round halves the lanes of a run and the count of vectors
        vs = [pairs(vs[i], vs[i + 1], n) for i in range(0, len(vs), 2)]
        per //= 2
    v = vs[0]
    while per > 1:
        v = pairs(v, v, v.type.count // 2)
        per //= 2
    return _shuf(builder, v, [r * runs + j for j in range(runs) for r in range(R)])


def _run_major(builder, vals):
    """The vectors of vals (one per row of W, n entries each) as one vector in run-major order
    (lane j R + r: entry j of vals[r]), as :func:`_sums_by_row` lays out its sums."""
    n, R = vals[0].type.count, len(vals)
    while len(vals) > 1:
        vals = [_cat(builder, vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return _shuf(builder, vals[0], [r * n + j for j in range(n) for r in range(R)])


def _part(builder, v, j, R):
    """Lanes j R .. j R + R - 1 of v: run j of a run-major vector."""
    return _shuf(builder, v, range(j * R, j * R + R))


def _chain4(builder, acc, isum, dA, X, C):
    """:func:`_chain` of NW rows of W at once, one per lane (vector fused multiply-adds:
    each lane rounds as the scalar chain does)."""
    n = isum.type.count
    acc = _fma(builder, builder.sitofp(isum, _vec(_F32, n)), dA, acc)
    return _fma(builder, _splat(builder, X, n), C, acc)


#: rows of W per call of the one-activation-row kernels (:func:`idot4`): independent chains,
#: so the fused multiply-adds of one wait on none of the others'
WROWS = 4
#: how many rows of W ahead the one-activation-row kernels prefetch
PREFETCH_ROWS = 16


def _wrows32(qt, vnni, NW=WROWS):
    """The codegen of :func:`_rows32` for NW consecutive rows of W (row stride ``sw`` bytes)
    and one activation row: the same chain per row of W, the rows' chains side by side in the
    lanes of one vector; the NW sums stored at py."""
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        pw, sw, pq, pd, ps, nb, py = args
        acc = cgutils.alloca_once_value(builder, _const(_F32, NW, 0.0))
        npair = builder.sdiv(nb, ir.Constant(_I64, 2))

        def at(base, i, step):
            return builder.add(base, builder.mul(i, ir.Constant(_I64, step)))

        def step(i, n):
            xq = _load(builder, at(pq, i, 32 * n), 0, _vec(_I8, 32 * n))
            dx = _load(builder, at(pd, i, 4 * n), 0, _vec(_F32, n), 4)
            sums = _load(builder, at(ps, i, 8 * n), 0, _vec(_F32, 2 * n), 4)
            prods, As, Cs = [], [], []
            for r in range(NW):
                blk = at(builder.add(pw, builder.mul(sw, ir.Constant(_I64, r))), i, n * size)
                _prefetch(builder, builder.add(blk, builder.mul(sw, ir.Constant(
                    _I64, PREFETCH_ROWS))))
                u, A, C = _blocks32(qt, builder, blk, n, vnni and GFNI)
                xs = xq
                if qt == Q8_0:
                    u, xs = _q8_signed(builder, u, xq)
                prods.append(_dot4(builder, u, xs, vnni))
                As.append(A)
                Cs.append(C)
            isums = _sums_by_row(builder, prods, 8)
            dA = builder.fmul(_shuf(builder, dx, [j for j in range(n) for _ in range(NW)]),
                              _run_major(builder, As), flags=EXACT)
            C = _run_major(builder, Cs)
            a = builder.load(acc)
            for j in range(n):
                X = builder.fadd(_el(builder, sums, 2 * j), _el(builder, sums, 2 * j + 1),
                                 flags=EXACT)
                a = _chain4(builder, a, _part(builder, isums, j, NW), _part(builder, dA, j, NW),
                            X, _part(builder, C, j, NW))
            builder.store(a, acc)

        with cgutils.for_range(builder, npair) as loop:
            step(loop.index, 2)
        with builder.if_then(builder.icmp_signed("!=", builder.mul(npair, ir.Constant(_I64, 2)),
                                                 nb)):
            step(builder.sub(nb, ir.Constant(_I64, 1)), 1)
        builder.store(builder.load(acc), _at(builder, py, 0, _vec(_F32, NW)), align=4)
        return context.get_dummy_value()

    return codegen


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


def _kparts(qt, builder, blk):
    """(A, C) of the super-block at blk in the form w = A u + C of :mod:`.qgemm8`: float
    vectors of one entry per sub-block (8 of 32 values, or 16 of 16)."""
    A, B = _kscales(BY_ID[qt].name, builder, blk)
    n = A.type.count
    if B is None:
        return A, builder.fmul(A, _splat(builder, ir.Constant(_F32, -_OFFSET[qt]), n), flags=EXACT)
    return A, builder.fsub(_splat(builder, ir.Constant(_F32, 0.0), n), B, flags=EXACT)


def _rowsk(qt, vnni):
    r"""The codegen of \sum_k W_k x_k for a row of K super-blocks: per sub-block j (of G = 32 or
    16 values), in the order of k, acc = fma(I_j, d A_j, acc), acc = fma(X_j, C_j, acc)
    (:func:`_chain`, the order of :mod:`.qgemm8`'s tiles)."""
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        pw, pq, pd, ps, nb = args
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
        with cgutils.for_range(builder, nb) as loop:
            i = loop.index
            blk = builder.add(pw, builder.mul(i, ir.Constant(_I64, size)))
            qx = builder.add(pq, builder.mul(i, ir.Constant(_I64, 256)))
            dx = _load(builder, builder.add(pd, builder.mul(i, ir.Constant(_I64, 32))), 0,
                       _vec(_F32, 8), 4)
            sums = _load(builder, builder.add(ps, builder.mul(i, ir.Constant(_I64, 64))), 0,
                         _vec(_F32, 16), 4)
            A, C = _kparts(qt, builder, blk)
            n = A.type.count  # 8 (G = 32) or 16 (G = 16) sub-blocks
            G = 256 // n
            a = builder.load(acc)
            for c in range(4):
                xs = _load(builder, qx, 64 * c, _vec(_I8, 64))
                p = _dot4(builder, _kchunk(qt, builder, blk, c), xs, vnni)
                for t in range(64 // G):
                    j = (64 // G) * c + t
                    dA = builder.fmul(_el(builder, dx, j * G // 32), _el(builder, A, j),
                                      flags=EXACT)
                    if G == 32:
                        X = builder.fadd(_el(builder, sums, 2 * j),
                                         _el(builder, sums, 2 * j + 1), flags=EXACT)
                    else:
                        X = _el(builder, sums, j)
                    a = _chain(builder, a, _isum(builder, p, G // 4 * t, G // 4), dA, X,
                               _el(builder, C, j))
            builder.store(a, acc)
        return builder.load(acc)

    return codegen


def _wrowsk(qt, vnni, NW=WROWS):
    """The codegen of :func:`_rowsk` for NW consecutive rows of W (row stride ``sw`` bytes) and
    one activation row, the rows' chains side by side in the lanes of one vector."""
    size = BY_ID[qt].block_bytes

    def codegen(context, builder, signature, args):
        pw, sw, pq, pd, ps, nb, py = args
        acc = cgutils.alloca_once_value(builder, _const(_F32, NW, 0.0))
        with cgutils.for_range(builder, nb) as loop:
            i = loop.index
            blks = [builder.add(builder.add(pw, builder.mul(sw, ir.Constant(_I64, r))),
                                builder.mul(i, ir.Constant(_I64, size))) for r in range(NW)]
            qx = builder.add(pq, builder.mul(i, ir.Constant(_I64, 256)))
            dx = _load(builder, builder.add(pd, builder.mul(i, ir.Constant(_I64, 32))), 0,
                       _vec(_F32, 8), 4)
            sums = _load(builder, builder.add(ps, builder.mul(i, ir.Constant(_I64, 64))), 0,
                         _vec(_F32, 16), 4)
            for b in blks:
                _prefetch(builder, builder.add(b, builder.mul(sw, ir.Constant(_I64,
                                                                         PREFETCH_ROWS))))
            parts = [_kparts(qt, builder, b) for b in blks]
            n = parts[0][0].type.count  # 8 (G = 32) or 16 (G = 16) sub-blocks
            G = 256 // n
            a = builder.load(acc)
            runs = 64 // G  # sub-blocks of a chunk of 64 codes
            dxs = _shuf(builder, dx, [j * G // 32 for j in range(n) for _ in range(NW)])
            dA = builder.fmul(dxs, _run_major(builder, [A for A, _ in parts]), flags=EXACT)
            C = _run_major(builder, [c for _, c in parts])
            for c in range(4):
                xs = _load(builder, qx, 64 * c, _vec(_I8, 64))
                isums = _sums_by_row(builder, [_dot4(builder, _kchunk(qt, builder, b, c), xs,
                                                     vnni) for b in blks], G // 4)
                for t in range(runs):
                    j = runs * c + t
                    if G == 32:
                        X = builder.fadd(_el(builder, sums, 2 * j),
                                         _el(builder, sums, 2 * j + 1), flags=EXACT)
                    else:
                        X = _el(builder, sums, j)
                    a = _chain4(builder, a, _part(builder, isums, t, NW),
                                _part(builder, dA, j, NW), X, _part(builder, C, j, NW))
            builder.store(a, acc)
        builder.store(builder.load(acc), _at(builder, py, 0, _vec(_F32, NW)), align=4)
        return context.get_dummy_value()

    return codegen


def _make4(qt, vnni):
    gen = _wrowsk(qt, vnni) if qt in _TYPESK else _wrows32(qt, vnni)

    @intrinsic
    def irow4(typingctx, pw, sw, pq, pd, ps, nblocks, py):
        r""":func:`irow` of the :data:`WROWS` rows of W at pw, pw + sw, ... with one activation
        row, stored as float32 at py."""
        return types.none(*([types.int64] * 7)), gen

    return irow4


(irow4_q8_0, irow4_q4_0, irow4_q4_1, irow4_q5_0, irow4_q5_1, irow4_q4_k, irow4_q5_k, irow4_q6_k,
 irow4_q3_k, irow4_q2_k) = (_make4(t, VNNI) for t in _TYPES32 + _TYPESK)


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
def idot4(qt, w, n, xq, xd, xs, y, c):  # pragma: no cover - compiled
    """y[c + r] = :func:`idot` of row n + r of w with the activation row (xq, xd, xs) for
    r < :data:`WROWS` (each equal to idot's bit for bit)."""
    pw = w.ctypes.data + n * w.shape[1]
    sw = w.shape[1]
    pq, pd, ps = xq.ctypes.data, xd.ctypes.data, xs.ctypes.data
    py = y.ctypes.data + c * 4
    nb = xd.shape[0]
    if qt == Q8_0:
        irow4_q8_0(pw, sw, pq, pd, ps, nb, py)
    elif qt == Q4_0:
        irow4_q4_0(pw, sw, pq, pd, ps, nb, py)
    elif qt == Q4_1:
        irow4_q4_1(pw, sw, pq, pd, ps, nb, py)
    elif qt == Q5_0:
        irow4_q5_0(pw, sw, pq, pd, ps, nb, py)
    elif qt == Q5_1:
        irow4_q5_1(pw, sw, pq, pd, ps, nb, py)
    elif qt == Q4_K:
        irow4_q4_k(pw, sw, pq, pd, ps, nb // 8, py)
    elif qt == Q5_K:
        irow4_q5_k(pw, sw, pq, pd, ps, nb // 8, py)
    elif qt == Q6_K:
        irow4_q6_k(pw, sw, pq, pd, ps, nb // 8, py)
    elif qt == Q3_K:
        irow4_q3_k(pw, sw, pq, pd, ps, nb // 8, py)
    else:
        irow4_q2_k(pw, sw, pq, pd, ps, nb // 8, py)


@njit(inline="always", **_opts)
def idot_span(qt, w, lo, hi, xq, xd, xs, y):  # pragma: no cover - compiled
    """y[n] = :func:`idot` of row n of w with the activation row (xq, xd, xs), lo <= n < hi
    (y 1-d, contiguous): :data:`WROWS` rows of W per call of :func:`idot4`, then one by one."""
    n = lo
    while n + WROWS <= hi:
        idot4(qt, w, n, xq, xd, xs, y, n)
        n += WROWS
    for m in range(n, hi):
        y[m] = idot(qt, w, m, xq, xd, xs)


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
# few-row products y = x W^T (the decode matvecs of .quant.qmatmul)
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
        for m in range(xq.shape[0]):
            idot_span(qt, w, t * step, min(N, t * step + step), xq[m], xd[m], xs[m], y[m])


@njit(**_opts)
def _gemv_serial(qt, xq, xd, xs, w, y):  # pragma: no cover - compiled
    for m in range(xq.shape[0]):
        idot_span(qt, w, 0, w.shape[0], xq[m], xd[m], xs[m], y[m])


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
