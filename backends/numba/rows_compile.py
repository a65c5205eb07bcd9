"""The decode step of several rows, as speculative decoding verifies drafts with it, compiled
apart from the answer that first wants it.

On a cold kernel cache that kernel is a second compilation as long as the one-row step's
(~25 s on two cores); a first answer would wait for it. :meth:`DraftSteps.verification_ready
<minillama.backends.numba.backend_decode.DraftSteps.verification_ready>` asks :func:`loadable`
whether it is compiled in this process or in the disk cache, and otherwise starts
:func:`start_worker`: ``python -m minillama.backends.numba.rows_compile KIND`` compiles it into
the disk cache (at a lower priority) while the answer goes on without drafts; the next step after
the worker ends loads it. The worker needs no model: a kernel's compiled code depends on its
arguments' types only, which :func:`scratch_args` builds from tiny arrays (a test holds them to a
real call's types).

Imported only by the numba backend (importing it imports Numba).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
from numba.typed import List

from .decode import float_step, quant_step
from .quant import matmul as q

#: the kernels of several rows: GGML block weights, float32 weights, float64 weights; "-f16":
#: with a half-precision KV cache
KINDS = ("quant", "float32", "float64", "quant-f16", "float32-f16")


def scratch_args(kind: str):
    """(the kernel of several rows of ``kind``, arguments of the types a real call passes)."""
    i64 = np.zeros(1, dtype=np.int64)
    rows = (i64, i64.copy(), i64.copy())  # tok, pos, seq
    kind, half = kind.removesuffix("-f16"), kind.endswith("-f16")
    if kind == "quant":
        def f32(*shape):
            return np.zeros(shape, dtype=np.float32)

        def u8():  # block data: read-only, as the decode plans pass it
            a = np.zeros((1, 1), dtype=np.uint8)
            a.flags.writeable = False
            return a

        cache = List([np.zeros((1, 1, 1, 1), np.uint16 if half else np.float32)])
        gains, mats = List([f32(1)]), List([u8()])
        args = (*rows, u8(), 0, f32(1, 1), u8(), 0, f32(1, 1), np.zeros((1, 7), np.int64),
                f32(1), gains, mats, mats, mats, mats, gains, mats, mats, mats, cache, cache,
                f32(1, 1), f32(1, 1), 1e-5, 1, f32(1, 1), 1, q._F16, q._KVALUES, True)
        return quant_step.decode_step_rows_q_kernel, args
    dt = np.dtype(kind)
    vec, mat = List([np.zeros(1, dt)]), List([np.zeros((1, 1), dt)])
    cache = List([np.zeros((1, 1, 1, 1), np.uint16 if half else dt)])
    args = (*rows, np.zeros((1, 1), dt), np.zeros((1, 1), dt), np.zeros(1, dt), vec, mat, mat,
            mat, mat, vec, mat, mat, mat, cache, cache, np.zeros((1, 1), dt),
            np.zeros((1, 1), dt), 1e-5, 1, dt.type(0), np.zeros((1, 1), dt), 1,
            np.zeros(0, np.int64), np.zeros((0, 0), np.int64))
    return float_step.decode_step, args


def signature(dispatcher, args) -> tuple:
    """The Numba types ``dispatcher`` compiles a call with ``args`` for."""
    return tuple(dispatcher.typeof_pyval(a) for a in args)


def loadable(dispatcher, args) -> bool:
    """Whether ``dispatcher`` has code for ``args``' types in this process or in its disk cache
    (then loaded now, without compiling). Where Numba's cache cannot be asked, True: the call
    compiles as it always did."""
    sig = signature(dispatcher, args)
    if sig in dispatcher.overloads:
        return True
    try:  # the cache's index names the code (read once, below, by the compile that installs it)
        cache = dispatcher._cache
        key = cache._index_key(sig, dispatcher.targetctx.codegen())
        cached = cache._enabled and key in cache._cache_file._load_index()
    except Exception:  # another Numba's internals: no background compile
        return True
    if cached:
        dispatcher.compile(sig)  # the disk cache's code, installed
    return cached


def start_worker(kind: str) -> subprocess.Popen:
    """A process compiling ``kind``'s kernel of several rows into the disk cache (this
    process's environment, so the same cache folder), at a lower priority."""

    def lower():  # pragma: no cover - runs in the child
        with contextlib.suppress(OSError, AttributeError):
            os.nice(10)

    return subprocess.Popen([sys.executable, "-m", __name__, kind], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lower if os.name == "posix" else None)


def lock_path(dispatcher, kind: str) -> str:
    """The lock file of ``kind``'s workers: in the kernel's disk cache folder (one per cache,
    as every process that shares the cache shares the lock), else the temporary folder."""
    import tempfile

    try:
        folder = dispatcher._cache._cache_path
    except Exception:  # another Numba's internals
        folder = tempfile.gettempdir()
    return os.path.join(folder, f"rows_compile-{kind}.lock")


def compile_once(path: str, ready, build) -> None:
    """``build()`` unless ``ready()`` says the kernel is there, holding an exclusive lock on the
    file ``path`` meanwhile: of the workers that processes started on the same cold cache, one
    compiles while the others wait, asleep, and then find the kernel in the cache (without
    the lock, each compiled the same kernel again, taking the cores the answers run on)."""
    try:
        import fcntl

        f = open(path, "a")
    except (ImportError, OSError):  # no POSIX locks (Windows), or a cache folder not writable
        if not ready():
            build()
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not ready():
            build()


def main(argv=None) -> int:
    """Compile the kernel of several rows of the kind named in ``argv`` into the disk cache,
    unless another worker has (:func:`compile_once`)."""
    kind = (argv or sys.argv[1:])[0]
    if kind not in KINDS:
        print(f"rows_compile: the kind is one of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    dispatcher, args = scratch_args(kind)
    compile_once(lock_path(dispatcher, kind), lambda: loadable(dispatcher, args),
                 lambda: dispatcher.compile(signature(dispatcher, args)))
    return 0


if __name__ == "__main__":  # pragma: no cover - the worker
    raise SystemExit(main())
