r"""OpenBLAS's GEMM called from Numba kernels, so that a training step's matrix products run on
Numba's threads.

Why: on a small machine a training step of a small model is hundreds of GEMMs of a millisecond
or less. Spreading each over Python threads (:func:`..numpy.threads.split_gemm`) costs 0.1-0.3 ms
per call to wake the pool on the project's 2-core VM; OpenBLAS's own threads wake faster but
busy-wait ~0.1 s after each GEMM and take a core from the Numba kernels in between. Here a
product's rows are split over a Numba ``prange`` (OpenMP threads, a few microseconds per parallel
region) and each thread calls OpenBLAS's ``cblas_?gemm`` on its rows with OpenBLAS set to one
thread: the same BLAS kernels, the same threads as every other Numba kernel of the step.

The ``cblas_sgemm``/``cblas_dgemm`` of the OpenBLAS that NumPy loaded are found by name
(:func:`..numpy.threads.openblas_gemms`) and called through their address, which the kernels
take as an ordinary integer argument (so they stay cacheable). Without such an OpenBLAS
(another BLAS, no ``/proc``) :func:`available` is False and the backend keeps its NumPy path.

The product is the usual row-major one:

    C \leftarrow \alpha\, \mathrm{op}(A)\, \mathrm{op}(B) + \beta C,\quad
    \mathrm{op}(X) = X \text{ or } X^T,

with A: (M, K) after op, B: (K, N), C: (M, N). Imported only by the numba backend.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ...numpy import threads as cpu_threads
from ...numpy.cblas import operand
from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)

_opts = dict(cache=True, nogil=True)
_ROW_MAJOR, _NO_TRANS, _TRANS = (cpu_threads.CBLAS_ROW_MAJOR, cpu_threads.CBLAS_NO_TRANS,
                                 cpu_threads.CBLAS_TRANS)
#: a product is split over the threads only with at least this many multiply-adds and
#: :data:`SPLIT_MIN_ROWS` rows per thread (below, one call on the calling thread)
SPLIT_MIN_MACS = 1 << 20
SPLIT_MIN_ROWS = 16

_found = None


def _symbols():
    """(sgemm address, dgemm address, ilp64) of NumPy's OpenBLAS, or None."""
    global _found
    if _found is None:
        _found = False
        found = cpu_threads.openblas_gemms()
        if found is not None and cpu_threads.openblas_api() is not None:
            ilp64, gemms = found
            addr = [ctypes.cast(gemms[t], ctypes.c_void_p).value for t in "sd"]
            if all(addr):
                _found = (addr[0], addr[1], ilp64)
    return _found or None


def available() -> bool:
    """True when NumPy's BLAS is an OpenBLAS whose CBLAS GEMMs and thread control were found."""
    return _symbols() is not None


def gemm_address(dtype) -> tuple[int, bool]:
    """(address of cblas_sgemm or cblas_dgemm for ``dtype``, whether its integers are 64-bit)."""
    s, d, ilp64 = _symbols()
    return (s if np.dtype(dtype) == np.float32 else d), ilp64


def _gemm_intrinsic(int_bits: int):
    @intrinsic
    def call(typingctx, fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        sig = types.void(fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

        def codegen(context, builder, signature, args):
            i32, ii = ir.IntType(32), ir.IntType(int_bits)
            ft = context.get_value_type(signature.args[6])
            ptr = ft.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, ii, ii, ii, ft, ptr, ii, ptr,
                                                   ii, ft, ptr, ii])

            def size(v):
                return builder.trunc(v, ii) if int_bits < 64 else v

            def trans(v):
                return builder.select(v, ir.Constant(i32, _TRANS), ir.Constant(i32, _NO_TRANS))

            fn_, ta_, tb_, m_, n_, k_, al, a_, lda_, b_, ldb_, be, c_, ldc_ = args
            builder.call(builder.inttoptr(fn_, fnty.as_pointer()), [
                ir.Constant(i32, _ROW_MAJOR), trans(ta_), trans(tb_), size(m_), size(n_),
                size(k_), al, builder.inttoptr(a_, ptr), size(lda_), builder.inttoptr(b_, ptr),
                size(ldb_), be, builder.inttoptr(c_, ptr), size(ldc_)])
            return context.get_dummy_value()

        return sig, codegen

    return call


_gemm64 = _gemm_intrinsic(64)
_gemm32 = _gemm_intrinsic(32)


@njit(inline="always", **_opts)
def gemm(fn, ilp64, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc):
    r"""C \leftarrow \alpha\, \mathrm{op}(A)\, \mathrm{op}(B) + \beta C by the CBLAS GEMM at address
    ``fn`` (row-major; ``ta``/``tb``: transpose A/B), on the calling thread. ``pa, pb, pc`` are
    the addresses of the first elements (``arr.ctypes.data`` plus a byte offset); m, n, k, lda,
    ldb, ldc as in CBLAS; alpha and beta in the dtype of the matrices. Inlined into the Numba
    kernels that call it; :func:`matmul` calls it from Python for an unsplit product."""
    m, n, k = np.int64(m), np.int64(n), np.int64(k)
    lda, ldb, ldc = np.int64(lda), np.int64(ldb), np.int64(ldc)
    pa, pb, pc = np.int64(pa), np.int64(pb), np.int64(pc)
    if ilp64:
        _gemm64(fn, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc)
    else:
        _gemm32(fn, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc)


@njit(parallel=True, **_opts)
def _gemm_rows(fn, ilp64, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc, isz, parts):
    step = (m + parts - 1) // parts
    for t in prange(parts):
        lo = t * step
        hi = min(m, lo + step)
        if hi > lo:
            offa = lo if ta else lo * lda  # row lo of op(A): column lo of a transposed A
            gemm(fn, ilp64, ta, tb, hi - lo, n, k, alpha, pa + offa * isz, lda, pb, ldb, beta,
                 pc + lo * ldc * isz, ldc)


def matmul(a, b, out, threads: int, beta: float = 0.0) -> bool:
    r"""out \leftarrow a b + \beta\, out for 2-D float32/float64 arrays a: (M, K), b: (K, N),
    out: (M, N) (rows contiguous), each operand row-major or the transpose of a row-major array;
    the rows of ``out`` are split over ``threads`` Numba threads, OpenBLAS on one thread in
    each (products under :data:`SPLIT_MIN_MACS` run on the calling thread). Returns False (and
    does nothing) when the arrays do not fit, no OpenBLAS GEMM was found, or a large product has
    too few rows to split (fewer than 2 :data:`SPLIT_MIN_ROWS`): the caller then uses NumPy."""
    dt = out.dtype
    if (dt not in (np.float32, np.float64) or a.dtype != dt or b.dtype != dt or a.ndim != 2
            or b.ndim != 2 or out.ndim != 2 or not available()):
        return False
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or out.shape != (M, N) or 0 in (M, N, K) or not out.flags.writeable:
        return False
    isz = dt.itemsize
    oa, ob = operand(a), operand(b)
    if oa is None or ob is None or out.strides[1] != isz and N > 1:
        return False
    ldc = out.strides[0] // isz
    if out.strides[0] % isz or ldc < N:
        return False
    parts = 1
    if M * N * K >= SPLIT_MIN_MACS and threads > 1:
        if M < 2 * SPLIT_MIN_ROWS:
            return False  # a few rows of a large product (prefill): OpenBLAS's threads split N
        parts = min(threads, M // SPLIT_MIN_ROWS)
    fn, ilp64 = gemm_address(dt)
    alpha, beta_ = dt.type(1), dt.type(beta)
    with cpu_threads.single_threaded_blas():
        if parts > 1:
            _gemm_rows(fn, ilp64, oa[0], ob[0], M, N, K, alpha, a.ctypes.data, oa[1],
                       b.ctypes.data, ob[1], beta_, out.ctypes.data, ldc, isz, parts)
        else:
            gemm(fn, ilp64, oa[0], ob[0], M, N, K, alpha, a.ctypes.data, oa[1], b.ctypes.data,
                 ob[1], beta_, out.ctypes.data, ldc)
    return True
