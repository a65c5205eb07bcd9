"""The ``numba`` backend (derives from ``numpy``): ``backend`` holds the op overrides and the
greedy decoder, ``kernels`` the index of the jitted kernels, which live in ``fastmath`` (flags,
e^x), ``rope``, ``attention`` (forward loops), ``attention_backward``, ``attention_blas`` (tiled
with BLAS) and ``rows`` (cross-entropy, RMSNorm, SwiGLU); ``blas`` OpenBLAS's GEMM called from
kernels, ``gemv`` the small-batch products, ``decode`` the fused decode step, ``optim`` the one-pass
AdamW. The thread count of the decode steps, by measured speed, is ``backends/tuner.py``.
"""

import contextlib
import os

# Numba's parallel kernels run on GNU OpenMP, whose threads spin at each barrier for about 300,000
# iterations before they sleep. A decode step ends a few hundred parallel regions; on a machine
# where other processes want the cores, a thread spinning for a partner that lost its core holds
# that core from everyone. A short spin keeps the quiet speed (measured the same within noise:
# SmolLM2-135M Q4_1, 123 tokens/s either way) and lifts the contended one (31 -> 41 tokens/s with
# two busy processes on two cores; docs/BENCHMARKS.md, "Decode on a busy machine"). Read by
# libgomp when it loads, so set before the first parallel kernel runs; the user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _stamp_kernel_caches() -> None:
    """Key the on-disk cache of every kernel in this folder on all of its sources at once.

    Numba checks a cached kernel against its own file only, yet kernels here inline others from
    sibling files (the row kernels of ``qint8`` compiled into the decode step of ``qdecode``): an
    edit to ``qint8`` alone would leave ``qdecode``'s cached step running the old rows. The
    locators below give every kernel of this folder one stamp, the hash of its ``.py`` files and
    of ``minillama/core/quant.py`` (tables baked into the IR), so any edit recompiles them all."""
    import hashlib

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


_stamp_kernel_caches()
