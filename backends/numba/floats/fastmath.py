r"""The shared ground of the ``numba`` backend's kernels: the fast-math flags, the jit options,
and the fast float32 e^x and row maximum of the softmax loops.

Importing this module (or any kernel module) imports Numba but compiles nothing: every kernel is
a lazily compiled ``@njit`` dispatcher (one specialisation per dtype and array layout, compiled
on its first call and cached on disk next to its file, or in Numba's user cache directory when
that is read-only).

Fast-math: :data:`FASTMATH` allows reassociation, contraction into FMAs, reciprocal
multiplication, approximate functions and ignoring the sign of zero, but NOT ``nnan``/``ninf``:
the online softmax starts every row at a running maximum of :math:`-\infty` and relies on
:math:`e^{-\infty - m} = 0`, so infinities and NaNs must keep their IEEE meaning.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)

#: fast-math flags that keep inf/nan meaningful (no 'nnan', no 'ninf')
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: the options of every kernel; error_model="numpy": IEEE division (x/0 = inf, no Python
#: exception check in the loops)
JIT_OPTS = dict(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
#: the fast-math flags of the operations that the decode steps and the prompt rows share (RoPE's
#: rotation, RMSNorm, SiLU, the softmax and the join of attention's spans): no reassociation,
#: fused multiply-adds, reciprocals or approximate functions, so that each runs the operations
#: written, each rounded, in their order, whatever code it is compiled into (a loop the
#: compiler widens or not, a scalar step)
IN_ORDER = {"nnan", "ninf", "nsz"}


# ---------------------------------------------------------------------------------------------
# e^x for the softmax loops
# ---------------------------------------------------------------------------------------------
@intrinsic
def _pow2_biased(typingctx, k):
    """2^{k - 127} as a float32 for an int32 biased exponent 1 <= k <= 254: the bits k << 23
    (shift and reinterpretation in 32 bits, so a vectorised loop stays in 8-wide int32 lanes;
    Numba's own integer arithmetic would widen to int64)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        bits = builder.shl(args[0], ir.Constant(ir.IntType(32), 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


@intrinsic
def _unbias_float32(typingctx, k):
    """k - 127 as a float32 for an int32 k, subtracted in 32-bit integers (exact; done in
    floats, fast-math reassociation could fold it into the reduction r = x - n ln 2 and lose
    its precision; Numba's own integer arithmetic would widen to int64)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        n = builder.sub(args[0], ir.Constant(ir.IntType(32), 127))
        return builder.sitofp(n, ir.FloatType())

    return sig, codegen


#: :func:`fexp`'s largest relative error on -86 <= x <= 0 for the CPU the kernels compile for
ERROR = 3.6e-7 if "+fma" in _cache.target_features() else 5e-6


def fexp(x):
    r"""e^x. float64: ``math.exp``. float32: a branch-free version the loop vectoriser can widen
    (libm's expf is a scalar call): e^x = 2^n e^r with n = \lfloor x \log_2 e + 1/2 \rfloor and
    r = x - n \ln 2 (ln 2 split in two for an exact product), e^r by a degree-7 polynomial on
    |r| <= ln2/2 (Cephes' coefficients), 2^n assembled in the exponent bits. Relative error
    < 3 ulp (3.6e-7) for -87 <= x <= 88 where the CPU has FMA (:data:`ERROR`); compiled for one
    without, the fast-math code LLVM makes loses more, growing with |x| (4.1e-6 measured at
    x = -72 for an SSE4.2 target: the softmax's small terms); 0 below (including -inf), NaN for
    NaN; the callers pass x <= 0 (up to rounding) or NaN."""
    return math.exp(x)


@overload(fexp, jit_options={"fastmath": FASTMATH})
def _fexp_overload(x):
    if x == types.float32:
        def impl(x):
            lo = np.float32(-87.0)
            xc = min(max(x, lo), np.float32(88.0))
            # k = n + 127 with n = floor(x log2(e) + 1/2): the argument is > 0 after the
            # clamp, so truncation is the floor (float -> int conversions vectorise)
            k = np.int32(xc * np.float32(1.4426950408889634) + np.float32(127.5))
            n = _unbias_float32(k)
            r = xc - n * np.float32(0.693359375)
            r = r - n * np.float32(-2.12194440e-4)
            y = np.float32(1.9875691500e-4)
            y = y * r + np.float32(1.3981999507e-3)
            y = y * r + np.float32(8.3334519073e-3)
            y = y * r + np.float32(4.1665795894e-2)
            y = y * r + np.float32(1.6666665459e-1)
            y = y * r + np.float32(5.0000001201e-1)
            y = y * r * r + r + np.float32(1.0)
            e = y * _pow2_biased(k)  # 2^n from its exponent bits
            e = e if x >= lo else np.float32(0.0)  # underflow, -inf
            return e if x == x else x  # NaN stays NaN
        return impl
    return lambda x: math.exp(x)


@njit(**JIT_OPTS)
def rowmax(z, n):
    # max of z[0:n], n >= 1; eight running maxima so the loop vectorises (a plain max
    # reduction does not without 'nnan'). NaN inputs are skipped here but still poison the
    # softmax sums that follow, as in the reference.
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = z[0]
    j = 0
    while j + 8 <= n:
        x0 = z[j]
        x1 = z[j + 1]
        x2 = z[j + 2]
        x3 = z[j + 3]
        x4 = z[j + 4]
        x5 = z[j + 5]
        x6 = z[j + 6]
        x7 = z[j + 7]
        m0 = x0 if x0 > m0 else m0
        m1 = x1 if x1 > m1 else m1
        m2 = x2 if x2 > m2 else m2
        m3 = x3 if x3 > m3 else m3
        m4 = x4 if x4 > m4 else m4
        m5 = x5 if x5 > m5 else m5
        m6 = x6 if x6 > m6 else m6
        m7 = x7 if x7 > m7 else m7
        j += 8
    while j < n:
        x0 = z[j]
        m0 = x0 if x0 > m0 else m0
        j += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    return m4 if m4 > m0 else m0
