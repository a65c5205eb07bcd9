"""CPU threading helpers of the ``numpy`` (and ``numba``) backends: row-parallel work on a thread
pool, OpenBLAS thread control, row-split GEMMs.

NumPy releases the GIL inside ufuncs, reductions and BLAS calls on large arrays, so chunks of a
row-wise op run truly in parallel on Python threads. On a small or busy machine that beats letting
OpenBLAS split every GEMM over its own threads: each split GEMM costs a synchronisation, and a
training step runs hundreds of them. The ops here therefore give whole row blocks to the threads
of :func:`parallel_rows`, each running single-threaded BLAS (:class:`single_threaded_blas`).

None of this is math: the equations are in :mod:`minillama.core.ops`, and the fast ops built on
these helpers (:mod:`.backend`) are held to them by parity tests.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np

#: below this many elements an op runs in the calling thread (dispatch costs ~20 us)
PARALLEL_MIN_ELEMENTS = 1 << 16
#: linear layers split their GEMMs over the threads of :func:`parallel_rows` (single-threaded
#: BLAS each) instead of leaving the threading to BLAS; see :func:`split_gemm`
THREADED_LINEAR = True
#: ... except products of fewer multiply-adds than this (M K N) or fewer rows than
#: :data:`SPLIT_GEMM_MIN_ROWS`, which run as one GEMM on OpenBLAS's own threads (decoding: a
#: row split would make every thread read the whole weight matrix). Every GEMM of a training
#: step is split: OpenBLAS's workers busy-wait ~2^28 cycles (~0.1 s) after each threaded GEMM,
#: and meanwhile take a core from the Numba kernels and row threads of the ops in between.
#: Measured on the 2-core machine (2026-11-23, same-process A/B, alternating steps):
#: the tiny training step 3-23 % faster with its small GEMMs split (the 2^27 threshold before
#: was measured with the peer's step running back to back, see scripts/bench_train.py --gap)
SPLIT_GEMM_MIN_MACS = 1 << 22
SPLIT_GEMM_MIN_ROWS = 64

_pool = None
_pool_lock = threading.Lock()
_team = threading.local()  # .size: the threads of a step run under :func:`team` in this thread


def num_threads() -> int:
    """Threads for the row-parallel parts of the NumPy ops: the size of the :func:`team` the
    calling thread runs in, else ``MINILLAMA_NUM_THREADS``, else ``OMP_NUM_THREADS``, else
    ``OPENBLAS_NUM_THREADS``, else the CPU count."""
    size = getattr(_team, "size", None)
    if size is not None:
        return size
    for var in ("MINILLAMA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def parallel_rows(fn, n_rows: int, n_elements: int, xp=np) -> None:
    """Call ``fn(lo, hi)`` on contiguous chunks covering rows [0, n_rows), in threads.

    Row-wise ops give bit-identical results however they are chunked. Non-NumPy arrays (``xp``
    not NumPy), one thread and small ops (``n_elements`` below :data:`PARALLEL_MIN_ELEMENTS`)
    run ``fn(0, n_rows)`` directly.
    """
    nt = min(num_threads(), n_rows)
    if xp is not np or nt <= 1 or n_elements < PARALLEL_MIN_ELEMENTS:
        fn(0, n_rows)
        return
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < nt - 1:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=nt - 1, thread_name_prefix="minillama-ops")
        pool = _pool
    step = -(-n_rows // nt)
    bounds = [(lo, min(lo + step, n_rows)) for lo in range(0, n_rows, step)]
    futures = [pool.submit(fn, lo, hi) for lo, hi in bounds[1:]]
    try:
        fn(*bounds[0])
    finally:
        for f in futures:
            f.result()


# ---------------------------------------------------------------------------------------------
# BLAS thread control (OpenBLAS as bundled with NumPy; a no-op anywhere else)
# ---------------------------------------------------------------------------------------------
_blas_api: Any = None
_blas_lib: Any = None

#: the (get, set) thread-count symbols of the OpenBLAS builds we know, and the prefix and suffix
#: of their other symbols (``cblas_sgemm`` is ``<prefix>cblas_sgemm<suffix>``)
_OPENBLAS_NAMES = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_", "scipy_", "64_"),
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads", "scipy_", ""),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_", "", "64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads", "", ""))


def openblas_library():
    """(ctypes library, symbol prefix, symbol suffix) of the OpenBLAS that NumPy loaded, found by
    its exported thread-control symbols; None if the BLAS is not OpenBLAS or cannot be found."""
    global _blas_lib
    if _blas_lib is not None:
        return _blas_lib or None
    _blas_lib = False
    try:
        import ctypes

        np.ones(2) @ np.ones(2)  # NumPy loads its BLAS lazily on some builds
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
        for path in paths:
            lib = ctypes.CDLL(path)
            for get_name, set_name, prefix, suffix in _OPENBLAS_NAMES:
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    _blas_lib = (lib, prefix, suffix)
                    return _blas_lib
    except (OSError, ValueError, AttributeError):  # no /proc, odd paths: leave BLAS alone
        pass
    return None


#: CBLAS constants (row-major order; no transpose / transpose)
CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112


def openblas_gemms():
    """(ilp64, {"s": cblas_sgemm, "d": cblas_dgemm} as ctypes functions) of the OpenBLAS that
    NumPy loaded (ilp64: its integers are 64-bit); None when it or the symbols are not found.
    The GEMMs that :mod:`.cblas` calls from Python and the Numba kernels call by address."""
    found = openblas_library()
    if found is None:
        return None
    import ctypes

    lib, prefix, suffix = found
    try:
        config = getattr(lib, f"{prefix}openblas_get_config{suffix}")
        config.restype = ctypes.c_char_p
        ilp64 = b"USE64BITINT" in (config() or b"")
        return ilp64, {t: getattr(lib, f"{prefix}cblas_{t}gemm{suffix}") for t in "sd"}
    except AttributeError:
        return None


def openblas_api():
    """(get, set) of the OpenBLAS that NumPy loaded (see :func:`openblas_library`); None if the
    BLAS is not OpenBLAS or cannot be found (then thread control is a no-op)."""
    global _blas_api
    if _blas_api is not None:
        return _blas_api or None
    _blas_api = False
    found = openblas_library()
    if found is not None:
        import ctypes

        lib, prefix, suffix = found
        getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")
        setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}")
        getter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
        _blas_api = (getter, setter)
    return _blas_api or None


class single_threaded_blas:  # used like a function: ``with single_threaded_blas():``
    """Run the block with OpenBLAS on one thread, then restore its thread count.

    Attention is a stack of small GEMMs (one per sequence and KV head); letting OpenBLAS split
    each of them over its threads costs a synchronisation per GEMM, which dominates when the
    cores are busy. The NumPy ops instead give whole sequences to the threads of
    :func:`parallel_rows`, each running single-threaded GEMMs."""

    def __enter__(self):
        api = openblas_api()
        self._restore = None
        if api is not None:
            n = api[0]()
            if n > 1:
                api[1](1)
                self._restore = n
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            openblas_api()[1](self._restore)
        return False


_teams = {"active": 0, "blas": None}  # teams running in any thread; OpenBLAS's count before
_teams_lock = threading.Lock()


@contextlib.contextmanager
def team(n: int):
    """Run the block's NumPy ops on ``n`` threads: the row threads of :func:`parallel_rows` (for
    the calling thread) and OpenBLAS's pool (one setting for the process: a team inside another
    in the same thread gives it back to the outer one's size on leaving, and the last team to
    leave in any thread to the count from before the first). The thread tuner of the decode
    steps (:mod:`minillama.backends.tuner`) sets it per step."""
    before = getattr(_team, "size", None)
    api = openblas_api()
    size = max(int(n), 1)
    with _teams_lock:
        if _teams["active"] == 0 and api is not None:
            _teams["blas"] = api[0]()
        _teams["active"] += 1
        if api is not None and api[0]() != size:
            api[1](size)
    _team.size = size
    try:
        yield
    finally:
        _team.size = before
        with _teams_lock:
            _teams["active"] -= 1
            back = before if before is not None else (
                _teams["blas"] if _teams["active"] == 0 else None)
            if api is not None and back is not None and api[0]() != back:
                api[1](back)


class _NoOp:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def blas_for_rows(n_rows: int):
    """:class:`single_threaded_blas` while :func:`parallel_rows` spreads ``n_rows`` over
    threads; a no-op context when it will not."""
    if n_rows > 1 and num_threads() > 1:
        return single_threaded_blas()
    return _NoOp()


def split_gemm(a, b, out) -> None:
    """out = a @ b (NumPy, 2-D) with the rows of ``a`` and ``out`` spread over the threads of
    :func:`parallel_rows`, single-threaded BLAS each; one plain GEMM (BLAS's own threads) when that
    cannot help or the product is below :data:`SPLIT_GEMM_MIN_MACS` or
    :data:`SPLIT_GEMM_MIN_ROWS`."""
    if (THREADED_LINEAR and a.shape[0] >= SPLIT_GEMM_MIN_ROWS and num_threads() > 1
            and a.shape[0] * a.shape[1] * b.shape[1] >= SPLIT_GEMM_MIN_MACS):
        def rows(lo, hi):
            np.matmul(a[lo:hi], b, out=out[lo:hi])

        with single_threaded_blas():
            parallel_rows(rows, a.shape[0], a.shape[0] * b.shape[1] * 8)
    else:
        np.matmul(a, b, out=out)
