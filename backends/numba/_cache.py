"""The disk cache of the numba backend's kernels, keyed on all their sources at once.

Imported by every module of this folder that compiles kernels, before its first ``@njit``
(Numba picks a kernel's cache locator when the decorator runs); not by the package's
``__init__``, so that importing the backend's module does not import Numba.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys


def _sources(here: str) -> list[str] | None:
    """The files whose text the kernels of folder ``here`` are compiled from: its ``.py`` files
    and ``minillama/core/quant.py``; None where the folder cannot be listed (a zip)."""
    try:
        names = sorted(f for f in os.listdir(here) if f.endswith(".py"))
    except OSError:
        return None
    if not names:
        return None
    files = [os.path.join(here, f) for f in names]
    files.append(os.path.join(here, "..", "..", "minillama", "core", "quant.py"))
    if not os.path.exists(files[-1]):  # installed: minillama.backends beside minillama.core
        files[-1] = os.path.join(here, "..", "..", "core", "quant.py")
    return files


def _stamper(files: list[str]):
    """A function returning the hash of ``files``, recomputed when one changes size or time (a
    long-lived process that edits and reloads a kernel module gets a fresh stamp)."""
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
            for path in files:
                with contextlib.suppress(OSError):
                    with open(path, "rb") as f:
                        digest.update(os.path.basename(path).encode() + b"\0" + f.read())
            memo.clear()
            memo[key] = digest.digest()
        return memo[key]

    return stamp


def _stamped(base, here: str, stamp):
    """``base`` (a Numba locator backed by the source file: NUMBA_CACHE_DIR's, the in-tree
    __pycache__, the user-wide one) for the kernels of folder ``here`` only, with ``stamp()``."""

    class Stamped(base):
        minillama_stamped = True

        def get_source_stamp(self):
            return stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.dirname(os.path.abspath(py_file)) != here:
                return None
            return super().from_function(py_func, py_file)

    Stamped.__name__ = Stamped.__qualname__ = f"MinillamaStamped{base.__name__}"
    return Stamped


def stamp_kernel_caches() -> None:
    """Key the on-disk cache of every kernel in this folder on all of its sources at once.

    Numba checks a cached kernel against its own file only, yet kernels here inline others from
    sibling files (the row kernels of ``qint8`` compiled into the decode step of ``qdecode``): an
    edit to ``qint8`` alone would leave ``qdecode``'s cached step running the old rows. The
    locators installed here give every kernel of this folder one stamp, the hash of its ``.py``
    files and of ``minillama/core/quant.py`` (tables baked into the IR), so any edit recompiles
    them all. (``NUMBA_CACHE_LOCATOR_CLASSES``, which replaces Numba's list of locators, turns
    it off.)"""
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
    stamp = _stamper(files)
    for i in range(len(classes) - 1, -1, -1):  # each before the locator it derives from
        if issubclass(classes[i], mixin):
            classes.insert(i, _stamped(classes[i], here, stamp))


stamp_kernel_caches()
