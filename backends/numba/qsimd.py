r"""Vector code for the GGML block kernels of :mod:`.quant`, written as LLVM IR through Numba
intrinsics.

Why IR: a block holds 16 to 256 values, and Numba's loops over so few values compile badly.
LLVM unrolls a constant-length inner loop and vectorises the loop over the blocks instead
(gathering single bytes, measured 6x slower than the float32 GEMV); with a run-time length it
interleaves four 16-lane vectors (64 values) and runs blocks of 32 in scalar code. Here each
block is decoded with explicit vector instructions (load its bytes, unpack the bit fields,
convert to float32, apply the scales) and multiplied into a vector accumulator that is reduced
to a scalar once per row (blocks of 32) or once per 256-value super-block (K-quants).

Every intrinsic takes byte addresses (``array.ctypes.data`` plus an offset) and computes
\sum_l w_l x_l over its values, w the dequantized weights, in float32 with fused
multiply-adds. The fp16 fields are loaded as LLVM ``half`` and extended exactly.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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
    return builder.fpext(_load(builder, addr, off, ir.HalfType(), 1), _F32)


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


def _fma(builder, a, b, c):
    n = a.type.count
    return builder.call(_fn(builder, f"llvm.fma.v{n}f32", a.type, [a.type] * 3), [a, b, c])


def _reduce(builder, v):
    n = v.type.count
    fn = _fn(builder, f"llvm.vector.reduce.fadd.v{n}f32", _F32, [_F32, v.type])
    return builder.call(fn, [ir.Constant(_F32, -0.0), v], fastmath=("reassoc", "nsz"))


def _nibbles(builder, addr, off):
    """The 32 4-bit values of 16 bytes: low nibbles (values 0..15) then high nibbles, as <32 x i32>."""
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


# ---------------------------------------------------------------------------------------------
# blocks of 32 values: one call per row of W, the loop over the blocks in IR
# ---------------------------------------------------------------------------------------------
def _decode32(kind, builder, blk):
    """(values w as <32 x float>) of the block at address blk."""
    if kind == "Q8_0":
        q = builder.sext(_load(builder, blk, 2, _vec(_I8, 32)), _vec(_I32, 32))
        return builder.fmul(_tofloat(builder, q), _splat(builder, _half(builder, blk, 0), 32))
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


def _make_row32(kind, size):
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


row_q8_0 = _make_row32("Q8_0", 34)
row_q4_0 = _make_row32("Q4_0", 18)
row_q4_1 = _make_row32("Q4_1", 20)
row_q5_0 = _make_row32("Q5_0", 22)
row_q5_1 = _make_row32("Q5_1", 24)


# ---------------------------------------------------------------------------------------------
# K-quants: one call per 256-value super-block. The caller unpacks the sub-block scales:
# A[i] (and B[i]) float32 at address pa (pb), i = index of the 32-run (Q4_K, Q5_K) or of the
# 16-run (Q6_K, Q3_K, Q2_K); then w = A[i] q - B[i].
# ---------------------------------------------------------------------------------------------
def _scales(builder, pa, i, per16):
    """<32 x float> of the scales of 32 consecutive values starting at 32-run i (per16: two
    16-runs, 2i and 2i+1) from the float32 array at address pa."""
    if not per16:
        return _splat(builder, _load(builder, pa, 4 * i, _F32, 4), 32)
    a = _load(builder, pa, 8 * i, _vec(_F32, 2), 4)
    return builder.shuffle_vector(a, a, _const(_I32, 32, [0] * 16 + [1] * 16))


def _make_superblock(kind):
    has_min = kind in ("Q4_K", "Q5_K", "Q2_K")

    @intrinsic
    def sbdot(typingctx, pw, px, pa, pb):
        r"""\sum_k w_k x_k over the 256 values of the super-block at byte address pw."""
        sig = types.float32(types.int64, types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            pw_, px_, pa_, pb_ = args
            acc = _const(_F32, 32, 0.0)
            for r in range(8):  # 32-runs of values
                if kind in ("Q4_K", "Q5_K"):
                    c, hi = divmod(r, 2)
                    q = _fields(builder, pw_, (16 if kind == "Q4_K" else 48) + 32 * c, 32,
                                4 * hi, 15)
                    if kind == "Q5_K":
                        h = _fields(builder, pw_, 16, 32, r, 1)
                        q = builder.or_(q, builder.shl(h, _const(_I32, 32, 4)))
                elif kind == "Q6_K":
                    c, k = divmod(r, 4)  # half c, group k: ql bytes [64c + 32 (k & 1)], nibble k >> 1
                    lo = _fields(builder, pw_, 64 * c + 32 * (k & 1), 32, 4 * (k >> 1), 15)
                    h = _fields(builder, pw_, 128 + 32 * c, 32, 2 * k, 3)
                    q = builder.sub(builder.or_(lo, builder.shl(h, _const(_I32, 32, 4))),
                                    _const(_I32, 32, 32))
                else:  # Q3_K, Q2_K: 2-bit fields, value 128c + 32g + l
                    c, g = divmod(r, 4)
                    q0 = 32 if kind == "Q3_K" else 16
                    q = _fields(builder, pw_, q0 + 32 * c, 32, 2 * g, 3)
                    if kind == "Q3_K":  # minus 4 where the hmask bit 4c + g is clear
                        h = _fields(builder, pw_, 0, 32, r, 1)
                        q = builder.sub(q, builder.shl(builder.xor(h, _const(_I32, 32, 1)),
                                                       _const(_I32, 32, 2)))
                x = _load(builder, px_, 128 * r, _vec(_F32, 32), 4)
                a = _scales(builder, pa_, r, kind not in ("Q4_K", "Q5_K"))
                if has_min:
                    w = _fma(builder, _tofloat(builder, q), a,
                             builder.fneg(_scales(builder, pb_, r, kind == "Q2_K")))
                else:
                    w = builder.fmul(_tofloat(builder, q), a)
                acc = _fma(builder, w, x, acc)
            return _reduce(builder, acc)

        return sig, codegen

    return sbdot


sb_q4_k = _make_superblock("Q4_K")
sb_q5_k = _make_superblock("Q5_K")
sb_q6_k = _make_superblock("Q6_K")
sb_q3_k = _make_superblock("Q3_K")
sb_q2_k = _make_superblock("Q2_K")
