r"""The half-precision KV cache as the fused decode steps read and write it.

A cache of NumPy ``float16`` arrays reaches the kernels as ``uint16`` views (Numba has no float16
on the CPU): :func:`kv_read` widens a half's bits to float32 (exact: every half is a float32),
:func:`kv_write` rounds a float32 to the nearest half, ties to even (IEEE ``fptrunc``, the
rounding of NumPy's ``astype(np.float16)``, so a row the kernels write holds the bits the per-op
path writes for the same value). Both are one LLVM conversion (``vcvtph2ps`` / ``vcvtps2ph`` where
the CPU has F16C), which the loop vectoriser widens; on a cache of the compute dtype both are the
identity, so one kernel source serves the float32, float64 and half caches.

Where the target has no conversion instructions (x86 without F16C; :data:`NATIVE` False) LLVM
would call the runtime's ``__extendhfsf2`` / ``__truncsfhf2``, which the JIT cannot always find:
there the same conversions run as integer operations on the bits (:func:`half_to_float_bits`,
:func:`float_to_half_bits`), equal bit for bit.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)


def _native() -> bool:
    """Whether the target Numba compiles for converts halves in instructions: x86 with F16C
    (:func:`.._cache.target_features`), 64-bit ARM always."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    return "+f16c" in _cache.target_features()


#: the conversions by instructions (else by integer operations on the bits)
NATIVE = _native()


@intrinsic
def _half_to_float(typingctx, h):
    """The half whose bits are ``h`` (uint16) as a float32."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float_to_half(typingctx, x):
    """The bits (uint16) of the half nearest to the float32 ``x`` (ties to even; beyond the
    half range: inf)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _bits_to_float(typingctx, b):
    """The float32 whose bits are the uint32 ``b``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _float_to_bits(typingctx, x):
    """The bits (uint32) of the float32 ``x``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def half_to_float_bits(h):  # pragma: no cover - compiled
    """:func:`_half_to_float` by integer operations: sign, exponent and fraction moved into
    float32's fields (exponent bias 15 -> 127); a subnormal half m 2^-24 as that product (exact);
    inf and NaN keep an all-ones exponent."""
    u = np.uint32(h)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    e = (u >> np.uint32(10)) & np.uint32(0x1F)
    m = u & np.uint32(0x3FF)
    if e == 0:
        f = np.float32(m) * np.float32(2.0 ** -24)
        return -f if sign else f
    if e == 31:
        return _bits_to_float(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return _bits_to_float(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@njit(cache=True, nogil=True, inline="always")
def float_to_half_bits(x):  # pragma: no cover - compiled
    """:func:`_float_to_half` by integer operations, rounding to nearest, ties to even: the
    23-bit fraction cut to 10 bits with the carry running into the exponent (up to inf); below
    2^-14 the subnormal half round(|x| 2^24); inf stays inf, NaN becomes a quiet NaN."""
    u = _float_to_bits(np.float32(x))
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf, NaN
        return sign | np.uint16(0x7C00 if a == np.uint32(0x7F800000) else 0x7E00)
    if a >= np.uint32(0x477FF000):  # from 65520 on: rounds to inf
        return sign | np.uint16(0x7C00)
    if a < np.uint32(0x38800000):  # below 2^-14: a subnormal half (or 0), 2^24 |x| rounded
        return sign | np.uint16(np.rint(_bits_to_float(a) * np.float32(2.0 ** 24)))
    r = ((a >> np.uint32(23)) - np.uint32(112)) << np.uint32(10) | ((a >> np.uint32(13))
                                                                    & np.uint32(0x3FF))
    rest = a & np.uint32(0x1FFF)
    if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and r & np.uint32(1)):
        r += np.uint32(1)
    return sign | np.uint16(r)


def kv_read(x):
    """A cache entry as a number of the compute dtype: a half's bits widened, a float as it is."""
    return x


@overload(kv_read, inline="always")
def _kv_read(x):
    if x == types.uint16:
        return (lambda x: _half_to_float(x)) if NATIVE else (lambda x: half_to_float_bits(x))
    return lambda x: x


def kv_write(cache, x):
    """``x`` as an entry of ``cache`` (an array): rounded to a half's bits for a uint16 cache,
    as it is for a float one."""
    return x


@overload(kv_write, inline="always")
def _kv_write(cache, x):
    if cache.dtype == types.uint16:
        if NATIVE:
            return lambda cache, x: _float_to_half(np.float32(x))
        return lambda cache, x: float_to_half_bits(x)
    return lambda cache, x: x
