"""Fuzz every reader for as long as wanted and print a tally (the same mutator as
``tests/io/test_fuzz_load.py``: ``tests/support/fuzzing.py``).

Cases run in a worker process, so a hard crash (a segfault) or a hang that ignores the alarm is
counted (``crash`` / ``timeout``) and the worker restarted, instead of ending the run.

    python -m scripts.fuzz_load --cases 10000            # spread over every format
    python -m scripts.fuzz_load --targets hf,gguf --cases 2000 --seed 3
    python -m scripts.fuzz_load --target hf --seed 17 --case 123 -v   # replay one case
    python -m scripts.fuzz_load --real ...               # also the shipped model, stories260K

Exit status 0 when every case ended in a clean error or a finite load, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fuzzing import BAD, Result, Target, make_targets, run_case

ROOT = Path(__file__).resolve().parents[1]

STATUSES = ("ok", "error", "traceback", "timeout", "crash", "nonfinite")


def real_targets(root: Path) -> dict[str, Target]:
    """Mutated copies of real files when they are here: the shipped model and stories260K."""
    from minillama.io.load import DEFAULT_CHECKPOINT
    from tests.support.fuzzing import _load_and_run

    out = {}
    if DEFAULT_CHECKPOINT.is_file():
        d = root / "shipped" / "seed"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEFAULT_CHECKPOINT, d / "model.safetensors")
        out["shipped"] = Target("shipped", d, ["model.safetensors"],
                                lambda p: _load_and_run(p / "model.safetensors"))
    stories = ROOT.parent / "shared" / "data" / "stories260K.bin"
    if stories.is_file():
        d = root / "stories260K" / "seed"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(stories, d / "model.bin")
        out["stories260K"] = Target("stories260K", d, ["model.bin"],
                                    lambda p: _load_and_run(p / "model.bin"))
    return out


def _worker(conn, targets, seed, root, time_limit):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, index = msg
        r = run_case(targets[name], index, seed, root / name / "work", time_limit)
        conn.send(r)


class Runner:
    """One worker process at a time; replaced when it dies or hangs."""

    def __init__(self, targets, seed, root, time_limit):
        self.args = (targets, seed, root, time_limit)
        self.time_limit = time_limit
        self.ctx = mp.get_context("fork")
        self.proc = None

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        self.proc.start()

    def run(self, name, index) -> Result:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        self.conn.send((name, index))
        try:
            if self.conn.poll(self.time_limit + 20):
                return self.conn.recv()
            status, detail = "timeout", f"no answer within {self.time_limit + 20} s (killed)"
        except EOFError:
            self.proc.join(5)
            status, detail = "crash", f"worker died, exit code {self.proc.exitcode}"
        self.proc.kill()
        self.proc.join(5)
        self.proc = None
        from tests.support.fuzzing import prepare_case

        work = self.args[2] / name / "replay"
        desc = prepare_case(self.args[0][name], index, self.args[1], work)
        return Result(name, index, status, desc, detail, time.perf_counter() - t0)

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1000, help="cases in all (round robin)")
    p.add_argument("--targets", default=None, help="comma-separated formats (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds per case")
    p.add_argument("--real", action="store_true",
                   help="also mutate the shipped model and ../shared/data/stories260K.bin")
    p.add_argument("--target", help="with --case: replay one case of this format")
    p.add_argument("--case", type=int, help="replay this case index")
    p.add_argument("-v", "--verbose", action="store_true", help="print every bad case")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="minillama-fuzz-"))
    try:
        names = args.targets.split(",") if args.targets else None
        if args.target:
            names = [args.target]
        targets = make_targets(root, names)
        if args.real:
            targets.update({k: v for k, v in real_targets(root).items()
                            if names is None or k in names})
        if not targets:
            print("no targets", file=sys.stderr)
            return 2
        if args.case is not None:
            t = targets[args.target]
            r = run_case(t, args.case, args.seed, root / "replay", args.time_limit)
            print(f"{r.target} case {r.index}: {r.status} ({r.seconds * 1e3:.1f} ms)\n"
                  f"  mutation: {r.mutation}\n  result:   {r.detail}")
            return 0 if r.status not in BAD else 1
        order = list(targets)
        tally = {n: collections.Counter() for n in order}
        bad: list[Result] = []
        runner = Runner(targets, args.seed, root, args.time_limit)
        t0 = time.perf_counter()
        per = collections.Counter()
        for k in range(args.cases):
            name = order[k % len(order)]
            r = runner.run(name, per[name])
            per[name] += 1
            tally[name][r.status] += 1
            if r.status in BAD:
                bad.append(r)
                if args.verbose:
                    print(f"BAD {r.target} case {r.index}: {r.status}: {r.mutation} -> "
                          f"{r.detail}", flush=True)
            if (k + 1) % 1000 == 0:
                print(f"... {k + 1} cases, {len(bad)} bad, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        runner.close()
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cmd = "python -m scripts.fuzz_load " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {cmd}")
    print(f"seed {args.seed}, {args.cases} cases in {wall:.0f} s "
          f"({wall / max(args.cases, 1) * 1e3:.1f} ms per case), time limit {args.time_limit} s")
    w = max(len(n) for n in order)
    print(f"{'format':<{w}}  " + "  ".join(f"{s:>9}" for s in ("cases", *STATUSES)))
    total = collections.Counter()
    for n in order:
        total.update(tally[n])
        print(f"{n:<{w}}  {sum(tally[n].values()):>9}  "
              + "  ".join(f"{tally[n][s]:>9}" for s in STATUSES))
    print(f"{'total':<{w}}  {sum(total.values()):>9}  "
          + "  ".join(f"{total[s]:>9}" for s in STATUSES))
    for r in bad[:50]:
        print(f"BAD {r.target} case {r.index}: {r.status}: {r.mutation} -> {r.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
