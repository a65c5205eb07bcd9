#!/usr/bin/env python
"""Data-parallel training throughput: tokens/s of 1 and 2 ranks (``mpiexec``) and the scaling
efficiency.

Each configuration launches ``mpiexec -n N`` of this script in worker mode: every rank builds the
same :class:`minillama.train.trainer.Trainer` (one rank = ``--batch`` windows of ``--seq`` tokens
per step, so N ranks train on N times the tokens per step), runs ``--warmup`` untimed steps, then
``--steps`` timed ones. Rank 0 reports the median step time (wall clock; the all-reduce makes
every rank's step end together), the time spent in the all-reduce, and each rank's CPU time.
The configurations take turns round by round (A B C A B C ...) so that all see the same
background load, and each cell is the median over ``--rounds``.

    python -m scripts.bench_dp --ranks 1,2 --threads 1 --rounds 3 --steps 5

Scaling efficiency of N ranks = tokens/s(N) / (N x tokens/s(1 rank)) at the same threads per
rank (wall clock); the CPU-time efficiency divides tokens per CPU-second of all ranks by that of
one rank, which a machine shared with other jobs disturbs less. ``--also-threads 2`` adds one
process with 2 threads: the same two cores used by threads instead of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from scripts._measure import THREAD_VARS, pin_threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2", help="comma list of rank counts (default 1,2)")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (default 1)")
    ap.add_argument("--also-threads", type=int, default=0,
                    help="also time one process with this many threads (0: no)")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="windows per rank per step (B)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per window (T)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=3, help="launches per configuration")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# worker: one rank (run under mpiexec by the driver below)
# ---------------------------------------------------------------------------------------------
def worker(spec: dict) -> None:
    pin_threads(spec["threads"])
    import numpy as np  # after the thread settings

    from minillama.train.distributed import open_world
    from minillama.train.trainer import TrainConfig, Trainer

    comm = open_world()
    tc = TrainConfig(dim=spec["dim"], n_layers=spec["n_layers"], n_heads=spec["n_heads"],
                     n_kv_heads=spec["n_kv_heads"], context=spec["seq"],
                     batch_size=spec["batch"], steps=1000, warmup=10, backend=spec["backend"],
                     out=spec["out"], plot=False)
    trainer = Trainer(tc, data_dir=spec["data"], progress=False, comm=comm)
    spent = [0.0]
    reduce = comm.allreduce_

    def timed_reduce(buf):
        t = time.perf_counter()
        reduce(buf)
        spent[0] += time.perf_counter() - t

    comm.allreduce_ = timed_reduce
    for _ in range(spec["warmup"]):
        trainer.train_step()
    times, comm_times = [], []
    cpu0 = time.process_time()
    for _ in range(spec["steps"]):
        spent[0] = 0.0
        t = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t)
        comm_times.append(spent[0])
    cpu = comm.allgather(time.process_time() - cpu0)
    if comm.rank == 0:
        n_params = sum(int(p.size) for p in trainer.model.params.values())
        print(json.dumps({"step_s": float(np.median(times)), "comm_s": float(np.median(comm_times)),
                          "cpu_s_per_step": [c / spec["steps"] for c in cpu],
                          "tokens_per_step": trainer.tokens_per_step, "params": n_params,
                          "ranks": comm.size, "transport": comm.name}))


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def write_tokens(folder: str, n_train: int = 2_000_000, n_val: int = 50_000) -> None:
    """Random byte tokens (the speed does not depend on the text)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("val", n_val)):
        rng.integers(0, 258, size=n, dtype=np.uint16).astype("<u2").tofile(
            os.path.join(folder, f"{name}.bin"))


def launch(mpiexec: str | None, ranks: int, threads: int, args, data: str, out: str) -> dict:
    spec = {"threads": threads, "backend": args.backend, "dim": args.dim,
            "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
            "batch": args.batch, "seq": args.seq,
            "steps": args.steps, "warmup": args.warmup, "data": data, "out": out}
    cmd = [sys.executable, "-m", "scripts.bench_dp", "--worker", json.dumps(spec)]
    if ranks > 1:
        cmd = [mpiexec, "-n", str(ranks), *cmd]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "SLURM_"))}
    for var in THREAD_VARS:
        env[var] = str(threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"bench_dp: {' '.join(cmd[:4])} ... failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    pin_threads(args.threads)
    from minillama.train.distributed import find_mpiexec

    ranks = [int(r) for r in args.ranks.split(",")]
    mpiexec = find_mpiexec()
    if any(r > 1 for r in ranks) and mpiexec is None:
        sys.exit("bench_dp: no mpiexec found (pip install 'minillama[mpi]')")
    configs = [(r, args.threads) for r in ranks]
    if args.also_threads:
        configs.append((1, args.also_threads))
    results: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    load_start = _load()
    with tempfile.TemporaryDirectory() as tmp:
        write_tokens(tmp)
        for rnd in range(args.rounds):
            for r, t in configs:
                res = launch(mpiexec, r, t, args, tmp, os.path.join(tmp, "out"))
                results[(r, t)].append(res)
                print(f"round {rnd + 1}: {r} rank(s) x {t} thread(s): "
                      f"{res['step_s'] * 1e3:.0f} ms/step", file=sys.stderr)
    load_end = _load()
    first = results[configs[0]][0]
    print(f"\n{platform.machine()}, {os.cpu_count()} cores, load average {load_start:.1f} at the "
          f"start, {load_end:.1f} at the end; backend {args.backend}, {first['params']:,} "
          f"parameters, B = {args.batch} windows x T = {args.seq} per rank, median of "
          f"{args.rounds} launches x {args.steps} steps\n")
    print("| ranks | threads/rank | tokens/step | ms/step | tokens/s | all-reduce (with wait) "
          "ms/step | CPU s/step (per rank) | scaling efficiency (wall) | scaling efficiency "
          "(CPU time) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = base_cpu = None
    for r, t in configs:
        rs = results[(r, t)]
        step = statistics.median(x["step_s"] for x in rs)
        comm = statistics.median(x["comm_s"] for x in rs)
        cpu = [statistics.median(x["cpu_s_per_step"][i] for x in rs) for i in range(r)]
        tps = rs[0]["tokens_per_step"] / step
        tpc = rs[0]["tokens_per_step"] / sum(cpu)  # tokens per CPU-second, all ranks
        if (r, t) == (1, args.threads):
            base, base_cpu = tps, tpc
        same = base is not None and t == args.threads
        eff = f"{tps / (r * base):.2f}" if same else "-"
        eff_cpu = f"{tpc / base_cpu:.2f}" if same else "-"
        print(f"| {r} | {t} | {rs[0]['tokens_per_step']} | {step * 1e3:.0f} | {tps:,.0f} | "
              f"{comm * 1e3:.1f} | {', '.join(f'{c:.2f}' for c in cpu)} | {eff} | {eff_cpu} |")


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


if __name__ == "__main__":
    main()
