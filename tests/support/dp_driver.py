"""One rank of a data-parallel training run built by hand, for tests/train/test_distributed.py
(run under ``mpiexec -n 2 python tests/support/dp_driver.py ...``).

``--comm nccl`` runs :class:`minillama.train.distributed.NCCLComm` on the NumPy backend with an MPI
stand-in for ``cupy.cuda.nccl`` and ``cupy.cuda`` (:class:`MpiNccl`, :class:`FakeCuda`): the
NCCL id travels from rank 0 over MPI, each rank selects "GPU" local_rank, and the all-reduce gets
raw pointers, counts and NCCL dtype codes exactly as it would on GPUs, summed here by MPI over
the host memory at those addresses. ``--fail-rank R --fail-call K`` makes rank R's K-th
forward/backward raise an OSError (a failure on one rank while the other waits in the all-reduce).

Writes ``--report`` (rank 0): the loss history, the all-reduce call count, and what the stand-ins
saw.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from minillama.core.errors import MinillamaError
from minillama.train.distributed import MPIComm, NCCLComm
from minillama.train.trainer import TrainConfig, Trainer, TrainingDiverged


class MpiNccl:
    """The slice of ``cupy.cuda.nccl`` that NCCLComm uses, implemented with MPI on host memory."""

    NCCL_SUM = 0
    NCCL_FLOAT32 = 7
    NCCL_FLOAT64 = 8
    seen: dict = {"ids": None, "counts": [], "dtypes": set()}

    @staticmethod
    def get_unique_id():
        return tuple(int(b) for b in os.urandom(128))

    class NcclCommunicator:
        def __init__(self, ndev: int, comm_id, rank: int):
            world = MPI.COMM_WORLD
            assert ndev == world.Get_size() and rank == world.Get_rank()
            MpiNccl.seen["ids"] = world.allgather(comm_id)  # every rank must hold rank 0's id
            self.world = world

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            assert sendbuf == recvbuf and op == MpiNccl.NCCL_SUM and stream == 0
            ctype = {MpiNccl.NCCL_FLOAT32: ctypes.c_float,
                     MpiNccl.NCCL_FLOAT64: ctypes.c_double}[datatype]
            arr = np.ctypeslib.as_array((ctype * count).from_address(recvbuf))
            self.world.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
            MpiNccl.seen["counts"].append(count)
            MpiNccl.seen["dtypes"].add(datatype)

        def abort(self):
            pass


class FakeCuda:
    """``cupy.cuda``'s device selection and current stream, recorded."""

    selected = None

    class runtime:
        @staticmethod
        def getDeviceCount():
            return int(os.environ.get("FAKE_GPUS", "2"))

    class Device:
        def __init__(self, i: int):
            self.i = i

        def use(self):
            FakeCuda.selected = self.i

    class _Stream:
        ptr = 0

    @staticmethod
    def get_current_stream():
        return FakeCuda._Stream()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--comm", choices=("mpi", "nccl"), default="mpi")
    ap.add_argument("--bucket-bytes", type=int, default=None)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--fail-call", type=int, default=2)
    ap.add_argument("--settings", required=True, help="TrainConfig fields as JSON")
    args = ap.parse_args()

    host = MPIComm()
    with host.guard(collective_errors=(TrainingDiverged,)):
        kw = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
        if args.comm == "nccl":
            comm = NCCLComm(host, nccl=MpiNccl, cuda=FakeCuda, **kw)
        else:
            comm = MPIComm(**kw)
        tc = TrainConfig(**{**json.loads(args.settings), "out": args.out, "data": args.data})
        trainer = Trainer(tc, progress=False, comm=comm)
        if args.fail_rank == comm.rank:
            real, calls = trainer.model.loss_and_grads, [0]

            def failing(x, y):
                calls[0] += 1
                if calls[0] == args.fail_call:
                    raise OSError(f"simulated failure on rank {comm.rank}")
                return real(x, y)

            trainer.model.loss_and_grads = failing
        trainer.train()
        seen = {"selected_device": FakeCuda.selected,
                "ids_agree": (MpiNccl.seen["ids"] is not None
                              and len(set(MpiNccl.seen["ids"])) == 1),
                "counts": MpiNccl.seen["counts"], "dtypes": sorted(MpiNccl.seen["dtypes"])}
        everyone = host.allgather(seen)
        if comm.rank == 0:
            report = {"history": trainer.history, "allreduce_calls": comm.allreduce_calls,
                      "flat_size": int(trainer._flat_buffer()[0].size),
                      "steps": trainer.step, "ranks": everyone}
            with open(args.report, "w") as f:
                json.dump(report, f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MinillamaError as e:  # as the CLI does: one line (rank 0 only; the others exit 2)
        print(f"minillama: error: {e}", file=sys.stderr)
        sys.exit(2)
