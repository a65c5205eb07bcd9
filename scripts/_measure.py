"""What the benchmark scripts share: the thread counts pinned before NumPy loads, the model shapes
they time, the clocks and timing loops, and the machine's peaks a figure is set against (the
float32 matmul rate, the copy bandwidth, the most bytes allocated at once).

Thread pools size themselves when their library is first imported, so :func:`pin_threads` must run
before ``import numpy``: this module imports NumPy only inside the functions that need it. Model
shapes come from :data:`minillama.core.config.SHAPES`. The scripts run from the repository's root
as ``python -m scripts.NAME`` and import this module as ``scripts._measure``.
"""

from __future__ import annotations

import os
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS", "MINILLAMA_NUM_THREADS")
#: the repository's root (where ``python -m scripts.NAME`` runs; bench_serve.py puts it on its
#: server's PYTHONPATH)
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
#: ``--clock`` -> the clock: wall time, or this process's CPU time (steadier on a shared machine
#: with one thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


# ---------------------------------------------------------------------------------------------
# threads and shapes
# ---------------------------------------------------------------------------------------------
def pin_threads(n: int) -> None:
    """Set every thread-count variable to ``n`` (before NumPy is imported)."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)


def model_shape(name: str, **overrides) -> dict:
    """A copy of the named model shape of :data:`minillama.core.config.SHAPES`, with overrides."""
    from minillama.core.config import SHAPES

    return {**SHAPES[name], **overrides}


def train_configs() -> dict:
    """The training-step benchmark configs: name -> (model shape, B, T), shared by
    scripts/bench_train.py, profile_step.py train and bench_ops.py --gemm."""
    return {"tiny": (model_shape("tiny"), 16, 128), "s15": (model_shape("s15"), 8, 256)}


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def timed(fn, clock=time.perf_counter) -> float:
    """Seconds of one call of ``fn``."""
    t0 = clock()
    fn()
    return clock() - t0


def best(fn, reps: int, setup=None, clock=time.perf_counter) -> float:
    """Best time of ``reps`` calls of ``fn``; with ``setup``, each call is ``fn(setup())`` and
    only ``fn`` is timed."""
    times = []
    for _ in range(reps):
        arg = setup() if setup else None
        t0 = clock()
        fn(arg) if setup else fn()
        times.append(clock() - t0)
    return min(times)


def best_after_gap(fn, reps: int, gap: float) -> float:
    """Best wall time of ``reps`` calls, after ``gap`` seconds of sleep and one untimed call."""
    if gap > 0:
        time.sleep(gap)
    fn()
    return best(fn, reps)


def best_interleaved(fns, reps: int) -> list[float]:
    """Best time of each function, the sides interleaved."""
    for f in fns:
        f()
    t = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            t[i] = min(t[i], time.perf_counter() - t0)
    return t


def median_times(fns, steps: int, warmup: int, sync=lambda: None, clock=time.perf_counter,
                 gap: float = 0.0) -> list[float]:
    """Median step time of each function in ``fns``. The functions take turns step by step
    (A B A B ...), so on a shared machine both sides see the same background load; each timed
    step starts ``gap`` seconds after the previous one ended (OpenBLAS's idle threads spin for
    about 0.1 s after a threaded GEMM: scripts/bench_train.py's docstring)."""
    import numpy as np

    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(steps):
        for fn, ts in zip(fns, times):
            if gap > 0:
                time.sleep(gap)
            t0 = clock()
            fn()
            sync()
            ts.append(clock() - t0)
    return [float(np.median(ts)) for ts in times]


def median(xs) -> float:
    import numpy as np

    return float(np.median(np.asarray(xs)))


# ---------------------------------------------------------------------------------------------
# the machine's peaks
# ---------------------------------------------------------------------------------------------
def matmul_peak(n: int = 2048, reps: int = 5, clock=time.perf_counter,
                row_split: bool = True) -> float:
    """Best float32 GEMM rate here, FLOP/s (2 n^3 per n x n product): NumPy's BLAS-threaded
    matmul, and with ``row_split`` the best of it and the same product split by rows over
    minillama's op threads."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)
    best_s = min(timed(lambda: np.matmul(a, b, out=c), clock) for _ in range(reps))
    if row_split:
        from minillama.backends.numpy import threads as cpu_threads

        best_s = min(best_s, min(timed(lambda: cpu_threads.split_gemm(a, b, c), clock)
                                 for _ in range(reps)))
    return 2.0 * n**3 / best_s


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a large float32 array copy (read + write = 2 x nbytes moved)."""
    import numpy as np

    n = max(nbytes // 4, 1 << 20)
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best_s = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best_s = min(best_s, time.perf_counter() - t0)
    return 2 * a.nbytes / best_s


def peak_alloc(fn) -> int:
    """Peak bytes of NumPy/Python allocations alive at once while ``fn()`` runs (tracemalloc),
    above what was allocated before. Numba's in-kernel scratch (NRT) is not traced (bench_ops.py
    bounds it by ``numba_scratch_bytes``)."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
