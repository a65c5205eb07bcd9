"""CONTRIBUTING.md's "Layers: the module map" is the project's one map of its modules: it names
every module of the package and of backends/, so a new module cannot be left out of it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _map_text() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("## Layers: the module map")
    return text[start:text.index("\n## ", start + 1)]


def test_the_module_map_names_every_module():
    named = set(re.findall(r"`([\w./]+\.py)`", _map_text()))
    named |= {Path(n).name for n in named}
    modules = [p for pattern in ("minillama/*/*.py", "backends/*.py", "backends/*/*.py",
                                 "backends/*/*/*.py")
               for p in ROOT.glob(pattern) if p.name != "__init__.py"]
    assert modules
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if p.name not in named)
    assert not missing, f"CONTRIBUTING.md's module map does not name {missing}"


def test_the_map_lives_once():
    """README and backends/README.md link to the map instead of keeping a copy of it."""
    for doc in ("README.md", "backends/README.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        assert "CONTRIBUTING.md" in text, doc
        assert "| folder / file |" not in text and "minillama/         in layers" not in text, doc


def test_the_tests_mirror_the_package():
    """tests/ has a folder per package folder it tests (tests/backends/numba for
    backends/numba, tests/io for minillama/io, ...), plus support/ (what tests and scripts
    share) and project/ (the repository's rules); no test file sits at its top."""
    tests = ROOT / "tests"
    assert not sorted(tests.glob("test_*.py")), "a test file belongs in the folder of its layer"
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = folder.relative_to(tests)
        if rel.parts[0] in ("support", "project"):
            continue
        source = ROOT / rel if rel.parts[0] == "backends" else ROOT / "minillama" / rel
        assert source.is_dir(), f"tests/{rel.as_posix()} mirrors no package folder"
        assert any(folder.glob("test_*.py")), f"tests/{rel.as_posix()} holds no test"
