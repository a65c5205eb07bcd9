"""The on-disk cache of the numba backend's kernels is keyed on all of their sources at once
(backends/numba/_cache.py): a kernel compiled into another from a sibling file (qint8's rows
inside qdecode's decode step) must not outlive an edit of that file in the cache."""

from __future__ import annotations

import hashlib
import os

import pytest

pytest.importorskip("numba", reason="the numba backend")


def _stamp_of_files(folder):
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))
    quant = os.path.join(folder, "..", "..", "minillama", "core", "quant.py")
    if not os.path.exists(quant):
        quant = os.path.join(folder, "..", "..", "core", "quant.py")
    digest = hashlib.sha256()
    for path in [*files, quant]:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.digest()


def test_kernels_share_one_stamp_over_every_source_of_the_folder():
    from numba import njit
    from numba.core.caching import FunctionCache

    from minillama.backends.numba import qdecode, qint8

    folder = os.path.dirname(os.path.abspath(qint8.__file__))
    step = qdecode.decode_step_one_q_kernel._cache._impl.locator
    rows = qint8.quantize_row._cache._impl.locator
    assert step.get_source_stamp() == rows.get_source_stamp() == _stamp_of_files(folder)

    def elsewhere(x):  # a kernel outside the folder keeps Numba's own stamp of its file
        return x

    own = FunctionCache(njit(elsewhere).py_func)._impl.locator
    assert not getattr(own, "minillama_stamped", False)
    assert own.get_source_stamp() != step.get_source_stamp()


def test_every_cached_kernel_of_the_folder_is_stamped():
    """Each module that compiles kernels imports the stamp before its first @njit: every cached
    dispatcher of every module in backends/numba has a stamped locator."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import minillama.backends.numba as pkg

    seen = 0
    for mod in pkgutil.iter_modules(pkg.__path__):
        m = importlib.import_module(f"{pkg.__name__}.{mod.name}")
        for name, obj in vars(m).items():
            if isinstance(obj, Dispatcher) and obj.__module__ == m.__name__ and obj._cache:
                impl = getattr(obj._cache, "_impl", None)
                if impl is None:  # a dispatcher without caching
                    continue
                assert getattr(impl.locator, "minillama_stamped", False), f"{mod.name}.{name}"
                seen += 1
    assert seen > 50


def test_every_kernel_module_imports_the_stamp_at_its_top():
    """Read statically (in one process the first module's import installs the stamp for all):
    a module with an ``@njit`` imports ``_cache`` at module level, above its first one."""
    import ast

    from minillama.backends.numba import qint8

    folder = os.path.dirname(os.path.abspath(qint8.__file__))
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name == "_cache.py":
            continue
        tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
        jits = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(
            "njit" in ast.unparse(d) for d in n.decorator_list)]
        stamps = [n.lineno for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1
                  and n.module is None and any(a.name == "_cache" for a in n.names)]
        if jits:
            assert stamps, f"{name} compiles kernels without importing ._cache"
            assert stamps[0] < min(n.lineno for n in jits), f"{name}: ._cache after an @njit"


def test_numba_cache_dir_still_chooses_where_kernels_are_cached(tmp_path, monkeypatch):
    """With NUMBA_CACHE_DIR set the stamped locator is NUMBA_CACHE_DIR's, not the in-tree one."""
    from numba.core import caching, config

    from minillama.backends.numba import qint8

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    locator = caching.FunctionCache(qint8.quantize_row.py_func)._impl.locator
    assert getattr(locator, "minillama_stamped", False)
    assert locator.get_cache_path().startswith(str(tmp_path))
