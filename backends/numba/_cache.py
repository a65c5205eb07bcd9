"""The disk cache of the numba backend's kernels, keyed on all their sources at once.

Imported by every module of this folder that compiles kernels, before its first ``@njit``
(Numba picks a kernel's cache locator when the decorator runs); not by the package's
``__init__``, so that importing the backend's module does not import Numba.
"""

from __future__ import annotations

import contextlib
import hashlib
import os


def stamp_kernel_caches() -> None:
    """Key the on-disk cache of every kernel in this folder on all of its sources at once.

    Numba checks a cached kernel against its own file only, yet kernels here inline others from
    sibling files (the row kernels of ``qint8`` compiled into the decode step of ``qdecode``): an
    edit to ``qint8`` alone would leave ``qdecode``'s cached step running the old rows. The
    locators below give every kernel of this folder one stamp, the hash of its ``.py`` files and
    of ``minillama/core/quant.py`` (tables baked into the IR), so any edit recompiles them all."""
    try:
        from numba.core import caching
        mixin, classes = caching._SourceFileBackedLocatorMixin, caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):  # no Numba, or one without the hook: its own stamps
        return
    if any(getattr(k, "minillama_stamped", False) for k in classes):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py"))
    files.append(os.path.join(here, "..", "..", "minillama", "core", "quant.py"))
    if not os.path.exists(files[-1]):  # installed: minillama.backends beside minillama.core
        files[-1] = os.path.join(here, "..", "..", "core", "quant.py")
    digest = hashlib.sha256()
    for path in files:
        with contextlib.suppress(OSError):
            with open(path, "rb") as f:
                digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    stamp = digest.digest()

    def stamped(base):
        """``base`` (a locator backed by the source file: NUMBA_CACHE_DIR's, the in-tree
        __pycache__, the user-wide one) for the kernels of this folder only, with one stamp."""

        class Stamped(base):
            minillama_stamped = True

            def get_source_stamp(self):
                return stamp

            @classmethod
            def from_function(cls, py_func, py_file):
                if os.path.dirname(os.path.abspath(py_file)) != here:
                    return None
                return super().from_function(py_func, py_file)

        Stamped.__name__ = Stamped.__qualname__ = f"MinillamaStamped{base.__name__}"
        return Stamped

    for i in range(len(classes) - 1, -1, -1):  # each before the locator it derives from
        if issubclass(classes[i], mixin):
            classes.insert(i, stamped(classes[i]))


stamp_kernel_caches()
