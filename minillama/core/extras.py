"""Optional dependencies: which ``pip install "minillama[EXTRA]"`` brings each one.

:func:`require` imports an optional module or raises a one-line :class:`MinillamaError` naming
the extra; :func:`missing_error` turns a ``ModuleNotFoundError`` raised anywhere (the CLI's last
resort) into the same line, so no command path ends in a traceback for a missing extra.
"""

from __future__ import annotations

import importlib

from minillama.core.errors import MinillamaError

#: top-level module -> the extra of pyproject.toml that installs it
EXTRAS = {
    "gguf": "gguf",
    "tokenizers": "hf",
    "jinja2": "hf",
    "regex": "hf",
    "mpi4py": "mpi",
    "cupy": "gpu",
    "cupy_backends": "gpu",
}


def install_hint(module: str) -> str | None:
    """``pip install "minillama[EXTRA]"`` for the extra holding ``module`` (None if no extra
    does)."""
    extra = EXTRAS.get(module.split(".")[0])
    if extra is None:
        return None
    hint = f'pip install "minillama[{extra}]"'
    if extra == "gpu":
        hint += ' (or "minillama[gpu-cuda13]" for CUDA 13, as nvidia-smi shows)'
    return hint


def missing_error(module: str, what: str | None = None) -> MinillamaError:
    """The one-line error for optional ``module`` missing while doing ``what``."""
    top = module.split(".")[0]
    hint = install_hint(top)
    need = f"{what} needs" if what else "this needs"
    if hint is None:
        return MinillamaError(f"{need} the Python package `{top}`, which is not installed")
    return MinillamaError(f"{need} the optional package `{top}`: {hint}")


def require(module: str, what: str):
    """``import module`` or raise :func:`missing_error` (only for that module being absent: a
    module that is there but fails inside keeps its own error)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise
        raise missing_error(module, what) from None
