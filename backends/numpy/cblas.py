r"""C \leftarrow A B + C for the ``numpy`` backend: OpenBLAS's ``cblas_?gemm`` with \beta = 1
through ctypes, the rows of C split over the threads of :func:`.threads.parallel_rows`.

NumPy's ``matmul`` always overwrites its output, so adding a product to an existing matrix costs
a temporary and one more pass over both (``out += a @ b``). A LoRA layer adds the low-rank term
s (x A^T) B^T to the frozen product x W^T, and its backward adds (\bar{u} A) to \bar{y} W: with
rank r the GEMM itself is cheap and those passes over (N, out) are most of its cost. Calling the
CBLAS GEMM with \beta = 1 accumulates in the one pass the product needs. Without an OpenBLAS whose
symbols can be found (:func:`.threads.openblas_gemms`) :func:`gemm_acc` falls back to NumPy.

    out \leftarrow a\, b + out,\quad a: (M, K),\ b: (K, N),\ out: (M, N)
"""

from __future__ import annotations

import ctypes

import numpy as np

from .threads import CBLAS_NO_TRANS as _NO_TRANS
from .threads import CBLAS_ROW_MAJOR as _ROW_MAJOR
from .threads import CBLAS_TRANS as _TRANS
from .threads import num_threads, openblas_gemms, parallel_rows, single_threaded_blas

#: products with fewer multiply-adds than this run on the calling thread
SPLIT_MIN_MACS = 1 << 22
SPLIT_MIN_ROWS = 64

_fns = None


def _functions():
    """{float32: cblas_sgemm, float64: cblas_dgemm} as ctypes functions, or {} when not found."""
    global _fns
    if _fns is not None:
        return _fns
    _fns = {}
    found = openblas_gemms()
    if found is None:
        return _fns
    ilp64, gemms = found
    ii = ctypes.c_int64 if ilp64 else ctypes.c_int
    for dt, letter, ft in ((np.float32, "s", ctypes.c_float), (np.float64, "d", ctypes.c_double)):
        fn = gemms[letter]
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ii, ii, ii, ft,
                       ctypes.c_void_p, ii, ctypes.c_void_p, ii, ft, ctypes.c_void_p, ii]
        _fns[np.dtype(dt)] = fn
    return _fns


def operand(x):
    """(transposed?, leading dimension) of a 2-D operand for row-major CBLAS, or None when its
    strides fit neither a row-major matrix nor the transpose of one."""
    isz = x.itemsize
    r, c = x.shape
    s0, s1 = x.strides
    if (s1 == isz or c == 1) and s0 % isz == 0 and s0 // isz >= max(c, 1):
        return False, s0 // isz
    if (s0 == isz or r == 1) and s1 % isz == 0 and s1 // isz >= max(r, 1):
        return True, s1 // isz
    return None


def _cblas_acc(a, b, out, split: bool) -> bool:
    """out += a b by one or more CBLAS calls with beta 1; False when the arrays do not fit."""
    dt = out.dtype
    fn = _functions().get(dt)
    if fn is None or a.dtype != dt or b.dtype != dt or not out.flags.writeable:
        return False
    M, K = a.shape
    N = b.shape[1]
    oa, ob = operand(a), operand(b)
    isz = dt.itemsize
    if (oa is None or ob is None or (out.strides[1] != isz and N > 1)
            or out.strides[0] % isz or out.strides[0] // isz < N):
        return False
    ldc = out.strides[0] // isz
    pa, pb, pc = a.ctypes.data, b.ctypes.data, out.ctypes.data
    ta = _TRANS if oa[0] else _NO_TRANS
    tb = _TRANS if ob[0] else _NO_TRANS

    def rows(lo, hi):
        offa = lo if oa[0] else lo * oa[1]  # row lo of op(A): column lo of a transposed A
        fn(_ROW_MAJOR, ta, tb, hi - lo, N, K, 1.0, pa + offa * isz, oa[1], pb, ob[1], 1.0,
           pc + lo * ldc * isz, ldc)

    with single_threaded_blas():  # never OpenBLAS's own threads (they spin after each call)
        if split and M >= SPLIT_MIN_ROWS and num_threads() > 1 and M * N * K >= SPLIT_MIN_MACS:
            parallel_rows(rows, M, M * N * 8)
        else:
            rows(0, M)
    return True


def gemm_acc(a, b, out, split: bool = True) -> None:
    """out += a @ b for 2-D NumPy arrays (a: (M, K), b: (K, N), out: (M, N)): one pass over
    ``out`` by CBLAS with beta 1 where it fits, else a NumPy product and an add. ``split``: a
    large product's rows may go to the row threads (False: the calling thread only, e.g. inside
    one of those threads)."""
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    if a.shape[1] == 0 or _cblas_acc(a, b, out, split):
        return
    out += a @ b
