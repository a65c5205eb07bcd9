"""The backend seam: choose where the model's arrays live and which kernels run its ops.

A backend is an object with

* ``name`` and ``xp``, the array module (``numpy`` or ``cupy``) that holds parameters and
  activations;
* one attribute per named op, ``<op>_forward`` / ``<op>_backward`` for ``embedding``, ``linear``,
  ``rmsnorm``, ``rope``, ``attention``, ``swiglu`` and ``cross_entropy``, with the signatures of
  :mod:`minillama.core.ops` (the reference math). A backend replaces only the pairs it makes faster;
  the rest are inherited (``reference`` is the plain ops; ``numpy`` overrides most of them with
  the threaded CPU path and ``numba`` derives from it; ``cupy`` derives from ``reference``);
* helpers ``asarray``, ``to_numpy`` and ``synchronize``;
* the optional abilities (``decode_step``, ``greedy_steps``, ``exact_products``, ``adamw_update``,
  ...), each declared once on ``reference`` with the answer of a backend that lacks it
  (:data:`~minillama.backends.reference.ABILITIES`), so callers use them as plain attributes.

Every backend class derives from ``reference``'s (an object standing in for one, like the mixed
precision wrapper, forwards to a backend that does).

Backends are named in :data:`BACKENDS` and imported only when chosen, so ``import minillama``
never imports CuPy nor compiles Numba code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix

# what the layers above use of the backends' internals, named here so they import only this
# package: the mixed-precision wrapper of training and OpenBLAS's thread control
from .cupy.mixed_precision import PRECISIONS, check_precision, with_precision
from .numpy.threads import openblas_api
from .reference import ABILITIES

__all__ = ["ABILITIES", "BACKENDS", "ENV_VAR", "AUTO_REFERENCE_MAX_PARAMS", "HELPERS",
           "PRECISIONS", "THREAD_VARS", "auto_backend", "available_backends", "backend_help",
           "backend_names", "check_precision", "complete", "get_backend", "graph_decoder",
           "openblas_api", "resolve_name", "set_threads", "threads_in_use", "with_precision"]

#: name -> "module:Class", imported lazily
BACKENDS: dict[str, str] = {
    "numpy": "minillama.backends.numpy.backend:NumpyBackend",
    "reference": "minillama.backends.reference:ReferenceBackend",
    "numba": "minillama.backends.numba.backend:NumbaBackend",
    "cupy": "minillama.backends.cupy.backend:CupyBackend",
}

ENV_VAR = "MINILLAMA_BACKEND"
_instances: dict[str, object] = {}


def backend_names() -> list[str]:
    """Every registered backend name, whether or not it can run here."""
    return list(BACKENDS)


#: ``auto`` (the default) for running a model: one of at most this many float parameters runs on
#: ``reference`` (no compile, no thread hand-offs: a step of a small model is too short to
#: share); a larger one, or one whose weights stay in GGML blocks, on ``numba`` (its fused decode
#: step and block kernels: 40x numpy on SmolLM2-135M Q4_1, at or above llama.cpp; the first run
#: compiles its kernels once, says so, and caches them). Without Numba: ``numpy`` above the
#: threshold. Measured with ``scripts/bench_default_backend.py``; figures in docs/BACKENDS.md.
AUTO_REFERENCE_MAX_PARAMS = 50_000_000


#: the variables that size the CPU thread pools: the numpy backend's row threads, Numba's parallel
#: kernels, OpenMP and OpenBLAS
THREAD_VARS = ("MINILLAMA_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
               "OPENBLAS_NUM_THREADS")


def set_threads(n: int) -> None:
    """Run every CPU pool with ``n`` threads (``--threads``): the variables of
    :data:`THREAD_VARS` for what starts later, OpenBLAS at once, and Numba's pool if it has
    started (it cannot grow past the size it started with: then the most it has)."""
    n = int(n)
    if n < 1:
        raise MinillamaError(f"--threads must be at least 1, got {n}")
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    api = openblas_api()
    if api is not None:
        api[1](n)
    if "numba" in sys.modules:
        numba = sys.modules["numba"]
        numba.set_num_threads(min(n, int(numba.config.NUMBA_NUM_THREADS)))


def threads_in_use(backend) -> int | None:
    """The CPU threads ``backend`` runs its ops with (None on a GPU backend)."""
    if backend.xp.__name__ != "numpy":
        return None
    if backend.num_threads is not None:  # a team of its own (numba)
        return int(backend.num_threads)
    from .numpy.threads import num_threads

    return num_threads()


def numba_installed() -> bool:
    """Whether Numba can be imported here (looked up, not imported)."""
    return importlib.util.find_spec("numba") is not None


def auto_backend(cfg=None, task: str = "decode", quantized: bool = False) -> str:
    """The backend ``auto`` picks for a model of config ``cfg`` (``quantized``: its linear
    weights kept in GGML blocks) doing ``task``: ``decode`` (generate, chat, serve, perplexity)
    as :data:`AUTO_REFERENCE_MAX_PARAMS` says; ``train``: numpy at every size."""
    if cfg is None or task != "decode":
        return "numpy"
    large = cfg.n_params() > AUTO_REFERENCE_MAX_PARAMS
    if (large or quantized) and numba_installed():
        return "numba"
    return "numpy" if large else "reference"


#: what ``auto`` picks, by task, in a ``--backend`` help (see :func:`auto_backend`)
_AUTO_HELP = {"decode": "picks by the model: numba for quantized or large ones; `minillama "
                        "backends` says what",
              "train": "trains on numpy"}


def backend_help(task: str = "decode") -> str:
    """The help of a ``--backend`` that takes one name: every registered backend, or auto, and
    what the default is for ``task`` (``decode``: running a model, ``train``: training one)."""
    return (f"{', '.join(backend_names())} or auto (default: ${ENV_VAR}, else auto, which "
            f"{_AUTO_HELP[task]})")


def resolve_name(name: str | None = None, cfg=None, task: str = "decode",
                 quantized: bool = False) -> str:
    """``name``, else ``$MINILLAMA_BACKEND``, else ``auto``; ``auto`` is :func:`auto_backend`
    (``numpy`` without a ``cfg``); an unknown name is a clear error."""
    if name is None or name == "":
        name = os.environ.get(ENV_VAR) or "auto"
    key = name.strip().lower()
    if key == "auto":
        return auto_backend(cfg, task, quantized)
    if key not in BACKENDS:
        raise MinillamaError(
            f"unknown backend {name!r}; available backends: {', '.join(BACKENDS)} (or auto)")
    return key


def get_backend(name=None):
    """The (cached) backend instance for ``name`` (see :func:`resolve_name`).

    A backend object passes through, completed where it lacks a helper or an optional ability
    (:func:`complete`). A backend whose requirements are missing (no Numba, no CuPy, no GPU)
    raises :class:`~minillama.core.errors.MinillamaError` saying what to install.
    """
    if name is not None and not isinstance(name, str):
        return complete(name)
    key = resolve_name(name)
    if key not in _instances:
        module_name, cls_name = BACKENDS[key].split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise MinillamaError(f"backend {key!r} cannot be imported: {e}") from None
        _instances[key] = getattr(module, cls_name)()
    return _instances[key]


#: what every backend object has beside its ops: the array module and its moves
HELPERS = ("xp", "asarray", "to_numpy", "synchronize", "name", "device")


class _NumpyDefaults:
    """The helpers of a NumPy backend on the CPU, for an object that lacks some."""

    xp = np
    device = "cpu"

    @staticmethod
    def asarray(a, dtype=None):
        """``a`` as a NumPy array (a :class:`QuantMatrix` stays as it is: its blocks are the
        weight, as on the reference)."""
        return a if isinstance(a, QuantMatrix) else np.asarray(a, dtype=dtype)

    @staticmethod
    def to_numpy(a):
        return np.asarray(a)

    @staticmethod
    def synchronize() -> None:
        """Nothing to wait for."""


class _Completed:
    """A backend object of one's own that lacks some helpers (:data:`HELPERS`) or optional
    abilities (:data:`ABILITIES`): each attribute is the object's own where it has one, else
    NumPy's helper, else the reference's answer (no ability taken); an op it lacks stays
    missing."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, key):
        try:
            return getattr(self._backend, key)
        except AttributeError:
            if key == "name":
                return type(self._backend).__name__
            if key in HELPERS:
                return getattr(_NumpyDefaults, key)
            if key not in ABILITIES:
                raise
        return getattr(get_backend("reference"), key)


def complete(backend):
    """``backend``, completed where it lacks a helper or an optional ability (the package's
    backends derive from the reference and have them all: they pass unchanged)."""
    if isinstance(backend, _Completed) or all(hasattr(backend, a) for a in HELPERS + ABILITIES):
        return backend
    return _Completed(backend)


def available_backends() -> list[str]:
    """The backends that can actually run on this machine (tries each one)."""
    names = []
    for key in BACKENDS:
        try:
            get_backend(key)
        except MinillamaError:
            continue
        names.append(key)
    return names


def graph_decoder(model, batch_size: int = 1, max_seq_len: int | None = None):
    """The CUDA-graph greedy decoder of ``model`` for ``batch_size`` sequences of up to
    ``max_seq_len`` positions (:class:`~minillama.backends.cupy.graph.GraphDecoder`: each decode
    step replayed as one CUDA graph, driven by :func:`minillama.core.decoding.stream_greedy`), or,
    where it does not apply, why not as a string: a phrase that follows "the CUDA-graph decoder
    ...", e.g. "needs the cupy backend (this model is on numpy)". The decoder's module is imported
    only for a model on the cupy backend."""
    name = model.backend.name
    if name != "cupy":
        return f"needs the cupy backend (this model is on {name})"
    from minillama.backends.cupy.graph import GraphDecoder, unsupported_reason

    why = unsupported_reason(model, batch_size)
    return why if why is not None else GraphDecoder(model, batch_size, max_seq_len)
