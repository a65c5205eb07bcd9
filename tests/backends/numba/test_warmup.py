"""The warm-up notice of a compiling backend tells what happens: "compiling kernels" when Numba
compiled one (a cache miss), "loading compiled kernels" when it only read them from the disk
cache, nothing when it ended within ``note_after`` seconds."""

from __future__ import annotations

import importlib.util
import re
import types

import pytest

from minillama.infer.generate import warm_up

numba = pytest.importorskip("numba")

KERNEL = '''
from numba import njit


@njit(cache=True)
def affine(x):
    return 3 * x + 1
'''


def _fresh_module(path, name):
    """The module at ``path`` imported anew under ``name``: a new dispatcher, compiled or loaded
    from the cache beside the file on its first call."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def numba_model():
    from minillama.backends import get_backend

    return types.SimpleNamespace(backend=get_backend("numba"))


@pytest.fixture
def cached_kernel(tmp_path):
    """A kernel file whose kernel is compiled once and saved to its disk cache."""
    path = tmp_path / "kernel_mod.py"
    path.write_text(KERNEL)
    first = _fresh_module(path, "minillama_warmup_first")
    assert first.affine(2) == 7
    assert sum(first.affine.stats.cache_misses.values()) == 1
    return path


def test_the_watch_counts_compiles_and_not_cache_loads(numba_model, cached_kernel):
    with numba_model.backend.watch_compiles() as seen:
        loaded = _fresh_module(cached_kernel, "minillama_warmup_loaded")
        assert loaded.affine(5) == 16
    assert sum(loaded.affine.stats.cache_hits.values()) == 1  # the premise: read from disk
    assert (seen.started, seen.compiled, seen.names) == (0, 0, [])

    with numba_model.backend.watch_compiles() as seen:
        assert loaded.affine(2.5) == 8.5  # a new signature: compiled and cached
    assert (seen.started, seen.compiled, seen.names) == (1, 1, ["affine"])
    with numba_model.backend.watch_compiles() as seen:
        assert loaded.affine(0.5) == 2.5  # compiled already for this signature
    assert (seen.started, seen.compiled) == (0, 0)


def test_functions_without_a_disk_cache_are_counted_apart(numba_model):
    """Numba's own helpers (typed lists) compile in every process: not "compiling (once,
    cached)"."""
    with numba_model.backend.watch_compiles() as seen:
        fresh = numba.njit(lambda x: x * x - 2)  # no disk cache
        assert fresh(4) == 14
    assert (seen.started, seen.compiled, seen.names) == (0, 0, [])
    assert seen.uncached >= 1


def test_loading_cached_kernels_says_loading(numba_model, cached_kernel):
    said = []
    run = lambda: _fresh_module(cached_kernel, "minillama_warmup_run").affine(1)  # noqa: E731
    assert warm_up(numba_model, [0], note_after=0.0, say=said.append, run=run) > 0
    assert said[0] == "numba: loading compiled kernels ..."
    assert re.fullmatch(r" done in \d+\.\d s\n", said[1]) and len(said) == 2


def test_compiling_says_compiling(numba_model, tmp_path):
    """Whether the notice (due at once) comes before or after the compile starts, what is said
    reports the compile: "compiling kernels", or "loading", then "compiling" as the compile
    begins and the count compiled at the end."""
    said = []
    path = tmp_path / "kernel_new.py"
    path.write_text(KERNEL)

    def run():
        assert _fresh_module(path, "minillama_warmup_new").affine(10) == 31

    warm_up(numba_model, [0], note_after=0.0, say=said.append, run=run)
    if said[0] == "numba: compiling kernels (once, cached) ...":
        assert len(said) == 2 and re.fullmatch(r" done in \d+\.\d s\n", said[1])
    else:
        assert said[:2] == ["numba: loading compiled kernels ...",
                            " compiling kernels (once, cached) ..."]
        assert len(said) == 3 and re.fullmatch(r" done in \d+\.\d s \(1 compiled\)\n", said[2])


def test_a_quick_warm_up_says_nothing(numba_model, cached_kernel):
    said = []
    run = lambda: _fresh_module(cached_kernel, "minillama_warmup_quiet").affine(1)  # noqa: E731
    warm_up(numba_model, [0], note_after=1e9, say=said.append, run=run)
    assert said == []
