r"""Data parallelism: the communicators that ``mpiexec -n N minillama train`` runs on.

N ranks train one model. Each rank holds the whole model and the same data sampler; each step the
global batch of N x A micro-batches (A = ``--grad-accum``) is split into disjoint shares, every
rank runs forward and backward on its A micro-batches, and the summed gradients are averaged over
all ranks by one in-place sum over a flat buffer:

.. math::

    g = \frac{1}{N A} \sum_{r=0}^{N-1} \sum_{a=1}^{A} \nabla_\theta L(x_{rA+a}, y_{rA+a})

Clipping and AdamW then run on identical data on every rank, so the weights stay identical without
ever being sent.

The transport sits behind :class:`Communicator` (``rank``, ``size``, ``local_rank``, in-place
``allreduce_`` of a flat 1-D buffer, object ``allgather``/``bcast``, ``abort``):

* :class:`SingleProcess`: one process, every call a no-op (``minillama train`` without a launcher;
  mpi4py is never imported);
* :class:`MPIComm`: mpi4py over ``MPI.COMM_WORLD``, host (NumPy) buffers;
* :class:`NCCLComm`: NCCL through ``cupy.cuda.nccl`` for device (CuPy) buffers, one GPU per rank
  chosen by the local rank; the NCCL id and every object message travel over MPI.

Failures never leave a peer waiting: set-up steps run through :meth:`Communicator.agree` (every rank
learns that one failed and all exit with status 2, rank 0 printing the line), and an error on one
rank in the middle of a step aborts the world (:meth:`Communicator.guard`).

Importing this module imports neither NumPy, mpi4py nor CuPy.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minillama.backends import openblas_api
from minillama.core.errors import MinillamaError

#: the largest piece of the flat gradient buffer one all-reduce call sends (bytes); a model whose
#: gradients are larger is reduced in several buckets of this size
BUCKET_BYTES = 256 << 20
#: seconds a failing MPI rank waits between writing its error line and MPI_Abort: the abort
#: kills every rank at once, and the launcher (MPICH's hydra) could drop the line still in
#: the pipe it forwards (seen once in four full test runs: exit status 2 with an empty stderr)
ABORT_GRACE_S = 0.5

#: (rank variable, size variable) that launchers set: MPICH/Intel MPI (Hydra, PMI), Open MPI,
#: MVAPICH, SLURM's srun
LAUNCHER_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
                 ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


class RanksFailed(MinillamaError):
    """Raised on every rank together when a step run through :meth:`Communicator.agree` failed
    on at least one of them (the message is the first failure's, prefixed by its rank)."""


# ---------------------------------------------------------------------------------------------
# Finding the launcher
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """What the launcher's environment says about this process."""

    rank: int
    size: int
    source: str  # the variable the size came from


def detect_launcher(environ=None) -> Launch | None:
    """The rank and world size a launcher (``mpiexec``, ``mpirun``, ``srun``) put in the
    environment, or None when this process was started alone."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARS:
        size, rank = env.get(size_var, "").strip(), env.get(rank_var, "").strip()
        if size.isdigit() and rank.isdigit():
            return Launch(rank=int(rank), size=int(size), source=size_var)
    return None


def find_mpiexec() -> str | None:
    """The ``mpiexec`` that belongs to this Python: the ``mpich`` wheel installs it beside the
    interpreter (``bin/`` of the virtual environment or of the base installation); else the one
    on ``PATH``. None when there is none."""
    dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts")),
            Path(sys.prefix) / "bin", Path(sys.base_prefix) / "bin"]
    for d in dirs:
        p = d / "mpiexec"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("mpiexec")


def _fail_before_mpi(launch: Launch, message: str):
    """Exit with status 2 on every rank before any rank can talk to another: rank 0 raises the
    error (one line from the CLI), the other ranks leave silently."""
    if launch.rank == 0:
        raise MinillamaError(message)
    raise SystemExit(2)


def open_world(environ=None) -> Communicator:
    """The communicator of this process: :class:`SingleProcess` unless a launcher started more
    than one rank, then :class:`MPIComm` (mpi4py is imported only in that case).

    A launcher without mpi4py, or an mpi4py whose MPI sees a world of one while the launcher
    started several (mpi4py built for another MPI than the launcher's) is a clear error."""
    launch = detect_launcher(environ)
    if launch is None or launch.size <= 1:
        return SingleProcess()
    try:
        from mpi4py import MPI
    except ImportError as e:
        _fail_before_mpi(launch, f"started by an MPI launcher ({launch.source}={launch.size}) but "
                                 f"mpi4py cannot be imported ({e}); install the mpi extra: "
                                 f"pip install 'minillama[mpi]'")
    world = MPIComm(MPI.COMM_WORLD)
    if world.size != launch.size:
        _fail_before_mpi(launch, f"the launcher started {launch.size} ranks "
                                 f"({launch.source}={launch.size}) but MPI sees a world of "
                                 f"{world.size}: mpi4py uses another MPI than this mpiexec "
                                 f"(use the mpiexec of the MPI mpi4py was built with)")
    return world


def share_cores(local_size: int, environ=None) -> int | None:
    """Give each of the ``local_size`` ranks on this host its share of the cores for the NumPy ops
    threads (``MINILLAMA_NUM_THREADS``) and Numba (``NUMBA_NUM_THREADS``), unless the user set a
    thread count. Returns the share, or None when left alone."""
    env = os.environ if environ is None else environ
    if local_size <= 1 or any(env.get(v) for v in ("MINILLAMA_NUM_THREADS", "OMP_NUM_THREADS",
                                                    "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")):
        return None
    n = max(1, (os.cpu_count() or 1) // local_size)
    env["MINILLAMA_NUM_THREADS"] = str(n)
    env.setdefault("NUMBA_NUM_THREADS", str(n))
    return n


@contextmanager
def blas_share(threads: int | None):
    """Hold OpenBLAS at ``threads`` threads while the block runs (then restore it): OpenBLAS sized
    its pool for the whole machine when NumPy loaded, and idle BLAS threads spinning beside the
    other ranks slow every step. None, or a BLAS that is not OpenBLAS, leaves it alone."""
    api = None
    if threads:
        api = openblas_api()
    if api is None:
        yield
        return
    get, set_ = api
    before = get()
    set_(int(threads))
    try:
        yield
    finally:
        set_(before)


# ---------------------------------------------------------------------------------------------
# Communicators
# ---------------------------------------------------------------------------------------------
class Communicator:
    """The operations data parallelism needs. Subclasses provide ``allreduce_``, ``allgather``,
    ``bcast`` and ``abort``; the failure handling (:meth:`agree`, :meth:`agree_on`, :meth:`guard`)
    is written once here on top of them."""

    name = "?"
    rank = 0
    size = 1
    local_rank = 0
    local_size = 1

    def __init__(self) -> None:
        self.allreduce_calls = 0  # all-reduce calls made so far (one per bucket)

    # --- transport -----------------------------------------------------------------------------
    def allreduce_(self, buf) -> None:
        """Sum the contiguous 1-D array ``buf`` over all ranks, in place."""
        raise NotImplementedError

    def allgather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), as a list indexed by rank."""
        raise NotImplementedError

    def bcast(self, obj, root: int = 0):
        """Rank ``root``'s ``obj`` on every rank."""
        raise NotImplementedError

    def abort(self, code: int):
        """End every rank of the world now with status ``code`` (never returns)."""
        raise NotImplementedError

    # --- failure handling ----------------------------------------------------------------------
    def agree(self, fn: Callable[[], Any], root_only: bool = False):
        """Run ``fn()`` on every rank (or on rank 0 only, the others receiving its result), then
        let every rank know whether any failed with a :class:`MinillamaError` or ``OSError``: if
        one did, every rank raises :class:`RanksFailed` with the lowest failing rank's message.
        Returns ``fn``'s result."""
        result, err = None, None
        if not root_only or self.rank == 0:
            try:
                result = fn()
            except MinillamaError as e:
                err = str(e)
            except OSError as e:
                err = _os_error_line(e)
        errors = self.allgather(err)
        for r, e in enumerate(errors):
            if e is not None:
                raise RanksFailed(e if r == 0 else f"rank {r}: {e}")
        return self.bcast(result) if root_only else result

    def agree_on(self, what: str, values: dict[str, Any]) -> None:
        """Every rank must hold the same ``values``; the first difference from rank 0 is an error
        on every rank: ``ranks disagree on <what>: rank r has k=v, rank 0 has k=v0``."""
        everyone = self.allgather(values)
        ref = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            for k in sorted(set(ref) | set(theirs)):
                if ref.get(k) != theirs.get(k):
                    raise RanksFailed(f"ranks disagree on {what}: rank {r} has "
                                      f"{k}={theirs.get(k)!r}, rank 0 has {k}={ref.get(k)!r}")

    @contextmanager
    def guard(self, collective_errors: tuple[type, ...] = ()):
        """Run a block so that a failure on any rank ends every rank with status 2, never a hang.

        :class:`RanksFailed` and the types in ``collective_errors`` are raised by every rank at
        the same point (they come from agreed values): rank 0 re-raises (the CLI prints the one
        line), the others exit 2 quietly. Anything else happened on this rank alone while its peers
        may be waiting in a collective: print the line (or the traceback of a bug), then abort the
        world with status 2 (1 for a bug, 130 for Ctrl-C)."""
        try:
            yield self
        except (RanksFailed, *collective_errors):
            if self.rank == 0:
                raise
            raise SystemExit(2) from None
        except MinillamaError as e:
            self._abort_with(2, f"minillama: error: {self._who()}{e}")
        except OSError as e:
            self._abort_with(2, f"minillama: error: {self._who()}{_os_error_line(e)}")
        except KeyboardInterrupt:
            self._abort_with(130, "minillama: interrupted")
        except SystemExit as e:
            if e.code not in (0, None):
                self._abort_with(e.code if isinstance(e.code, int) else 2, "")
            raise
        except Exception:
            self._abort_with(1, f"minillama: rank {self.rank} failed:\n"
                                f"{traceback.format_exc().rstrip()}")

    def _who(self) -> str:
        return f"rank {self.rank}: " if self.rank else ""

    def _abort_with(self, code: int, line: str):
        if line:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        self.abort(code)


def _os_error_line(e: OSError) -> str:
    if e.filename is not None:
        return f"{e.strerror or e}: {e.filename}"
    return str(e)


class SingleProcess(Communicator):
    """A world of one: nothing to send; errors keep their own types."""

    name = "single"

    def allreduce_(self, buf) -> None:
        pass

    def allgather(self, obj) -> list:
        return [obj]

    def bcast(self, obj, root: int = 0):
        return obj

    def abort(self, code: int):
        raise SystemExit(code)

    def agree(self, fn, root_only: bool = False):
        return fn()

    def agree_on(self, what: str, values: dict[str, Any]) -> None:
        pass

    @contextmanager
    def guard(self, collective_errors=()):
        yield self


class MPIComm(Communicator):
    """mpi4py's ``COMM_WORLD`` (or ``comm``): host buffers, sums with ``Allreduce(IN_PLACE)`` in
    buckets of at most :data:`BUCKET_BYTES`."""

    name = "mpi"

    def __init__(self, comm=None, bucket_bytes: int = BUCKET_BYTES):
        super().__init__()
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        self.bucket_bytes = int(bucket_bytes)

    def allreduce_(self, buf) -> None:
        n = buf.size
        step = max(1, self.bucket_bytes // buf.itemsize)
        for lo in range(0, n, step):
            self.comm.Allreduce(self._MPI.IN_PLACE, buf[lo:lo + step], op=self._MPI.SUM)
            self.allreduce_calls += 1

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)

    def bcast(self, obj, root: int = 0):
        return self.comm.bcast(obj, root=root)

    def abort(self, code: int):
        time.sleep(ABORT_GRACE_S)  # the error line reaches the launcher first
        try:
            self.comm.Abort(code)
        finally:  # MPI_Abort may return before the launcher has killed this process
            os._exit(code)


# ---------------------------------------------------------------------------------------------
# NCCL (GPUs)
# ---------------------------------------------------------------------------------------------
def import_nccl():
    """``cupy.cuda.nccl`` when CuPy has NCCL, else a :class:`MinillamaError` saying what to
    install."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing; we say it once
            from cupy.cuda import nccl
    except ImportError as e:
        raise MinillamaError(f"--backend cupy on several ranks needs CuPy with NCCL: {e}") \
            from None
    if not getattr(nccl, "available", True):
        raise MinillamaError("--backend cupy on several ranks needs NCCL, which CuPy cannot load "
                             "(libnccl.so.2 not found): pip install nvidia-nccl-cu12")
    return nccl


def _cuda():
    import cupy

    return cupy.cuda


def select_device(local_rank: int, local_size: int, cuda) -> int:
    """Make GPU ``local_rank`` this process's current device (one rank per GPU on each host)."""
    n = int(cuda.runtime.getDeviceCount())
    if local_size > n:
        raise MinillamaError(f"{local_size} ranks on this host but only {n} GPU(s): launch at "
                             f"most one rank per GPU")
    cuda.Device(local_rank).use()
    return local_rank


def _device_pointer(buf) -> int:
    """The address of ``buf``'s data: a CuPy array's device pointer (a host array's address for
    the MPI stand-in of NCCL that the tests use)."""
    data = buf.data
    return int(data.ptr) if hasattr(data, "ptr") else int(buf.ctypes.data)


class NCCLComm(Communicator):
    """NCCL over the GPUs, one per rank; ``host`` (an :class:`MPIComm`) carries the NCCL id and
    every object message, and ends the world on a failure.

    ``allreduce_`` sums a device buffer in place on the current stream (``ncclAllReduce`` with
    send buffer = receive buffer): the gradients never visit the host. ``nccl`` and ``cuda``
    default to ``cupy.cuda.nccl`` and ``cupy.cuda``; the tests pass an MPI stand-in for both."""

    name = "nccl"

    def __init__(self, host: Communicator, nccl=None, cuda=None,
                 bucket_bytes: int = BUCKET_BYTES):
        super().__init__()
        self.host = host
        self.rank, self.size = host.rank, host.size
        self.local_rank, self.local_size = host.local_rank, host.local_size
        self.nccl = host.agree(lambda: nccl if nccl is not None else import_nccl())
        self.cuda = host.agree(lambda: cuda if cuda is not None else _cuda())
        self.device = host.agree(lambda: select_device(self.local_rank, self.local_size,
                                                       self.cuda))
        uid = host.bcast(self.nccl.get_unique_id() if host.rank == 0 else None)
        self.comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
        self._dtypes = {"float32": self.nccl.NCCL_FLOAT32, "float64": self.nccl.NCCL_FLOAT64}
        self.bucket_bytes = int(bucket_bytes)

    def allreduce_(self, buf) -> None:
        dtype = self._dtypes.get(str(buf.dtype))
        if dtype is None:
            raise MinillamaError(f"NCCL all-reduce of {buf.dtype} buffers is not supported")
        ptr, item = _device_pointer(buf), buf.itemsize
        stream = self.cuda.get_current_stream().ptr
        step = max(1, self.bucket_bytes // item)
        for lo in range(0, buf.size, step):
            count = min(step, buf.size - lo)
            self.comm.allReduce(ptr + lo * item, ptr + lo * item, count, dtype,
                                self.nccl.NCCL_SUM, stream)
            self.allreduce_calls += 1

    def allgather(self, obj) -> list:
        return self.host.allgather(obj)

    def bcast(self, obj, root: int = 0):
        return self.host.bcast(obj, root)

    def abort(self, code: int):
        try:
            self.comm.abort()
        except Exception:  # ending the world matters more than NCCL's own cleanup
            pass
        self.host.abort(code)
