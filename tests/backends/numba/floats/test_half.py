"""The half-precision KV cache's conversions in the fused decode steps
(backends/numba/floats/half.py) against NumPy's float16: every half widened, and float32 values
rounded to the nearest half (ties to even, subnormals, overflow, NaN), bit for bit, by the
conversions this host's kernels take and by the integer ones of hosts without conversion
instructions."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.errors import MinillamaError

try:
    get_backend("numba")
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)

from numba import njit  # noqa: E402

from minillama.backends.numba.floats.half import (  # noqa: E402
    float_to_half_bits,
    half_to_float_bits,
    kv_read,
    kv_write,
)


def _each(f):
    """A compiled loop out[i] = f(x[i])."""
    @njit(cache=False)
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = f(x[i])

    return run


@njit(cache=False)
def _round(x, cache):
    for i in range(x.shape[0]):
        cache[i] = kv_write(cache, x[i])


_widen, _widen_bits, _round_bits = (_each(f) for f in (kv_read, half_to_float_bits,
                                                       float_to_half_bits))
PATHS = {"this host's": (_widen, _round), "integer": (_widen_bits, _round_bits)}


@pytest.mark.parametrize("path", PATHS)
def test_every_half_widens_to_numpys_float32(path):
    widen, _ = PATHS[path]
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(bits.shape, np.float32)
    widen(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("path", PATHS)
def test_float32_rounds_to_numpys_nearest_half(path):
    _, round_ = PATHS[path]
    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float32))
    lo, hi = finite[:-1], finite[1:]
    ties = (lo + hi) / 2  # every tie between neighbouring halves (exact in float32)
    x = np.concatenate([
        rng.normal(0, 1, 100_000), rng.normal(0, 1e4, 10_000), rng.normal(0, 1e-5, 10_000),
        ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf), finite,
        [0.0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, np.inf, -np.inf, 2.0 ** -25,
         2.0 ** -24, 3 * 2.0 ** -26, 1e-45, -1e-45]]).astype(np.float32)
    got = np.empty(x.shape, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    round_(x, got)
    np.testing.assert_array_equal(got, want)
    nan = np.empty(1, np.uint16)
    round_(np.array([np.nan], np.float32), nan)
    assert np.isnan(nan.view(np.float16)[0])


def test_a_float_cache_is_written_and_read_as_it_is():
    x = np.random.default_rng(1).normal(0, 1, 100).astype(np.float32)
    got = np.empty_like(x)
    _round(x, got)
    np.testing.assert_array_equal(got, x)
    back = np.empty_like(x)
    _widen(x, back)
    np.testing.assert_array_equal(back, x)
