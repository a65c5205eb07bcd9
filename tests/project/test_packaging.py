"""The wheel (a non-editable ``pip install .``) carries the whole package: the top-level
``backends/`` folder lands as ``minillama.backends`` (with its ``.cu`` kernels), the shipped
weights come along, and nothing named ``backends`` lands at the top of site-packages.

Builds a wheel from a copy of the source tree (no build isolation, so no network: the
setuptools of the ``test`` extra, >= 77 like ``[build-system]``) and reads its file list; ~10 s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                   ".hypothesis", ".pytest_cache", ".benchmarks", "runs", "out",
                                   ".whl", ".device")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    setuptools = pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot read this pyproject.toml "
                    f"(pip install 'setuptools>=77', part of the test extra)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP_DIRS)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not available to build the wheel")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp / "dist").glob("minillama-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def test_backends_folder_installs_as_minillama_backends(wheel_names):
    expected = {f"minillama/backends/{p.relative_to(ROOT / 'backends').as_posix()}"
                for p in (ROOT / "backends").rglob("*")
                if p.suffix in (".py", ".cu") and "__pycache__" not in p.parts}
    assert any(n.endswith("kernels/attention.cu") for n in expected)
    missing = expected - wheel_names
    assert not missing, f"not in the wheel: {sorted(missing)}"


def test_package_modules_and_weights_are_in_the_wheel(wheel_names):
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "minillama").rglob("*.py")
                if "__pycache__" not in p.parts}
    expected |= {p.relative_to(ROOT).as_posix()
                 for p in (ROOT / "minillama" / "weights").glob("*.safetensors")}
    assert "minillama/weights/shakespeare.safetensors" in expected
    missing = expected - wheel_names
    assert not missing, f"not in the wheel: {sorted(missing)}"


def test_nothing_but_minillama_at_the_top(wheel_names):
    tops = {n.split("/", 1)[0] for n in wheel_names}
    assert not any(t == "backends" or t.startswith("backends") for t in tops), tops
    assert {t for t in tops if not t.endswith(".dist-info")} == {"minillama"}


def test_test_machinery_stays_out_of_the_wheel(wheel_names):
    """The load fuzzer is test machinery (tests/support/fuzzing.py), not part of the installed
    package."""
    assert (ROOT / "tests" / "support" / "fuzzing.py").is_file()
    assert not any(n.startswith("tests/") or n.endswith("/fuzz.py") or n.endswith("/fuzzing.py")
                   for n in wheel_names), sorted(n for n in wheel_names if "fuzz" in n)


def test_the_source_distribution_carries_docs_tests_and_scripts(tmp_path):
    """A pip user who fetches the sdist gets the math map, the tests and the benchmarks, and
    the build backend that pyproject.toml names (pip cannot build the sdist without it)."""
    pytest.importorskip("setuptools", reason="building the sdist needs setuptools")
    import tarfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP_DIRS)
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                        "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("minillama-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"docs/MATH.md", "tests/mathmap/test_math_map.py", "scripts/bench_decode.py",
            "minillama/core/ops.py", "backends/cupy/kernels/quant.cu", "build_hooks.py"} <= names
    assert not any("__pycache__" in n for n in names)
