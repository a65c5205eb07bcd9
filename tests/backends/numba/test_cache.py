"""The on-disk cache of the numba backend's kernels is keyed on all of their sources at once
(backends/numba/_cache.py): a kernel compiled into another from another file (quant/int8_dots.py's
rows inside decode/quant_step.py's decode step) must not outlive an edit of that file in the
cache, whichever subfolder it lies in."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba", reason="the numba backend")


def _kernel_files(folder):
    """(name, path) of every .py file of ``folder`` and its subfolders, the folder's own first,
    then each subfolder's in name order; names relative to ``folder``."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(names):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                found.append((os.path.relpath(path, folder).replace(os.sep, "/"), path))
    return found


def _stamp_of_files(folder):
    quant = os.path.join(folder, "..", "..", "minillama", "core", "quant.py")
    if not os.path.exists(quant):
        quant = os.path.join(folder, "..", "..", "core", "quant.py")
    digest = hashlib.sha256()
    for name, path in [*_kernel_files(folder), ("quant.py", quant)]:
        with open(path, "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.digest()


def test_kernels_share_one_stamp_over_every_source_of_the_folder():
    from numba import njit
    from numba.core.caching import FunctionCache

    import minillama.backends.numba as pkg
    from minillama.backends.numba.decode import quant_step as qdecode
    from minillama.backends.numba.quant import int8_dots as qint8

    folder = os.path.dirname(os.path.abspath(pkg.__file__))
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
    dispatcher of every module in backends/numba and its subfolders has a stamped locator."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import minillama.backends.numba as pkg

    seen = 0
    for mod in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        m = importlib.import_module(mod.name)
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
    a module with an ``@njit`` imports ``_cache`` at module level, above its first one (``from .
    import _cache`` in the folder, ``from .. import _cache`` in a subfolder)."""
    import ast

    import minillama.backends.numba as pkg

    folder = os.path.dirname(os.path.abspath(pkg.__file__))
    for name, path in _kernel_files(folder):
        if name == "_cache.py":
            continue
        level = name.count("/") + 1  # the dots that reach backends/numba from the module
        tree = ast.parse(open(path, encoding="utf-8").read())
        jits = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(
            "njit" in ast.unparse(d) for d in n.decorator_list)]
        stamps = [n.lineno for n in tree.body if isinstance(n, ast.ImportFrom)
                  and n.level == level and n.module is None
                  and any(a.name == "_cache" for a in n.names)]
        if jits:
            assert stamps, f"{name} compiles kernels without importing ._cache"
            assert stamps[0] < min(n.lineno for n in jits), f"{name}: ._cache after an @njit"


def test_numba_cache_dir_still_chooses_where_kernels_are_cached(tmp_path, monkeypatch):
    """With NUMBA_CACHE_DIR set the stamped locator is NUMBA_CACHE_DIR's, not the in-tree one."""
    from numba.core import caching, config

    from minillama.backends.numba.quant import int8_dots as qint8

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    locator = caching.FunctionCache(qint8.quantize_row.py_func)._impl.locator
    assert getattr(locator, "minillama_stamped", False)
    assert locator.get_cache_path().startswith(str(tmp_path))


_KERNEL = '''
from numba import njit

from .. import _cache  # noqa: F401  (the stamp, before any @njit)


@njit(cache=True)
def add_one(x):
    return x + 1
'''

_RUN = '''
from kernels.sub import kern

kern.add_one(1)
stats = kern.add_one.stats
locator = kern.add_one._cache._impl.locator
print(getattr(locator, "minillama_stamped", False), sum(stats.cache_hits.values()),
      sum(stats.cache_misses.values()))
'''


def test_an_edit_in_a_subfolder_changes_the_stamp_and_recompiles(tmp_path):
    """The stamp walks the subfolders: editing a file of one subfolder (here one no kernel
    imports) changes it, and a kernel of another subfolder, cached before, compiles again."""
    from minillama.backends.numba import _cache

    root = tmp_path / "kernels"
    for folder in (root, root / "sub", root / "other"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    shutil.copy(_cache.__file__, root / "_cache.py")
    (root / "sub" / "kern.py").write_text(_KERNEL)
    table = root / "other" / "table.py"
    table.write_text("SCALE = 1\n")

    files = _cache._sources(str(root))
    assert str(table) in files and str(root / "sub" / "kern.py") in files
    before = _cache._stamper(files, str(root))()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_RUN)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        stamped, hits, misses = done.stdout.split()
        assert stamped == "True"
        return int(hits), int(misses)

    assert run() == (0, 1)  # compiled and cached
    assert run() == (1, 0)  # read from the cache
    table.write_text("SCALE = 2  # an edit in another subfolder\n")
    assert _cache._stamper(_cache._sources(str(root)), str(root))() != before
    assert run() == (0, 1)  # the stamp changed: compiled again


def test_cache_writes_exclude_each_other(tmp_path):
    """Numba's saves of the kernels' cache hold an exclusive lock of the cache's folder: two
    writers (threads here; processes alike) never save at once, so neither pairs its signature
    with the other's data file."""
    fcntl = pytest.importorskip("fcntl", reason="POSIX file locks")
    import threading
    import time

    from numba.core import caching

    from minillama.backends.numba import _cache

    assert caching.IndexDataCacheFile.save.minillama_locked  # installed with the kernels
    inside, most = [0], [0]

    def save(self, key, data):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # room for the other writer to come in, were it not locked out
        inside[0] -= 1

    class Index:
        _cache_path = str(tmp_path)

    locked = _cache._locked(save, fcntl)
    writers = [threading.Thread(target=lambda: [locked(Index(), k, None) for k in range(5)])
               for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert most[0] == 1 and (tmp_path / "numba-cache.lock").exists()
