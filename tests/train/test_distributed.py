"""Data-parallel training (``mpiexec -n N minillama train``): N ranks follow one process with
``--grad-accum N``, resume (also with another rank count), the NCCL path with an MPI stand-in,
and bad input: one line from rank 0, status 2 on every rank, no hang.

The MPI tests launch the ``mpiexec`` of the ``mpich`` wheel (the ``mpi`` extra, part of ``test``)
and skip when it or mpi4py is missing. Every launch is a tiny model for a few steps, one thread per
rank, with a time limit so a hang fails instead of blocking.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.cli import main as cli
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import CKPT_NAME, load_checkpoint
from minillama.io.data import prepare_text_file
from minillama.train.config import grad_accum_for
from minillama.train.distributed import (
    Communicator,
    RanksFailed,
    blas_share,
    detect_launcher,
    find_mpiexec,
    share_cores,
)

MPIEXEC = find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
PROBE_TIMEOUT = 60  # seconds for the one probe launch


@functools.cache
def mpi_probe() -> str | None:
    """None when ``mpiexec -n 2`` really launches two ranks that see each other through mpi4py
    (one probe per test session, with a time limit); else why not, in one line.

    A machine can have the ``mpich`` wheel's ``mpiexec`` and mpi4py installed and still be unable
    to launch (e.g. a VM without the network interfaces or shared memory that Hydra needs): the
    tests would then fail for the machine, not for the code, so they skip with the probe's
    reason."""
    if MPIEXEC is None or not HAVE_MPI4PY:
        return ("needs mpiexec and mpi4py (pip install 'minillama[mpi]'): mpiexec "
                f"{'found' if MPIEXEC else 'not found'}, mpi4py "
                f"{'found' if HAVE_MPI4PY else 'not found'}")
    code = ("import sys\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nn = c.allreduce(1)\n"
            "sys.stdout.write(f'[rank {c.rank} of {c.size} sum {n}]')\n")
    try:
        proc = _run([MPIEXEC, "-n", 2, sys.executable, "-c", code], timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"`{MPIEXEC} -n 2` did not finish a 2-rank mpi4py hello in {PROBE_TIMEOUT} s"
    except OSError as e:
        return f"`{MPIEXEC} -n 2` cannot be started: {e}"
    want = ("[rank 0 of 2 sum 2]", "[rank 1 of 2 sum 2]")  # the ranks' writes may interleave
    if proc.returncode != 0 or not all(w in proc.stdout for w in want):
        err = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])
        return (f"`{MPIEXEC} -n 2` does not run a 2-rank mpi4py job here (exit "
                f"{proc.returncode}: {err[-1][:160]})")
    return None


@pytest.fixture(scope="session")
def mpi_works() -> None:
    """Skips the test unless a 2-rank MPI job runs on this machine (:func:`mpi_probe`)."""
    reason = mpi_probe()
    if reason is not None:
        pytest.skip(reason)


needs_mpi = pytest.mark.usefixtures("mpi_works")

DRIVER = Path(__file__).resolve().parents[1] / "support" / "dp_driver.py"
TIMEOUT = 120  # seconds for one launch: a hang fails the test

#: a tiny model; 4 steps of 2 windows of 16 tokens per rank, checkpoint at step 2 and 4
TINY = dict(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, context=16, batch_size=2, steps=4,
            eval_interval=2, eval_iters=1, warmup=1, lr=3e-3, min_lr=3e-4, plot=False)
TINY_FLAGS = ([f"--{k.replace('_', '-')}={str(v).lower()}" for k, v in TINY.items()]
              + ["--no-progress"])


def _env(**extra) -> dict[str, str]:
    """The test process's environment without any launcher's variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "SLURM_", "HYDRA_", "MPI_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINILLAMA_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", **extra)
    return env


def _run(cmd, timeout: float = TIMEOUT, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))


def _mpiexec(n: int, *argv, **env) -> subprocess.CompletedProcess:
    return _run([MPIEXEC, "-n", n, sys.executable, "-m", "minillama", "train", *argv], **env)


def _history(out: Path) -> dict:
    _, _, meta = load_checkpoint(out / CKPT_NAME)
    return meta["train_state"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("minillama:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A prepared corpus of about 60,000 byte tokens (random sentences)."""
    rng = random.Random(0)
    words = ("the king queen lord night day love death sword crown blood heart speak hear good "
             "sweet fair").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(1500)]
    root = tmp_path_factory.mktemp("dp")
    (root / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return prepare_text_file(root / "corpus.txt", root / "prepared")


@pytest.fixture(scope="module")
def single(data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One process, --grad-accum 2 (no launcher); the command reports whether mpi4py was
    imported."""
    out = tmp_path_factory.mktemp("single") / "run"
    code = ("import sys\nfrom minillama.cli import main as cli\n"
            f"rc = cli.main(['train', *{TINY_FLAGS!r}, '--grad-accum=2', '--data={data}', "
            f"'--out={out}'])\n"
            "print('mpi4py imported:', 'mpi4py' in sys.modules)\nsys.exit(rc)\n")
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``mpiexec -n 2 minillama train`` with the same settings and --grad-accum 1."""
    reason = mpi_probe()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("two") / "run"
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={data}", f"--out={out}", "--plot=true")
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="module")
def stopped_at_2(data, tmp_path_factory) -> Path:
    """A 2-rank run stopped with a checkpoint after step 2 (of 4)."""
    reason = mpi_probe()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("stopped") / "run"
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={data}", f"--out={out}", "--stop-at=2")
    assert proc.returncode == 0, proc.stderr
    return out


# --- without a launcher ------------------------------------------------------------------------
def test_plain_train_never_imports_mpi4py(single):
    out, proc = single
    assert "mpi4py imported: False" in proc.stdout
    assert _history(out)["world_size"] == 1


# --- N ranks = one process with --grad-accum N ---------------------------------------------------
@needs_mpi
def test_two_ranks_follow_one_process_with_grad_accum(single, two_ranks):
    """Same seed: 2 ranks x B windows and 1 process x 2 micro-batches of B draw the same windows,
    sum the same gradients (a + b is commutative) and log the same losses to <= 1e-5."""
    a, b = _history(two_ranks[0]), _history(single[0])
    assert a["step"] == b["step"] == TINY["steps"]
    for split in ("train", "val"):
        ha, hb = a["history"][split], b["history"][split]
        assert [s for s, _ in ha] == [s for s, _ in hb] and len(ha) >= 3
        worst = max(_rel(la, lb) for (_, la), (_, lb) in zip(ha, hb))
        assert worst <= 1e-5, (split, ha, hb)
    assert a["world_size"] == 2 and a["config"]["grad_accum"] == 1
    assert a["tokens_seen"] == b["tokens_seen"] == 4 * 2 * 2 * 16  # steps x N*A x B x T
    assert a["data"]["batches_drawn"] == b["data"]["batches_drawn"] == 8


@needs_mpi
def test_rank_0_alone_prints(two_ranks):
    _, proc = two_ranks
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("{")]) == 1
    assert proc.stderr.count("model: dim 16") == 1
    assert "data parallel: 2 ranks over MPI" in proc.stderr
    assert proc.stdout.count("step 4: train loss") == 1
    assert (two_ranks[0] / "loss.png").is_file()


@needs_mpi
def test_resume_under_two_ranks_reproduces_the_run(stopped_at_2, two_ranks, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_2, out)
    assert _history(out)["step"] == 2
    proc = _mpiexec(2, "--resume", f"--out={out}", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "resumed at step 2" in proc.stderr
    assert _history(out)["history"] == _history(two_ranks[0])["history"]  # bit for bit


@needs_mpi
def test_resume_with_one_process_keeps_the_global_batch(stopped_at_2, two_ranks, tmp_path,
                                                        capsys):
    """A 2-rank checkpoint continued by one process: --grad-accum becomes 2."""
    out = tmp_path / "run"
    shutil.copytree(stopped_at_2, out)
    assert cli.main(["train", "--resume", f"--out={out}", "--no-progress"]) == 0
    capsys.readouterr()
    a, b = _history(out), _history(two_ranks[0])
    assert a["world_size"] == 1 and a["config"]["grad_accum"] == 2
    for (sa, la), (sb, lb) in zip(a["history"]["train"], b["history"]["train"], strict=True):
        assert sa == sb and _rel(la, lb) <= 1e-5


@needs_mpi
def test_time_limit_stops_every_rank_at_the_same_step(data, tmp_path):
    """The time-limit vote travels in the gradient buffer: both ranks stop after the same step
    and rank 0 saves there. Rank 0 alone says so: a line from rank 1 could be spliced into rank
    0's lines in the launcher's merged stdout (the summary line lost)."""
    out = tmp_path / "run"
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={data}", f"--out={out}", "--time-limit=1e-9")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln for ln in lines if "time limit" in ln] == [
        "time limit of 1e-09 min reached at step 1; checkpoint saved, continue with --resume"
    ], proc.stdout
    summaries = [ln for ln in lines if ln.startswith("{")]
    assert len(summaries) == 1, proc.stdout
    summary = json.loads(summaries[0])
    assert summary["steps"] == 1 and summary["stopped_early"]
    assert _history(out)["step"] == 1


# --- the NCCL communicator, with MPI standing in for NCCL and the GPUs ------------------------
@needs_mpi
def test_nccl_path_with_an_mpi_stand_in(data, two_ranks, tmp_path):
    report = tmp_path / "report.json"
    settings = json.dumps({**TINY})
    proc = _run([MPIEXEC, "-n", 2, sys.executable, DRIVER, f"--data={data}",
                 f"--out={tmp_path / 'run'}", f"--report={report}", "--comm=nccl",
                 f"--settings={settings}", "--bucket-bytes=12000"])
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    # the same sums as the MPI run: the same losses bit for bit
    assert r["history"] == _history(two_ranks[0])["history"]
    n = r["flat_size"]  # the gradients + 2 slots (loss sum, time-limit vote)
    per_step = -(-n // 3000)  # 12000-byte buckets of float32
    assert per_step > 1 and r["allreduce_calls"] == TINY["steps"] * per_step
    for rank, seen in enumerate(r["ranks"]):
        assert seen["selected_device"] == rank  # one GPU per rank, by local rank
        assert seen["ids_agree"]  # rank 0's NCCL id reached every rank
        assert sum(seen["counts"]) == TINY["steps"] * n and max(seen["counts"]) == 3000
        assert seen["dtypes"] == [7]  # NCCL_FLOAT32


@needs_mpi
def test_more_ranks_than_gpus_is_one_line(data, tmp_path):
    settings = json.dumps({**TINY})
    proc = _run([MPIEXEC, "-n", 2, sys.executable, DRIVER, f"--data={data}",
                 f"--out={tmp_path / 'run'}", f"--report={tmp_path / 'r.json'}", "--comm=nccl",
                 f"--settings={settings}"], FAKE_GPUS="1")
    assert proc.returncode == 2
    assert "2 ranks on this host but only 1 GPU(s)" in proc.stderr


# --- bad input ---------------------------------------------------------------------------------
@needs_mpi
def test_failure_on_one_rank_aborts_the_world(data, tmp_path):
    """Rank 1 fails in its second forward/backward while rank 0 waits in the all-reduce: the
    world ends with status 2 (no hang) and says which rank failed."""
    settings = json.dumps({**TINY})
    proc = _run([MPIEXEC, "-n", 2, sys.executable, DRIVER, f"--data={data}",
                 f"--out={tmp_path / 'run'}", f"--report={tmp_path / 'r.json'}",
                 f"--settings={settings}", "--fail-rank=1", "--fail-call=2"])
    assert proc.returncode == 2, proc.stderr
    assert "minillama: error: rank 1: simulated failure on rank 1" in proc.stderr
    assert not (tmp_path / "r.json").exists()


@needs_mpi
def test_ranks_that_disagree_on_the_config(data, tmp_path):
    common = [sys.executable, "-m", "minillama", "train", *TINY_FLAGS, f"--data={data}",
              f"--out={tmp_path / 'run'}"]
    proc = _run([MPIEXEC, "-n", 1, *common, "--lr=0.001", ":", "-n", 1, *common, "--lr=0.002"])
    assert proc.returncode == 2
    assert _one_error_line(proc.stderr) == ("minillama: error: ranks disagree on the training "
                                            "settings: rank 1 has lr=0.002, rank 0 has lr=0.001")
    assert not (tmp_path / "run").exists()


@needs_mpi
def test_launcher_without_mpi4py(data, tmp_path):
    shadow = tmp_path / "shadow" / "mpi4py"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no mpi4py in this test')\n")
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={data}", f"--out={tmp_path / 'run'}",
                    PYTHONPATH=str(shadow.parent))
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "mpi4py cannot be imported (no mpi4py in this test)" in line
    assert "pip install 'minillama[mpi]'" in line


def _cupy_without_nccl() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        from minillama.train.distributed import import_nccl

        import_nccl()
    except MinillamaError:
        return True
    except Exception:  # a CuPy that cannot even import: not this test's case
        return False
    return False


@needs_mpi
@pytest.mark.skipif(not _cupy_without_nccl(), reason="needs CuPy installed without NCCL (here "
                                                     "NCCL is present or CuPy is missing)")
def test_cupy_backend_without_nccl(data, tmp_path):
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={data}", f"--out={tmp_path / 'run'}",
                    "--backend=cupy")
    assert proc.returncode == 2
    assert "needs NCCL" in _one_error_line(proc.stderr)


@needs_mpi
def test_rank_count_that_cannot_share_the_checkpoint_batch(stopped_at_2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_2, out)
    proc = _mpiexec(3, "--resume", f"--out={out}", "--no-progress")
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "2 micro-batches" in line and "3 ranks cannot share" in line
    assert _history(out)["step"] == 2  # untouched


@needs_mpi
def test_more_windows_per_step_than_the_data_has(tmp_path):
    (tmp_path / "small.txt").write_text("a short text of a few lines\n" * 8)
    folder = prepare_text_file(tmp_path / "small.txt", tmp_path / "prepared")
    proc = _mpiexec(2, *TINY_FLAGS, f"--data={folder}", f"--out={tmp_path / 'run'}",
                    "--batch-size=100")
    assert proc.returncode == 2
    assert "windows per step, but the training split has only" in _one_error_line(proc.stderr)


# --- the pieces, in one process ----------------------------------------------------------------
def test_mpi_probe_skips_a_launcher_that_cannot_launch(tmp_path, monkeypatch):
    """The skip condition runs ``mpiexec -n 2``: an mpiexec that fails, hangs or starts ranks
    that do not see each other gives a reason (the tests skip), never a pass."""
    def fake(name: str, body: str) -> str:
        f = tmp_path / name
        f.write_text("#!/bin/sh\n" + body + "\n")
        f.chmod(0o755)
        return str(f)

    probe = mpi_probe.__wrapped__  # uncached
    monkeypatch.setattr(sys.modules[__name__], "HAVE_MPI4PY", True)
    monkeypatch.setattr(sys.modules[__name__], "PROBE_TIMEOUT", 2)
    monkeypatch.setattr(sys.modules[__name__], "MPIEXEC",
                        fake("broken", "echo 'HYDU_sock_connect: unable to connect' >&2; exit 7"))
    assert "exit 7: HYDU_sock_connect" in probe()
    monkeypatch.setattr(sys.modules[__name__], "MPIEXEC", fake("hangs", "exec sleep 30"))
    assert "did not finish" in probe()
    monkeypatch.setattr(sys.modules[__name__], "MPIEXEC",
                        fake("singletons", "echo '[rank 0 of 1 sum 1][rank 0 of 1 sum 1]'"))
    assert "does not run a 2-rank" in probe()
    monkeypatch.setattr(sys.modules[__name__], "MPIEXEC", None)
    assert "mpiexec not found" in probe()


def test_detect_launcher():
    assert detect_launcher({}) is None
    assert detect_launcher({"PMI_RANK": "1", "PMI_SIZE": "4"}).size == 4
    got = detect_launcher({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
    assert (got.rank, got.size, got.source) == (2, 3, "OMPI_COMM_WORLD_SIZE")
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None  # sbatch, no srun
    assert detect_launcher({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8"}).rank == 5


def test_grad_accum_for_another_rank_count():
    assert grad_accum_for(2, 1, 4, 1) == 2
    assert grad_accum_for(1, 4, 4, 2) == 2
    assert grad_accum_for(4, 2, 4, 8) == 1
    with pytest.raises(MinillamaError, match="6 micro-batches .* 4 ranks cannot share"):
        grad_accum_for(3, 2, 4, 4)


def test_share_cores_only_when_unset():
    env: dict[str, str] = {}
    assert share_cores(os.cpu_count() or 1, env) == 1 and env["MINILLAMA_NUM_THREADS"] == "1"
    env = {"OMP_NUM_THREADS": "3"}
    assert share_cores(2, env) is None and "MINILLAMA_NUM_THREADS" not in env
    assert share_cores(1, {}) is None


class _Seen(Communicator):
    """Rank ``rank`` of a world whose allgather returns ``others``' values around its own."""

    def __init__(self, rank, values):
        super().__init__()
        self.rank, self.size, self.values, self.aborted = rank, len(values), values, None

    def allgather(self, obj):
        return [obj if r == self.rank else v for r, v in enumerate(self.values)]

    def bcast(self, obj, root=0):
        return obj

    def abort(self, code):
        self.aborted = code
        raise SystemExit(code)


def test_agree_raises_the_lowest_failing_rank_everywhere():
    comm = _Seen(0, [None, "cannot read run.toml", "other"])
    with pytest.raises(RanksFailed, match="^rank 1: cannot read run.toml$"):
        comm.agree(lambda: 42)
    assert _Seen(0, [None, None]).agree(lambda: 42) == 42
    with pytest.raises(RanksFailed, match="^bad$"):
        _Seen(0, [None, None]).agree(lambda: (_ for _ in ()).throw(MinillamaError("bad")))


def test_agree_on_names_the_first_difference():
    comm = _Seen(1, [{"lr": 1.0, "seed": 0}, None])
    with pytest.raises(RanksFailed, match="rank 1 has seed=1, rank 0 has seed=0"):
        comm.agree_on("the settings", {"lr": 1.0, "seed": 1})


def test_guard_exits_quietly_on_other_ranks_and_aborts_on_local_failures(capsys):
    with pytest.raises(SystemExit) as e, _Seen(1, [0, 0]).guard():
        raise RanksFailed("everyone knows")
    assert e.value.code == 2 and capsys.readouterr().err == ""
    with pytest.raises(RanksFailed), _Seen(0, [0, 0]).guard():
        raise RanksFailed("rank 0 lets the CLI print it")
    comm = _Seen(1, [0, 0])
    with pytest.raises(SystemExit), comm.guard():
        raise OSError(28, "No space left on device", "ckpt.safetensors")
    assert comm.aborted == 2
    assert capsys.readouterr().err.strip() == ("minillama: error: rank 1: No space left on "
                                              "device: ckpt.safetensors")


def test_blas_share_holds_openblas_at_the_share():
    from minillama.backends.numpy.threads import openblas_api

    api = openblas_api()
    if api is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose thread count can be set")
    get, set_ = api
    before = get()
    set_(2)
    if get() != 2:
        set_(before)
        pytest.skip("OpenBLAS cannot run 2 threads here")
    try:
        with blas_share(1):
            assert get() == 1
        assert get() == 2
        with blas_share(None):
            assert get() == 2
    finally:
        set_(before)
