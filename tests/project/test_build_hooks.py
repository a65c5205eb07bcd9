"""The build backend (``build_hooks.py`` at the repository's root): setuptools' hooks, and an
editable install that compiles the kernels ahead unless ``MINILLAMA_PRECOMPILE=0``, asking for
the package's own dependencies to do it, never failing the install when it cannot."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("setuptools", reason="the build backend wraps setuptools'")
import build_hooks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_every_setuptools_hook_is_there():
    for hook in ("build_wheel", "build_sdist", "build_editable", "get_requires_for_build_wheel",
                 "prepare_metadata_for_build_wheel", "get_requires_for_build_editable"):
        assert callable(getattr(build_hooks, hook)), hook
    with open(ROOT / "pyproject.toml", "rb") as f:
        system = tomllib.load(f)["build-system"]
    assert system["build-backend"] == "build_hooks" and system["backend-path"] == ["."]


@pytest.mark.parametrize("setting, wanted", [(None, True), ("1", True), ("0", False),
                                             ("off", False)])
def test_an_editable_build_compiles_unless_told_not_to(monkeypatch, setting, wanted):
    if setting is None:
        monkeypatch.delenv("MINILLAMA_PRECOMPILE", raising=False)
    else:
        monkeypatch.setenv("MINILLAMA_PRECOMPILE", setting)
    ran = []
    monkeypatch.setattr(build_hooks._setuptools, "build_editable", lambda *a: "x.whl")
    monkeypatch.setattr(build_hooks._setuptools, "get_requires_for_build_editable",
                        lambda *a: ["wheel"])
    monkeypatch.setattr(build_hooks, "_precompile", lambda: ran.append(1))
    assert build_hooks.build_editable("dist") == "x.whl"
    assert ran == ([1] if wanted else [])
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    needs = build_hooks.get_requires_for_build_editable()
    assert needs == ["wheel"] + (deps if wanted else [])


@pytest.mark.parametrize("outcome", ["exit", "oserror"])
def test_a_failed_compile_says_so_and_the_install_goes_on(monkeypatch, capsys, outcome):
    def run(*a, **k):
        if outcome == "oserror":
            raise OSError("no such interpreter")
        return subprocess.CompletedProcess(a, 3)

    monkeypatch.setattr(build_hooks.subprocess, "run", run)
    build_hooks._precompile()  # no exception
    out = capsys.readouterr().out
    assert "failed" in out and "compile on first use" in out


def test_the_compile_process_finds_the_backends_folder_without_the_install():
    """Without ``site`` (so without the editable install's finder), the boot code of the
    compile process maps ``minillama.backends`` to the top-level ``backends/`` folder."""
    site = str(Path(np.__file__).resolve().parents[1])  # numpy's site-packages, no .pth files
    code = (f"import sys; sys.path.append({site!r})\n" + build_hooks._FINDER
            + "import minillama.backends.numba as m; print(m.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == ROOT / "backends" / "numba" / "__init__.py"
