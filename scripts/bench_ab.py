#!/usr/bin/env python
"""The cost of a change, as users get it: this checkout against an earlier commit (``--base``) on
the same GGUF file, batch-1 decode (``tg``) and prompt processing (``pp``) in tokens/s with
default flags, the two taking turns (base, head, base, head, ...) so that both see the same
background load, and llama.cpp's ``llama-bench`` in the same loop where ``--llama-cpp`` names
its folder, so each side's ratio to the peer comes from the same minutes.

    python -m scripts.bench_ab --base fc84bee --gguf SmolLM2-135M-Instruct.Q4_1.gguf --reps 5 \\
        --llama-cpp ~/llama.cpp/build/bin

The base commit is checked out with ``git worktree`` into a temporary folder (removed after) and
imported from there; each measurement is a fresh process of :mod:`scripts.bench_gguf`'s child
(its kernels compile once per tree, in a first run that is not counted). Prints the medians,
head / base, and each side / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench_gguf import run_llama_bench

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True,
                    help="the commit to compare against, or the folder of a checkout of it (kept, "
                         "its compiled kernels with it)")
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF file")
    ap.add_argument("--reps", type=int, default=5, help="measurements of each side (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default %(default)s)")
    ap.add_argument("--tg", type=int, default=128, help="decoded tokens (default %(default)s)")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (default %(default)s)")
    ap.add_argument("--llama-cpp", type=Path, help="folder of llama-bench (optional)")
    return ap.parse_args(argv)


def worktree(rev: str, where: Path) -> Path:
    """A checkout of ``rev`` at ``where``, importable as ``minillama`` (its ``backends`` folder
    linked where the installed package has it)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
                   check=True, capture_output=True)
    link = where / "minillama" / "backends"
    if not link.exists():
        link.symlink_to(Path("..") / "backends")
    return where


def measure(tree: Path, args) -> dict:
    """One fresh child process of :mod:`scripts.bench_gguf` importing ``tree``'s minillama."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "scripts.bench_gguf", "--child", str(args.gguf.resolve()),
           "--threads", str(args.threads), "--tg", str(args.tg), "--pp", str(args.pp)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench_ab: error: {tree}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_for_compiles() -> None:
    """Until no background compile of the several-row kernel (``rows_compile``, which a first
    run starts) is left running: it would take CPU from the runs measured."""
    def running():
        return subprocess.run(["pgrep", "-f", "numba.rows_compile"],
                              capture_output=True).returncode == 0

    while running():
        time.sleep(5)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        given = Path(args.base).is_dir()
        base = Path(args.base).resolve() if given else worktree(args.base, Path(tmp) / "base")
        try:
            sides = {"base": base, "head": ROOT}
            for tree in sides.values():  # compile (or load) each tree's kernels, not counted
                measure(tree, args)
            wait_for_compiles()
            runs = {k: [] for k in (*sides, "llama.cpp")}
            for i in range(args.reps):
                for name, tree in sides.items():
                    runs[name].append(measure(tree, args))
                    print(f"rep {i + 1} {name}: {runs[name][-1]}", flush=True)
                if args.llama_cpp:
                    runs["llama.cpp"].append(run_llama_bench(args.gguf, args))
                    print(f"rep {i + 1} llama.cpp: {runs['llama.cpp'][-1]}", flush=True)
        finally:
            if not given:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(base)], check=False, capture_output=True)
    print(f"\n{args.gguf.name}, {args.threads} threads, medians of {args.reps} alternating runs "
          f"(tokens/s)")
    print("| test | base | head | head / base | base / llama.cpp | head / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for test in ("tg", "pp"):
        med = {k: statistics.median(r[test] for r in v) for k, v in runs.items() if v}
        peer = med.get("llama.cpp")
        rel = (f"{med['base'] / peer:.2f} | {med['head'] / peer:.2f}" if peer else "- | -")
        print(f"| {test}{args.tg if test == 'tg' else args.pp} | {med['base']:.1f} | "
              f"{med['head']:.1f} | {med['head'] / med['base']:.3f} | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
