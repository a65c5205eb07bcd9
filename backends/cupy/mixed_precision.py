r"""Mixed-precision training: the linear layers' products in bfloat16 or TF32 on the tensor cores,
with float32 accumulation and float32 master weights.

``minillama train --precision {fp32,tf32,bf16}`` (CuPy backend only):

* ``fp32`` (default): every op in float32 (the flash attention in 3xTF32, float32 accuracy).
* ``tf32``: the three GEMMs of every linear layer (y = x W^T, dx = dy W, dW = dy^T x) run with
  cuBLAS's ``CUBLAS_COMPUTE_32F_FAST_TF32`` (operands rounded to TF32, 10 mantissa bits; float32
  accumulation and output), and attention uses the single-TF32 flash kernels.
* ``bf16``: the GEMM operands are rounded to bfloat16 (7 stored mantissa bits, round to nearest
  even) and stored so (x and W are kept in bf16 for the backward: half the activation memory of the
  linear layers), multiplied on the bf16 tensor cores with float32 accumulation and float32
  output (``CUDA_R_16BF`` operands, ``CUBLAS_COMPUTE_32F``); attention as in ``tf32``.

In both, the parameters, their gradients, the AdamW moments, RMSNorm, RoPE, SwiGLU, the softmax
and the cross-entropy stay float32: each product is

.. math::

    y_{mn} = \sum_k r(x_{mk})\, r(W_{nk}) \quad \text{(float32 sums)}, \qquad
    dx = r(dy)\, r(W), \qquad dW = r(dy)^T r(x),

with r the rounding to bf16 or TF32. A product of two bf16 numbers is exact in float32, so the
only differences from a float32 product of the rounded operands are the summation order: the
NumPy emulation (``emulate=True``, any backend) computes exactly these equations and is the
reference the CuPy path is checked against (tests/backends/cupy/test_mixed_precision.py on the CPU,
tests/backends/cupy/test_cuda_emulated.py for the CuPy code path with the conversion kernel
emulated, tests/backends/cupy/test_backend.py on a GPU). bf16 keeps float32's exponent range,
so no loss scaling is needed.
"""

from __future__ import annotations

import copy

import numpy as np

from minillama.core.errors import MinillamaError

from ..reference import (
    composed_linear_cross_entropy_backward,
    composed_linear_cross_entropy_forward,
)

#: the training precisions, the default first
PRECISIONS = ("fp32", "tf32", "bf16")

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1


def check_precision(precision, backend_name: str, dtype: str = "float32") -> str:
    """``precision`` if it is one of :data:`PRECISIONS` and can run on ``backend_name`` with
    ``dtype``; else one :class:`MinillamaError` line saying why."""
    if precision not in PRECISIONS:
        raise MinillamaError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{precision!r}")
    if precision != "fp32":
        if backend_name != "cupy":
            raise MinillamaError(f"precision {precision} runs the matrix products on NVIDIA "
                                 f"tensor cores: it needs --backend cupy (the backend is "
                                 f"{backend_name}); use --precision fp32 on the CPU")
        if dtype != "float32":
            raise MinillamaError(f"precision {precision} keeps float32 master weights: it needs "
                                 f"--dtype float32, got {dtype}")
    return precision


# ---------------------------------------------------------------------------------------------
# rounding (works on NumPy and CuPy arrays alike: bit operations on the float32 pattern)
# ---------------------------------------------------------------------------------------------
def bf16_bits(x):
    r"""The bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest, ties to even:
    u \mapsto (u + \mathtt{0x7fff} + ((u \gg 16) \wedge 1)) \gg 16 on the float32 bits u;
    NaN stays a (quiet) NaN of the same sign, overflow rounds to infinity."""
    xp = _xp(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, ((u >> 16) | xp.uint32(0x40)).astype(xp.uint16), r)


def bf16_to_f32(bits):
    """float32 values of bfloat16 bit patterns (exact)."""
    xp = _xp(bits)
    return (xp.asarray(bits, dtype=xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def round_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even), as float32."""
    return bf16_to_f32(bf16_bits(x))


def round_tf32(x):
    """x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero: PTX
    ``cvt.rna.tf32.f32``), as float32. cuBLAS does not document how its TF32 mode rounds, so the
    emulation of ``tf32`` is exact only up to that choice."""
    xp = _xp(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    finite = (u & xp.uint32(0x7F800000)) != xp.uint32(0x7F800000)
    r = xp.where(finite, (u + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000), u)
    return r.view(xp.float32)


ROUNDING = {"bf16": round_bf16, "tf32": round_tf32}


def _xp(a):
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy
    return np


# ---------------------------------------------------------------------------------------------
# cuBLAS in column-major terms
# ---------------------------------------------------------------------------------------------
def gemm_plan(kind: str, M: int, N: int, K: int) -> dict:
    """The column-major cuBLAS call for one product of a linear layer y = x W^T, with row-major
    x (M, K), W (N, K), dy (M, N) (a row-major (r, c) matrix is a column-major (c, r) one):

    * ``fwd``: y (M, N): C = y^T (N, M) = W x^T, so A = W (op T), B = x (op N);
    * ``dx``: dx = dy W (M, K): C = dx^T (K, M) = W^T dy^T, A = W (op N), B = dy (op N);
    * ``dw``: dW = dy^T x (N, K): C = dW^T (K, N) = x^T dy, A = x (op N), B = dy (op T).

    Returns the operand names ``a``, ``b``, the ops, m, n, k and the leading dimensions."""
    T, Nn = CUBLAS_OP_T, CUBLAS_OP_N
    if kind == "fwd":
        return dict(a="w", b="x", transa=T, transb=Nn, m=N, n=M, k=K, lda=K, ldb=K, ldc=N,
                    out=(M, N))
    if kind == "dx":
        return dict(a="w", b="dy", transa=Nn, transb=Nn, m=K, n=M, k=N, lda=K, ldb=N, ldc=K,
                    out=(M, K))
    if kind == "dw":
        return dict(a="x", b="dy", transa=Nn, transb=T, m=K, n=N, k=M, lda=K, ldb=N, ldc=K,
                    out=(N, K))
    raise ValueError(kind)


def _cublas_gemm(plan: dict, A, B, C, dtype_code: int, compute: int) -> None:
    """C = op(A) op(B) through ``cublasGemmEx`` on the current stream (float32 alpha = 1,
    beta = 0, host pointers); A and B hold ``dtype_code`` data, C float32."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    one = np.ones(1, dtype=np.float32)
    zero = np.zeros(1, dtype=np.float32)
    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)  # alpha, beta are host pointers here
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(handle, plan["transa"], plan["transb"], plan["m"], plan["n"], plan["k"],
                      one.ctypes.data, A.data.ptr, dtype_code, plan["lda"], B.data.ptr,
                      dtype_code, plan["ldb"], zero.ctypes.data, C.data.ptr, CUDA_R_32F,
                      plan["ldc"], compute, CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


# ---------------------------------------------------------------------------------------------
# the backend wrapper
# ---------------------------------------------------------------------------------------------
class _MPCtx(tuple):
    """The ctx of a mixed-precision product: ("emulated", base ctx) or ("cublas", x operand,
    W operand, x shape)."""


class MixedPrecisionBackend:
    """``base`` (a backend) with its linear layers' products in ``precision`` ("tf32" or
    "bf16"); every other op is the base backend's (a copy of it whose attention, where it has a
    precision setting, uses single TF32).

    On the CuPy backend the products run through cuBLAS (:func:`_cublas_gemm`) with the operands
    converted by the ``to_bf16`` kernel (bf16) or passed as float32 (TF32). ``emulate=True``
    (forced on any other backend) computes the same equations by rounding the operands in NumPy
    and multiplying in float32: the CPU reference of the GPU path.
    """

    def __init__(self, base, precision: str, emulate: bool = False):
        if precision not in ROUNDING:
            raise MinillamaError(f"MixedPrecisionBackend: precision must be tf32 or bf16, got "
                                 f"{precision!r}")
        inner = copy.copy(base)
        if inner.attention_precision is not None:  # a setting of its attention (cupy)
            inner.attention_precision = "tf32"
        self._inner = inner
        self.precision = precision
        self.emulate = bool(emulate) or base.name != "cupy"

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)

    def __repr__(self) -> str:
        how = "emulated" if self.emulate else "tensor cores"
        return f"<{self._inner.name} backend, {self.precision} matmuls ({how})>"

    # --- linear --------------------------------------------------------------------------------
    def linear_forward(self, x, w):
        r"""y = r(x) r(W)^T with float32 sums (r: rounding to bf16 / TF32). x: (..., in);
        w: (out, in) float32 -> (..., out) float32. Other dtypes: the base backend's product."""
        if x.dtype != np.float32 or w.dtype != np.float32:
            return self._inner.linear_forward(x, w)
        if self.emulate:
            r = ROUNDING[self.precision]
            y, ctx = self._inner.linear_forward(r(x), r(w))
            return y, _MPCtx(("emulated", ctx))
        return self._cublas_forward(x, w)

    def linear_backward(self, dy, ctx):
        r"""dx = r(dy) r(W), dW = r(dy)^T r(x) (float32 sums). dy: (..., out). Returns
        (dx: (..., in), dW: (out, in)), float32."""
        if not isinstance(ctx, _MPCtx):
            return self._inner.linear_backward(dy, ctx)
        if ctx[0] == "emulated":
            return self._inner.linear_backward(ROUNDING[self.precision](dy), ctx[1])
        return self._cublas_backward(dy, ctx)

    # the loss head: the head's product in this precision too, then the base cross-entropy
    linear_cross_entropy_forward = composed_linear_cross_entropy_forward
    linear_cross_entropy_backward = composed_linear_cross_entropy_backward

    # --- the CuPy path -------------------------------------------------------------------------
    def _operand(self, a):
        """The GEMM operand of float32 ``a`` (2-D, C-contiguous): its bf16 bits (uint16) from the
        ``to_bf16`` kernel, or ``a`` itself for TF32."""
        xp = self._inner.xp
        a = xp.ascontiguousarray(a)
        if self.precision == "tf32":
            return a
        from . import build as cb

        out = xp.empty(a.shape, dtype=xp.uint16)
        n = a.size
        if n:
            grid, block = cb.elementwise_launch(n)
            cb.get_kernel("bf16", "to_bf16", np.float32)(grid, block, (a, out, np.int64(n)))
        return out

    def _gemm(self, kind, M, N, K, ops: dict):
        xp = self._inner.xp
        plan = gemm_plan(kind, M, N, K)
        out = xp.empty(plan["out"], dtype=xp.float32)
        if out.size:
            if plan["k"] == 0:  # an empty sum
                out[...] = 0
            else:
                code = CUDA_R_16BF if self.precision == "bf16" else CUDA_R_32F
                compute = CUBLAS_COMPUTE_32F if self.precision == "bf16" \
                    else CUBLAS_COMPUTE_32F_FAST_TF32
                _cublas_gemm(plan, ops[plan["a"]], ops[plan["b"]], out, code, compute)
        return out

    def _cublas_forward(self, x, w):
        N, K = w.shape
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        xo, wo = self._operand(x2), self._operand(w)
        y = self._gemm("fwd", M, N, K, {"x": xo, "w": wo})
        return y.reshape(tuple(x.shape[:-1]) + (N,)), _MPCtx(("cublas", xo, wo, tuple(x.shape)))

    def _cublas_backward(self, dy, ctx):
        _, xo, wo, xshape = ctx
        N, K = wo.shape
        dyo = self._operand(dy.reshape(-1, N))
        M = dyo.shape[0]
        dx = self._gemm("dx", M, N, K, {"w": wo, "dy": dyo})
        dw = self._gemm("dw", M, N, K, {"x": xo, "dy": dyo})
        return dx.reshape(xshape), dw


def with_precision(backend, precision: str, emulate: bool = False):
    """``backend`` itself for ``fp32``, else a :class:`MixedPrecisionBackend` around it."""
    if precision == "fp32":
        return backend
    return MixedPrecisionBackend(backend, precision, emulate=emulate)
