r"""The half-precision KV cache as the fused decode steps read and write it.

A cache of NumPy ``float16`` arrays reaches the kernels as ``uint16`` views (Numba has no float16
on the CPU): :func:`kv_read` widens a half's bits to float32 (exact: every half is a float32),
:func:`kv_write` rounds a float32 to the nearest half, ties to even (IEEE ``fptrunc``, the
rounding of NumPy's ``astype(np.float16)``, so a row the kernels write holds the bits the per-op
path writes for the same value). Both are one LLVM conversion (``vcvtph2ps`` / ``vcvtps2ph`` where
the CPU has F16C), which the loop vectoriser widens; on a cache of the compute dtype both are the
identity, so one kernel source serves the float32, float64 and half caches.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)


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


def kv_read(x):
    """A cache entry as a number of the compute dtype: a half's bits widened, a float as it is."""
    return x


@overload(kv_read, inline="always")
def _kv_read(x):
    if x == types.uint16:
        return lambda x: _half_to_float(x)
    return lambda x: x


def kv_write(cache, x):
    """``x`` as an entry of ``cache`` (an array): rounded to a half's bits for a uint16 cache,
    as it is for a float one."""
    return x


@overload(kv_write, inline="always")
def _kv_write(cache, x):
    if cache.dtype == types.uint16:
        return lambda cache, x: _float_to_half(np.float32(x))
    return lambda cache, x: x
