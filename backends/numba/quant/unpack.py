r"""Vector code for the GGML block kernels of :mod:`.matmul`, written as LLVM IR through Numba
intrinsics.

Why IR: a block holds 16 to 256 values, and Numba's loops over so few values compile badly.
LLVM unrolls a constant-length inner loop and vectorises the loop over the blocks instead
(gathering single bytes, measured 6x slower than the float32 GEMV); with a run-time length it
interleaves four 16-lane vectors (64 values) and runs blocks of 32 in scalar code. Here each
block is decoded with explicit vector instructions (load its bytes, unpack the bit fields,
convert to float32, apply the scales) and multiplied into a vector accumulator that is reduced
to a scalar once per row. The K-quants' sub-block scales are unpacked with vector shuffles.

Every intrinsic takes byte addresses (``array.ctypes.data`` plus an offset) and computes
\sum_l w_l x_l over its values, w the dequantized weights, in float32 with fused
multiply-adds. The fp16 fields are loaded as LLVM ``half`` and extended exactly.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from minillama.core.quant import IQ4_GRID, QUANT_TYPES

from .. import _cache
from ..floats.half import NATIVE as NATIVE_HALF

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _const(t, n, values):
    return ir.Constant(_vec(t, n), list(values) if hasattr(values, "__len__") else [values] * n)


def _at(builder, addr, off, t):
    """Pointer to a value of type t at byte address addr + off (addr an i64)."""
    if off:
        addr = builder.add(addr, ir.Constant(_I64, off))
    return builder.inttoptr(addr, t.as_pointer())


def _load(builder, addr, off, t, align=1):
    return builder.load(_at(builder, addr, off, t), align=align)


def _half(builder, addr, off):
    """The float16 at addr + off (a block's scale) as a float32: one ``fpext`` where the target
    converts halves in instructions (:data:`..floats.half.NATIVE`), else integer operations on
    its bits (:func:`_half_bits`)."""
    if NATIVE_HALF:
        return builder.fpext(_load(builder, addr, off, ir.HalfType(), 1), _F32)
    return _half_bits(builder, builder.zext(_load(builder, addr, off, ir.IntType(16), 1), _I32))


def _half_bits(builder, h):
    """The float32 of the half whose bits are the i32 ``h`` (or each lane of an i32 vector):
    sign, exponent (bias 15 -> 127) and fraction moved into float32's fields; a subnormal
    m 2^-24 as that product; an all-ones exponent (inf, NaN) kept all ones
    (:func:`..floats.half.half_to_float_bits`, in IR)."""
    n = getattr(h.type, "count", None)
    ft = _F32 if n is None else _vec(_F32, n)

    def c(v):
        return ir.Constant(h.type, v if n is None else [v] * n)

    def f(v):
        return ir.Constant(ft, v if n is None else [v] * n)

    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    e = builder.and_(builder.lshr(h, c(10)), c(0x1F))
    m = builder.and_(h, c(0x3FF))
    frac = builder.or_(sign, builder.shl(m, c(13)))
    normal = builder.or_(frac, builder.shl(builder.add(e, c(112)), c(23)))
    special = builder.or_(frac, c(0x7F800000))
    top = builder.icmp_unsigned("==", e, c(31))
    fl = builder.bitcast(builder.select(top, special, normal), ft)
    sub = builder.fmul(builder.uitofp(m, ft), f(2.0 ** -24))
    sub = builder.select(builder.icmp_unsigned("!=", sign, c(0)),
                         builder.fsub(f(-0.0), sub), sub)
    return builder.select(builder.icmp_unsigned("==", e, c(0)), sub, fl)


def _splat(builder, v, n):
    t = _vec(v.type, n)
    one = builder.insert_element(ir.Constant(t, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(t, None), _const(_I32, n, 0))


def _fn(builder, name, ret, args):
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, args), name)
    return fn


def _shuf(builder, v, idx):
    idx = list(idx)
    return builder.shuffle_vector(v, v, _const(_I32, len(idx), idx))


def _fma(builder, a, b, c):
    n = a.type.count
    return builder.call(_fn(builder, f"llvm.fma.v{n}f32", a.type, [a.type] * 3), [a, b, c])


def _reduce(builder, v):
    n = v.type.count
    fn = _fn(builder, f"llvm.vector.reduce.fadd.v{n}f32", _F32, [_F32, v.type])
    return builder.call(fn, [ir.Constant(_F32, -0.0), v], fastmath=("reassoc", "nsz"))


def _nibbles(builder, addr, off):
    """The 32 4-bit values of 16 bytes: low nibbles (values 0..15) then high nibbles,
    as <32 x i32>."""
    a = _load(builder, addr, off, _vec(_I8, 16))
    lo = builder.and_(a, _const(_I8, 16, 15))
    hi = builder.lshr(a, _const(_I8, 16, 4))
    return builder.zext(builder.shuffle_vector(lo, hi, _const(_I32, 32, range(32))), _vec(_I32, 32))


def _fields(builder, addr, off, n, shift, mask):
    """(byte >> shift) & mask of n bytes at addr + off, as <n x i32>."""
    a = builder.zext(_load(builder, addr, off, _vec(_I8, n)), _vec(_I32, n))
    if shift:
        a = builder.lshr(a, _const(_I32, n, shift))
    return builder.and_(a, _const(_I32, n, mask))


def _tofloat(builder, q):
    return builder.sitofp(q, _vec(_F32, q.type.count))


def _host_has_avx512() -> bool:
    return "+avx512f" in _cache.target_features()


#: 4-bit codes are looked up in a 16-float table per block (``vpermps``: the table holds the
#: block's dequantized values d q - m for q = 0..15, so one instruction turns 16 codes into 16
#: weights); without AVX-512 the codes are converted and scaled instead
LOOKUP = _host_has_avx512()


def _lookup(builder, table, idx):
    """table[idx] lane by lane: table <16 x float>, idx <32 x i32> in 0..15 -> <32 x float>."""
    fn = _fn(builder, "llvm.x86.avx512.permvar.sf.512", _vec(_F32, 16),
             [_vec(_F32, 16), _vec(_I32, 16)])
    halves = [builder.call(fn, [table, _shuf(builder, idx, range(h, h + 16))]) for h in (0, 16)]
    return builder.shuffle_vector(halves[0], halves[1], _const(_I32, 32, range(32)))


def _iota16():
    return _const(_F32, 16, [float(v) for v in range(16)])


#: the 16 values of an IQ4_NL / IQ4_XS code (the core's table, as Python floats for IR constants)
KVALUES = tuple(float(v) for v in IQ4_GRID)


# ---------------------------------------------------------------------------------------------
# blocks of 32 values: one call per row of W, the loop over the blocks in IR
# ---------------------------------------------------------------------------------------------
def _decode32(kind, builder, blk):
    """(values w as <32 x float>) of the block at address blk."""
    if kind == "Q8_0":
        q = builder.sext(_load(builder, blk, 2, _vec(_I8, 32)), _vec(_I32, 32))
        return builder.fmul(_tofloat(builder, q), _splat(builder, _half(builder, blk, 0), 32))
    if kind == "IQ4_NL" or (LOOKUP and kind in ("Q4_0", "Q4_1")):
        d = _splat(builder, _half(builder, blk, 0), 16)
        if kind == "IQ4_NL":
            table = builder.fmul(_const(_F32, 16, KVALUES), d)
        elif kind == "Q4_0":
            table = builder.fmul(_const(_F32, 16, [float(v - 8) for v in range(16)]), d)
        else:
            table = _fma(builder, _iota16(), d, _splat(builder, _half(builder, blk, 2), 16))
        return _lookup(builder, table, _nibbles(builder, blk, 4 if kind == "Q4_1" else 2))
    if kind in ("Q4_0", "Q4_1"):
        q = _nibbles(builder, blk, 2 if kind == "Q4_0" else 4)
    else:  # Q5_0 / Q5_1: the fifth bits are bit l of the little-endian u32 qh
        q0 = 2 if kind == "Q5_0" else 4
        qh = _splat(builder, _load(builder, blk, q0, _I32), 32)
        bit = builder.and_(builder.lshr(qh, _const(_I32, 32, range(32))), _const(_I32, 32, 1))
        q = builder.or_(_nibbles(builder, blk, q0 + 4), builder.shl(bit, _const(_I32, 32, 4)))
    d = _splat(builder, _half(builder, blk, 0), 32)
    if kind in ("Q4_0", "Q5_0"):
        q = builder.sub(q, _const(_I32, 32, 8 if kind == "Q4_0" else 16))
        return builder.fmul(_tofloat(builder, q), d)
    return _fma(builder, _tofloat(builder, q), d, _splat(builder, _half(builder, blk, 2), 32))


def _make_row32(kind):
    size = QUANT_TYPES[kind].block_bytes

    @intrinsic
    def rowdot(typingctx, pw, px, nblocks):
        r"""\sum_k W_k x_k over the ``nblocks`` blocks at byte address pw and the float32 values
        at px."""
        sig = types.float32(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            pw_, px_, nb = args
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 32), None))
            builder.store(_const(_F32, 32, 0.0), acc)
            with cgutils.for_range(builder, nb) as loop:
                i = loop.index
                blk = builder.add(pw_, builder.mul(i, ir.Constant(_I64, size)))
                xa = builder.add(px_, builder.mul(i, ir.Constant(_I64, 128)))
                x = _load(builder, xa, 0, _vec(_F32, 32), 4)
                w = _decode32(kind, builder, blk)
                builder.store(_fma(builder, w, x, builder.load(acc)), acc)
            return _reduce(builder, builder.load(acc))

        return sig, codegen

    return rowdot


row_q8_0 = _make_row32("Q8_0")
row_q4_0 = _make_row32("Q4_0")
row_q4_1 = _make_row32("Q4_1")
row_q5_0 = _make_row32("Q5_0")
row_q5_1 = _make_row32("Q5_1")
row_iq4_nl = _make_row32("IQ4_NL") if LOOKUP else None


# ---------------------------------------------------------------------------------------------
# K-quants (super-blocks of 256 values): one call per row of W. The sub-block scales are
# unpacked with vector shuffles into A (and the mins into B), per 32-run of values (Q4_K, Q5_K)
# or per 16-run (Q6_K, Q3_K, Q2_K); then w = A q - B, and the products go into one vector
# accumulator.
# ---------------------------------------------------------------------------------------------
def _kscales(kind, builder, blk):
    """(A, B) of the super-block at address blk: float vectors of 8 (per 32-run) or 16 (per
    16-run) entries; B None for the types without mins."""
    def bytes_at(off, n):
        return builder.zext(_load(builder, blk, off, _vec(_I8, n)), _vec(_I32, n))

    def fl(v, d):
        n = v.type.count
        return builder.fmul(builder.sitofp(v, _vec(_F32, n)), _splat(builder, d, n))

    c8 = lambda vals: _const(_I32, 8, vals)  # noqa: E731
    if kind in ("Q4_K", "Q5_K"):  # 12 bytes of 6-bit (scale, min) pairs at byte 4
        q = bytes_at(4, 12)
        top = builder.and_(builder.shl(builder.lshr(q, _const(_I32, 12, 6)), _const(_I32, 12, 4)),
                           _const(_I32, 12, 48))  # (q[j] >> 6) << 4
        low, hi8 = c8([63] * 4 + [15] * 4), c8([0] * 4 + [48] * 4)
        sc = builder.or_(builder.and_(_shuf(builder, q, [0, 1, 2, 3, 8, 9, 10, 11]), low),
                         builder.and_(_shuf(builder, top, [0] * 4 + [0, 1, 2, 3]), hi8))
        mn = builder.or_(builder.and_(builder.lshr(_shuf(builder, q, [4, 5, 6, 7, 8, 9, 10, 11]),
                                                   c8([0] * 4 + [4] * 4)), low),
                         builder.and_(_shuf(builder, top, [0] * 4 + [4, 5, 6, 7]), hi8))
        return fl(sc, _half(builder, blk, 0)), fl(mn, _half(builder, blk, 2))
    if kind == "Q6_K":  # 16 int8 scales at byte 192, d at 208
        sc = builder.sext(_load(builder, blk, 192, _vec(_I8, 16)), _vec(_I32, 16))
        return fl(sc, _half(builder, blk, 208)), None
    if kind == "Q2_K":  # 16 bytes (min << 4 | scale) at byte 0, d at 80, dmin at 82
        q = bytes_at(0, 16)
        return (fl(builder.and_(q, _const(_I32, 16, 15)), _half(builder, blk, 80)),
                fl(builder.lshr(q, _const(_I32, 16, 4)), _half(builder, blk, 82)))
    # Q3_K: 16 6-bit scales in 12 bytes at byte 96 (low 4 bits in bytes 0-7, high 2 in 8-11)
    q = bytes_at(96, 12)
    i = range(16)
    lo = builder.and_(builder.lshr(_shuf(builder, q, [k & 7 for k in i]),
                                   _const(_I32, 16, [4 * (k >> 3) for k in i])),
                      _const(_I32, 16, 15))
    hi = builder.and_(builder.lshr(_shuf(builder, q, [8 + (k & 3) for k in i]),
                                   _const(_I32, 16, [2 * (k >> 2) for k in i])),
                      _const(_I32, 16, 3))
    sc = builder.sub(builder.or_(lo, builder.shl(hi, _const(_I32, 16, 4))), _const(_I32, 16, 32))
    return fl(sc, _half(builder, blk, 108)), None


def _run_scale(builder, A, r):
    """<32 x float> of the scales of the 32-run r of values."""
    if A.type.count == 8:
        return _shuf(builder, A, [r] * 32)
    return _shuf(builder, A, [2 * r] * 16 + [2 * r + 1] * 16)


def _kcodes(kind, builder, blk, r):
    """The integer codes q of the 32-run r of the super-block at blk, <32 x i32>."""
    if kind in ("Q4_K", "Q5_K"):
        c, hi = divmod(r, 2)
        q = _fields(builder, blk, (16 if kind == "Q4_K" else 48) + 32 * c, 32, 4 * hi, 15)
        if kind == "Q5_K":  # the fifth bit: bit r of the 32 bytes at 16
            h = _fields(builder, blk, 16, 32, r, 1)
            q = builder.or_(q, builder.shl(h, _const(_I32, 32, 4)))
        return q
    if kind == "Q6_K":
        c, k = divmod(r, 4)  # half c, group k: ql bytes at 64c + 32 (k & 1), nibble k >> 1
        lo = _fields(builder, blk, 64 * c + 32 * (k & 1), 32, 4 * (k >> 1), 15)
        h = _fields(builder, blk, 128 + 32 * c, 32, 2 * k, 3)
        q = builder.or_(lo, builder.shl(h, _const(_I32, 32, 4)))
        return builder.sub(q, _const(_I32, 32, 32))
    c, g = divmod(r, 4)  # Q3_K, Q2_K: 2-bit fields, values 128c + 32g + l
    q = _fields(builder, blk, (32 if kind == "Q3_K" else 16) + 32 * c, 32, 2 * g, 3)
    if kind == "Q3_K":  # minus 4 where bit r of the hmask byte l is clear
        h = _fields(builder, blk, 0, 32, r, 1)
        q = builder.sub(q, builder.shl(builder.xor(h, _const(_I32, 32, 1)), _const(_I32, 32, 2)))
    return q


def _kweights(kind, builder, blk, A, B, r):
    """The dequantized weights of the 32-run r of the super-block at blk, <32 x float>."""
    if LOOKUP and kind == "Q4_K":
        table = _fma(builder, _iota16(), _shuf(builder, A, [r] * 16),
                     builder.fneg(_shuf(builder, B, [r] * 16)))
        return _lookup(builder, table, _kcodes(kind, builder, blk, r))
    q = _tofloat(builder, _kcodes(kind, builder, blk, r))
    if B is None:
        return builder.fmul(q, _run_scale(builder, A, r))
    return _fma(builder, q, _run_scale(builder, A, r), builder.fneg(_run_scale(builder, B, r)))


def _make_krow(kind):
    size = QUANT_TYPES[kind].block_bytes

    @intrinsic
    def rowdot(typingctx, pw, px, nsuper):
        r"""\sum_k W_k x_k over the ``nsuper`` super-blocks at byte address pw and the float32
        values at px."""
        sig = types.float32(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            pw_, px_, nb = args
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 32), None))
            builder.store(_const(_F32, 32, 0.0), acc)
            with cgutils.for_range(builder, nb) as loop:
                blk = builder.add(pw_, builder.mul(loop.index, ir.Constant(_I64, size)))
                xb = builder.add(px_, builder.mul(loop.index, ir.Constant(_I64, 1024)))
                A, B = _kscales(kind, builder, blk)
                a = builder.load(acc)
                for r in range(8):
                    w = _kweights(kind, builder, blk, A, B, r)
                    a = _fma(builder, w, _load(builder, xb, 128 * r, _vec(_F32, 32), 4), a)
                builder.store(a, acc)
            return _reduce(builder, builder.load(acc))

        return sig, codegen

    return rowdot


row_q4_k = _make_krow("Q4_K")
row_q5_k = _make_krow("Q5_K")
row_q6_k = _make_krow("Q6_K")
row_q3_k = _make_krow("Q3_K")
row_q2_k = _make_krow("Q2_K")


# ---------------------------------------------------------------------------------------------
# dequantization of a row into float32 (the tiles of the many-row products): the same decoding,
# stored instead of multiplied
# ---------------------------------------------------------------------------------------------
def _make_deq(kind):
    size, per = QUANT_TYPES[kind].block_bytes, QUANT_TYPES[kind].block_elems

    @intrinsic
    def deq(typingctx, pw, pout, nblocks):
        """Writes the ``nblocks`` blocks at byte address pw, dequantized, as float32 at pout."""
        sig = types.void(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            pw_, po_, nb = args
            with cgutils.for_range(builder, nb) as loop:
                blk = builder.add(pw_, builder.mul(loop.index, ir.Constant(_I64, size)))
                ob = builder.add(po_, builder.mul(loop.index, ir.Constant(_I64, 4 * per)))
                if per == 32:
                    runs = [_decode32(kind, builder, blk)]
                else:
                    A, B = _kscales(kind, builder, blk)
                    runs = [_kweights(kind, builder, blk, A, B, r) for r in range(8)]
                for r, w in enumerate(runs):
                    builder.store(w, _at(builder, ob, 128 * r, _vec(_F32, 32)), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return deq


deq_q8_0 = _make_deq("Q8_0")
deq_q4_0 = _make_deq("Q4_0")
deq_q4_1 = _make_deq("Q4_1")
deq_q5_0 = _make_deq("Q5_0")
deq_q5_1 = _make_deq("Q5_1")
deq_iq4_nl = _make_deq("IQ4_NL") if LOOKUP else None
deq_q4_k = _make_deq("Q4_K")
deq_q5_k = _make_deq("Q5_K")
deq_q6_k = _make_deq("Q6_K")
deq_q3_k = _make_deq("Q3_K")
deq_q2_k = _make_deq("Q2_K")
