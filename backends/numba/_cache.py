"""The disk cache of the numba backend's kernels, keyed on all their sources at once, its writes
locked across processes; and the CPU features the kernels compile for.

Imported by every module of this folder and its subfolders that compiles kernels, before its
first ``@njit`` (Numba picks a kernel's cache locator when the decorator runs); not by the
package's ``__init__``, so that importing the backend's module does not import Numba.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys


def target_features() -> str:
    """The CPU features the kernels compile for, as Numba decides them: ``NUMBA_CPU_FEATURES``
    where set, else the host's ("" where LLVM cannot say): what the IR written by hand may
    assume (VNNI and GFNI dots, AVX-512 permutes, half conversions; its cache is keyed on the
    same)."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    try:
        from llvmlite import binding

        return binding.get_host_cpu_features().flatten()
    except Exception:  # no feature string: the portable code
        return ""


def _sources(here: str) -> list[str] | None:
    """The files whose text the kernels under folder ``here`` are compiled from: the ``.py``
    files of the folder and of its subfolders (``floats/``, ``quant/``, ``decode/``), in a fixed
    order, and ``minillama/core/quant.py``; None where the folder cannot be listed (a zip)."""
    files = []
    for root, dirs, names in os.walk(here):  # a folder that cannot be listed yields nothing
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(root, f) for f in sorted(names) if f.endswith(".py")]
    if not files:
        return None
    files.append(os.path.join(here, "..", "..", "minillama", "core", "quant.py"))
    if not os.path.exists(files[-1]):  # installed: minillama.backends beside minillama.core
        files[-1] = os.path.join(here, "..", "..", "core", "quant.py")
    return files


def _stamper(files: list[str], here: str):
    """A function returning the hash of ``files`` (each named by its path under ``here``, the
    one outside it by its file name), recomputed when one changes size or time (a long-lived
    process that edits and reloads a kernel module gets a fresh stamp)."""
    names = [_name(path, here) for path in files]
    memo = {}

    def stamp():
        key = []
        for path in files:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                key.append((path, st.st_mtime_ns, st.st_size))
        key = tuple(key)
        if key not in memo:
            digest = hashlib.sha256()
            for path, name in zip(files, names):
                with contextlib.suppress(OSError):
                    with open(path, "rb") as f:
                        digest.update(name.encode() + b"\0" + f.read())
            memo.clear()
            memo[key] = digest.digest()
        return memo[key]

    return stamp


def _name(path: str, here: str) -> str:
    """``path`` as the stamp names it: relative to ``here`` with ``/`` (``quant/int8_dots.py``),
    or its file name when it lies outside (``quant.py``, the table of the block types)."""
    if not _under(path, here):
        return os.path.basename(path)
    return os.path.relpath(path, here).replace(os.sep, "/")


def _under(path: str, here: str) -> bool:
    """Whether file ``path`` lies in folder ``here`` or one of its subfolders."""
    return os.path.abspath(path).startswith(here + os.sep)


def _stamped(base, here: str, stamp):
    """``base`` (a Numba locator backed by the source file: NUMBA_CACHE_DIR's, the in-tree
    __pycache__, the user-wide one) for the kernels under folder ``here`` only (its subfolders
    included), with ``stamp()``."""

    class Stamped(base):
        minillama_stamped = True

        def get_source_stamp(self):
            return stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _under(py_file, here):
                return None
            return super().from_function(py_func, py_file)

    Stamped.__name__ = Stamped.__qualname__ = f"MinillamaStamped{base.__name__}"
    return Stamped


def stamp_kernel_caches() -> None:
    """Key the on-disk cache of every kernel under this folder on all of its sources at once.

    Numba checks a cached kernel against its own file only, yet kernels here inline others from
    other files (the row kernels of ``quant/int8_dots.py`` compiled into the decode step of
    ``decode/quant_step.py``): an edit to ``int8_dots`` alone would leave ``quant_step``'s cached
    step running the old rows. The locators installed here give every kernel of this folder and its
    subfolders one stamp, the hash of all their ``.py`` files and of ``minillama/core/quant.py``
    (tables baked into the IR), so any edit recompiles them all. (``NUMBA_CACHE_LOCATOR_CLASSES``,
    which replaces Numba's list of locators, turns it off.)"""
    try:
        from numba.core import caching
        mixin, classes = caching._SourceFileBackedLocatorMixin, caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):  # no Numba, or one without the hook: its own stamps
        return
    if getattr(sys, "frozen", False) or any(getattr(k, "minillama_stamped", False)
                                            for k in classes):
        return  # a frozen app (Numba stamps it by its executable), or done already
    here = os.path.dirname(os.path.abspath(__file__))
    files = _sources(here)
    if files is None:  # Numba's own stamps
        return
    stamp = _stamper(files, here)
    for i in range(len(classes) - 1, -1, -1):  # each before the locator it derives from
        if issubclass(classes[i], mixin):
            classes.insert(i, _stamped(classes[i], here, stamp))


def lock_cache_writes() -> None:
    """Make each write of Numba's disk cache exclusive across processes and threads.

    Numba saves a kernel's new signature by reading the kernel's index, choosing the first free
    data-file number, and writing the index and the data file, unlocked. Two processes saving
    two signatures of one kernel at once (a worker compiling the several-rows decode step while
    the command compiles its prompt's kernels, both reaching a shared callee) can both take
    number 1: the index then pairs one signature with the other's code. Each save here holds an
    exclusive ``flock`` on a ``numba-cache.lock`` file in the cache's folder while it runs
    (POSIX; elsewhere Numba's own, unlocked saves)."""
    try:
        import fcntl

        from numba.core import caching
        cls = caching.IndexDataCacheFile
    except (ImportError, AttributeError):
        return
    if not getattr(cls.save, "minillama_locked", False):
        cls.save = _locked(cls.save, fcntl)


def _locked(save, fcntl):
    """``save(self, key, data)`` under an exclusive lock of ``self._cache_path``'s lock file."""
    def locked_save(self, key, data):
        with open(os.path.join(self._cache_path, "numba-cache.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    locked_save.minillama_locked = True
    return locked_save


stamp_kernel_caches()
lock_cache_writes()
