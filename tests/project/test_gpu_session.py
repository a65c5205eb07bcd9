"""scripts/gpu_session.sh (every GPU check and benchmark, run on a lent GPU) checked without a
GPU: its bash parses, ``--dry-run`` lists every phase's commands, and each command names files,
scripts, options and phases that exist (a typo here would cost device time there)."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _dry(tmp_path, *phases) -> list[list[str]]:
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", *phases], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    return [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("$ ")]


def test_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_unknown_phase_is_one_line_and_status_2(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "bench"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "unknown phase 'bench'" in r.stderr


DEFAULT = ("setup", "tests", "quant", "train", "decode", "serve", "cli", "attention")


def test_bad_budget_is_one_line_and_status_2(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--budget", "soon"], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip() == "gpu_session: --budget needs seconds"


def test_a_spent_budget_skips_every_command(tmp_path):
    """Past its budget the script runs nothing more (each command says it was skipped) and still
    ends every phase, so one device call never outlives its timeout."""
    r = subprocess.run(["bash", str(SCRIPT), "--budget", "0", "tests", "train", "cli"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    commands = [line for line in r.stdout.splitlines() if line.startswith("$ ")]
    assert commands and r.stdout.count("# skipped: the budget is spent") == len(commands)
    assert r.stdout.count("## phase ") == 6  # each phase starts and ends


def test_dry_run_names_what_exists(tmp_path):
    default = _dry(tmp_path / "default")
    # one log per phase, at most 8: what one device call brings back
    assert {p.name for p in (tmp_path / "default").iterdir()} == {f"{p}.log" for p in DEFAULT}
    cmds = _dry(tmp_path / "all", *DEFAULT, "retrain")
    assert cmds[:len(default)] == default
    assert len(list((tmp_path / "all").iterdir())) == 9
    assert any("scripts.bench_gguf" in c and "cupy" in c for c in cmds)
    assert any("scripts.bench_serve" in c and "cupy" in c for c in cmds)
    seen_scripts, seen_tests = set(), set()
    snippets = [c[c.index("-c") + 1] for c in cmds if len(c) > 2 and "-c" in c[1:2]]
    assert snippets
    for code in snippets:  # every inline Python snippet compiles, and its imports resolve
        compile(code, "<gpu_session.sh>", "exec")
        _check_project_imports(code)
    for cmd in cmds:
        for word in cmd:
            if re.fullmatch(r"tests/[\w/]*test_\w+\.py", word):
                assert (REPO / word).is_file(), word
                seen_tests.add(word)
        if cmd[1:2] == ["-m"] and cmd[2].startswith("scripts."):
            seen_scripts.add(cmd[2])
            # the options it passes exist: argparse accepts them (parse only, no GPU needed)
            mod = importlib.import_module(cmd[2])
            if hasattr(mod, "parse_args"):
                mod.parse_args(cmd[3:])
    assert "scripts.bench_gpu" in seen_scripts
    # the attention sweep and the training/decode tables are both scripts.bench_gpu runs
    gpu_runs = [c[3:] for c in cmds if c[1:3] == ["-m", "scripts.bench_gpu"]]
    assert any("--attention" in c for c in gpu_runs) and any("--attention" not in c
                                                               for c in gpu_runs)
    assert {"tests/backends/cupy/test_backend.py",
            "tests/backends/cupy/test_cuda_graph_cli.py",
            "tests/backends/cupy/test_mixed_precision.py"} <= seen_tests
    # the CLI commands parse with minillama's own parser (flags and choices exist)
    from minillama.cli.main import build_parser

    parser = build_parser()
    clis = [c[3:] for c in cmds if c[1:3] == ["-m", "minillama"]]
    assert {c[0] for c in clis} == {"generate", "train"}
    for argv in clis:
        args = parser.parse_args(argv)
        assert args.func is not None
    assert any("--cuda-graph" in c and "on" in c for c in clis)
    assert {c[c.index("--precision") + 1] for c in clis if "--precision" in c} == \
        {"fp32", "bf16"}
    retrain = [c for c in clis if "--export" in c]
    assert len(retrain) == 1
    from minillama.core.config import ModelConfig

    a = parser.parse_args(retrain[0])
    n = ModelConfig(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                    vocab_size=258, max_seq_len=a.context).n_params()
    assert 2 * n < 16 * 2 ** 20  # its float16 export comes back through $OUT (16 MiB a file)
    assert a.dim // a.n_heads in (64, 128)  # the tensor-core attention's head dimensions


def _check_project_imports(code: str) -> None:
    """Every ``from minillama... import name`` of a snippet names a module and a name that
    exist here (a moved module would otherwise fail only on the GPU machine)."""
    import ast
    import importlib
    import importlib.util

    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minillama"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}") is not None, (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("minillama"):
                    importlib.import_module(alias.name)
