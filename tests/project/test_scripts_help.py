"""Every script under scripts/, run as ``python -m scripts.NAME`` from the repository's root,
answers ``--help`` with its usage and status 0 (its options parse, its imports resolve), and
``profile_step.py`` refuses a missing mode in one usage error: a benchmark broken by a rename is
caught here, not on the machine that runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
NAMES = sorted(p.name for p in SCRIPTS.glob("*.py") if not p.name.startswith("_"))


def test_one_bench_per_job():
    assert {"bench_decode.py", "bench_train.py", "bench_ops.py", "bench_gpu.py", "bench_dp.py",
            "profile_step.py"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_help(name):
    r = subprocess.run([sys.executable, "-m", f"scripts.{Path(name).stem}", "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_profile_step_needs_a_mode():
    r = subprocess.run([sys.executable, "-m", "scripts.profile_step"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "train" in r.stderr and "decode" in r.stderr
