"""``--threads``: every command takes it, it sizes every CPU pool (the backend's kernels, OpenBLAS,
the numpy backend's row threads), and the speed line names the count that ran."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from minillama.backends import THREAD_VARS, get_backend, openblas_api, set_threads, threads_in_use
from minillama.cli.main import build_parser
from minillama.core.errors import MinillamaError


def _commands():
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise AssertionError("no commands")


def test_every_command_takes_threads():
    commands = _commands()
    assert len(commands) >= 10
    for name, parser in commands.items():
        opts = {o for a in parser._actions for o in a.option_strings}
        assert "--threads" in opts, name


def test_set_threads_sizes_the_pools(monkeypatch):
    for var in THREAD_VARS:
        monkeypatch.setenv(var, "7")  # restored after the test
    api = openblas_api()
    before = api[0]() if api is not None else None
    numba = sys.modules.get("numba")
    numba_before = numba.get_num_threads() if numba is not None else None
    try:
        set_threads(1)
        assert all(os.environ[v] == "1" for v in THREAD_VARS)
        if api is not None:
            assert api[0]() == 1
        assert threads_in_use(get_backend("numpy")) == 1
        if numba is not None:
            assert numba.get_num_threads() == 1
    finally:
        if api is not None:
            api[1](before)
        if numba is not None:
            numba.set_num_threads(numba_before)
    with pytest.raises(MinillamaError, match="at least 1"):
        set_threads(0)


@pytest.mark.parametrize("backend,n", [("numpy", 1), ("numba", 1), ("numpy", 2)])
def test_the_speed_line_names_the_threads_that_ran(backend, n):
    """In a fresh process (the flag sets process-wide pools)."""
    pytest.importorskip("numba") if backend == "numba" else None
    r = subprocess.run([sys.executable, "-m", "minillama", "generate", "-n", "4", "--backend",
                        backend, "--threads", str(n), "--prompt", "ROMEO:"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"backend {backend}, {n} thread{'s' if n > 1 else ''}" in line, line


def test_threads_zero_is_one_line_and_status_2():
    r = subprocess.run([sys.executable, "-m", "minillama", "quantize", "a", "b", "--type", "Q8_0",
                        "--threads", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--threads" in r.stderr and "positive integer" in r.stderr
