"""The mutation score of the identity catalog: how many one-operator changes of the reference
ops the catalog alone catches.

cosmic-ray (``pip install cosmic-ray``; not a dependency of minillama, and not run in CI: a full
run takes hours) changes one operator or constant of ``minillama/core/ops.py`` (and, with
``--with-reference``, of ``backends/reference.py``) at a time, and for each mutant this script
runs the catalog on the ``reference`` backend (``run_catalog``, no test suite): a mutant is
killed when some identity fails (or the run errs or times out) and survives when every identity
passes. The mutants are made in a copy of the package in a temporary folder, never in the
checkout. ``--sample N`` runs a random sample of N mutants (the score then comes with its 95%
binomial interval).

    python -m scripts.mutation_score --sample 150 --seed 0      # about 10 minutes on 2 cores

The figure, its date and command, and the surviving mutants with the reason each survives are
in docs/IDENTITIES.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the test command of every mutant: the catalog alone on the reference backend; exit 1 at the
#: first identity that fails
CHECK = ("import sys; from minillama.backends import get_backend; "
         "from minillama.identities import CATALOG, run_identity; "
         "be = get_backend('reference'); "
         "sys.exit(any(run_identity(i, be, {examples}, {seed}).status == 'fail' for i in CATALOG))")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", type=int, default=None,
                   help="run a random sample of this many mutants (default: all of them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample and of hypothesis")
    p.add_argument("--examples", type=int, default=10,
                   help="hypothesis examples per identity and mutant")
    p.add_argument("--with-reference", action="store_true",
                   help="mutate backends/reference.py too")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a mutant's catalog run may take (longer: killed)")
    p.add_argument("--keep", type=Path, default=None,
                   help="work in this folder and keep it (default: a temporary one)")
    return p.parse_args(argv)


def copy_package(dest: Path) -> Path:
    """The package copied to ``dest/src`` with ``backends`` inside it as ``minillama/backends``
    (what the installed package holds), compiled caches left out."""
    src = dest / "src"
    if src.exists():
        shutil.rmtree(src)
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "weights", "corpus")
    shutil.copytree(ROOT / "minillama", src / "minillama", ignore=ignore)
    shutil.copytree(ROOT / "backends", src / "minillama" / "backends", ignore=ignore)
    return src


def write_config(work: Path, module: str, args) -> Path:
    command = [sys.executable, "-c", CHECK.format(examples=args.examples, seed=args.seed)]
    cfg = work / f"{Path(module).stem}.toml"
    quoted = " ".join("'" + c.replace("'", "'\"'\"'") + "'" for c in command)
    cfg.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {args.timeout}\n'
                   f'excluded-modules = []\ntest-command = "{_toml(quoted)}"\n\n'
                   f'[cosmic-ray.distributor]\nname = "local"\n', encoding="utf-8")
    return cfg


def _toml(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def sample(session: Path, n: int | None, seed: int) -> int:
    """Keep a random ``n`` of the session's pending mutants; returns how many remain."""
    db = sqlite3.connect(session)
    ids = [r[0] for r in db.execute("select job_id from work_items")]
    if n is not None and n < len(ids):
        drop = set(ids) - set(random.Random(seed).sample(ids, n))
        db.executemany("delete from mutation_specs where job_id = ?", [(j,) for j in drop])
        db.executemany("delete from work_items where job_id = ?", [(j,) for j in drop])
        db.commit()
    count = db.execute("select count(*) from work_items").fetchone()[0]
    db.close()
    return count


def outcomes(session: Path) -> list[tuple]:
    """(outcome, file, line, operator, function) of every mutant run."""
    db = sqlite3.connect(session)
    rows = db.execute(
        "select r.test_outcome, m.module_path, m.start_pos_row, m.operator_name, m.definition_name"
        " from work_results r join mutation_specs m on r.job_id = m.job_id").fetchall()
    db.close()
    return rows


def interval(k: int, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def run(args) -> int:
    if shutil.which("cosmic-ray") is None:
        print("mutation_score: needs cosmic-ray: pip install cosmic-ray", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="minillama-mutants-"))
    work.mkdir(parents=True, exist_ok=True)
    src = copy_package(work)
    env = {**os.environ, "PYTHONPATH": str(src)}
    modules = ["src/minillama/core/ops.py"]
    if args.with_reference:
        modules.append("src/minillama/backends/reference.py")
    rows = []
    for module in modules:
        cfg, session = write_config(work, module, args), work / f"{Path(module).stem}.sqlite"
        session.unlink(missing_ok=True)
        subprocess.run(["cosmic-ray", "init", str(cfg), str(session)], cwd=work, env=env,
                       check=True)
        n = sample(session, args.sample, args.seed)
        print(f"{module}: running {n} mutants", flush=True)
        subprocess.run(["cosmic-ray", "exec", str(cfg), str(session)], cwd=work, env=env,
                       check=True)
        rows += outcomes(session)
    report(rows)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(rows: list[tuple]) -> None:
    killed = [r for r in rows if str(r[0]).lower() != "survived"]
    survived = sorted(r for r in rows if str(r[0]).lower() == "survived")
    lo, hi = interval(len(killed), len(rows))
    score = 100 * len(killed) / max(len(rows), 1)
    print(f"{len(killed)} of {len(rows)} mutants killed ({score:.1f}%, 95% interval "
          f"{100 * lo:.1f}-{100 * hi:.1f}%); survivors:")
    for _, path, line, op, fn in survived:
        print(f"  {Path(path).name}:{line} {fn}: {op}")


if __name__ == "__main__":
    sys.exit(run(parse_args()))
