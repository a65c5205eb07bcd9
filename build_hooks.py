"""The package's build backend: setuptools', with one step more for an editable install.

``pip install -e .`` then compiles the numba kernels that ``generate``, ``chat`` and ``serve``
run into Numba's disk cache beside the sources, for this machine's CPU (what ``minillama
compile`` does; :mod:`minillama.infer.precompile`), so that the first answer does not wait about
40 s for the compiler. It takes about 8 min on two cores, in pip's build environment (to which
it adds the package's own dependencies: the versions pip resolves for the install too, unless
the environment pins another Numba, whose cache would not read these kernels); pip shows its
lines with ``-v``. ``MINILLAMA_PRECOMPILE=0`` skips it; a failure is reported and never fails the
install (the kernels then compile on first use, as they would anyway). A wheel (``pip install
.``) is built as setuptools builds it: its kernels compile on first use or with ``minillama
compile``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every hook setuptools defines, unchanged)

ROOT = Path(__file__).resolve().parent


def _wanted() -> bool:
    return os.environ.get("MINILLAMA_PRECOMPILE", "1").strip().lower() not in ("0", "no", "off",
                                                                               "false")


def get_requires_for_build_editable(config_settings=None):
    """setuptools' requirements and, to compile the kernels, the package's own dependencies."""
    needs = list(_setuptools.get_requires_for_build_editable(config_settings))
    if _wanted():
        with open(ROOT / "pyproject.toml", "rb") as f:
            needs += tomllib.load(f)["project"]["dependencies"]
    return needs


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """setuptools' editable wheel, then the kernels compiled into the cache (unless skipped)."""
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    if _wanted():
        _precompile()
    return name


#: run in a fresh interpreter of the build environment: the sources as the editable install maps
#: them (``minillama.backends`` is the top-level ``backends/`` folder), then the compile
_FINDER = """
import importlib.util, sys
root = sys.argv[1]

class Backends:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "minillama.backends":
            return None
        return importlib.util.spec_from_file_location(
            name, root + "/backends/__init__.py", submodule_search_locations=[root + "/backends"])

sys.meta_path.insert(0, Backends)
sys.path.insert(0, root)
"""
_BOOT = _FINDER + """
from minillama.infer.precompile import precompile
import numba
print(f"minillama: kernels compiled in {precompile():.1f} s for numba {numba.__version__}",
      flush=True)
"""


def _precompile() -> None:
    print("minillama: compiling the numba kernels of generate, chat and serve for this CPU "
          "(once; MINILLAMA_PRECOMPILE=0 skips) ...", flush=True)
    try:
        r = subprocess.run([sys.executable, "-c", _BOOT, str(ROOT)], cwd=ROOT, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"minillama: compiling the kernels ahead failed ({e}); they compile on first use",
              flush=True)
        return
    if r.returncode != 0:
        print(f"minillama: compiling the kernels ahead failed (exit status {r.returncode}); they "
              "compile on first use", flush=True)
