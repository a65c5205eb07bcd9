r"""The few-row products of the numba backend in the integer GEMM's order
(backends/numba/quant/int8_lanes.py): each output must be the float32 value the GEMM
(backends/numba/quant/int8_gemm.py) gives it, bit for bit, whatever the row count of x, the
rows of W a call covers and the threads, since both sum the same exact integer dots into one
fused multiply-add chain over the sub-blocks in order. So a position's products are the same in
a prompt's prefill (the GEMM) and in a decode step (these kernels).
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends.numba.quant import int8_gemm as G8  # noqa: E402,I001  (after the skips)
from minillama.backends.numba.quant import int8_lanes as L8  # noqa: E402
from minillama.core.quant import QUANT_TYPES

# skips where tests/backends/numba/quant/test_int8_dots.py skips (no gguf-py, no numba)
from tests.backends.numba.quant.test_int8_dots import I8, random_matrix

TYPES = sorted(t for t in QUANT_TYPES if QUANT_TYPES[t].type_id in L8.LANE_TYPES)


def _shapes(qtype, shapes):
    """(N, K) of ``shapes`` for a block of 32; K a multiple of 256 for a K-quant."""
    if QUANT_TYPES[qtype].block_elems == 32:
        return shapes
    return tuple((N, 256 * (i + 1)) for i, (N, _) in enumerate(shapes))


def test_every_type_of_the_integer_gemm_has_lanes():
    assert TYPES == ["Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K",
                     "Q8_0"]
    assert set(L8.LANE_TYPES) == set(I8.INT8_TYPES) == set(G8.GEMM8_TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_lanes_equal_the_gemm_bit_for_bit(qtype):
    """Rows of W not a multiple of 16 (a partial group of lanes), an odd count of blocks (the
    last block alone; for a K-quant one, two and three super-blocks: a chunk of two and a
    chunk of one), 1 to 17 rows of x, one and three threads; an outlier in a block and a zero
    row of x."""
    rng = np.random.default_rng(QUANT_TYPES[qtype].type_id + 7)
    qt = QUANT_TYPES[qtype].type_id
    for N, K in _shapes(qtype, ((37, 96), (16, 256), (50, 576))):
        w = random_matrix(qtype, N, K, rng)
        for M in (1, 2, 5, 16, 17):
            x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
            x[0, rng.integers(0, K)] *= 40
            if M > 1:
                x[1] = 0
            want = np.full((M, N), np.nan, np.float32)
            G8.gemm(qt, x, w.data, want, 1)
            for parts in (1, 3):
                got = np.full((M, N), np.nan, np.float32)
                L8.gemv(qt, x, w.data, got, parts)
                assert np.array_equal(got, want), (qtype, N, K, M, parts,
                                                   float(np.abs(got - want).max()))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_row_range_is_each_rows_value(qtype):
    """mv_lanes over any range lo..hi of W's rows gives those rows the values of the whole
    product (a thread's share of the rows starts anywhere)."""
    rng = np.random.default_rng(3)
    qt = QUANT_TYPES[qtype].type_id
    N, K = 45, 128 if QUANT_TYPES[qtype].block_elems == 32 else 512
    w = random_matrix(qtype, N, K, rng)
    x = rng.standard_normal((1, K)).astype(np.float32)
    whole = np.empty((1, N), np.float32)
    L8.gemv(qt, x, w.data, whole, 1)
    xq = np.empty((1, K), np.int8)
    xd = np.empty((1, K // 32), np.float32)
    xs = np.empty((1, K // 16), np.float32)
    I8.quantize_rows(x, xq, xd, xs)
    for lo, hi in ((0, 45), (3, 20), (17, 18), (30, 45)):
        y = np.full(N, np.nan, np.float32)
        L8.mv_lanes(qt, w.data, xq[0], xd[0], xs[0], y, lo, hi)
        assert np.array_equal(y[lo:hi], whole[0, lo:hi]), (lo, hi)
        assert np.isnan(y[:lo]).all() and np.isnan(y[hi:]).all()


@pytest.mark.parametrize("qtype", [t for t in TYPES if QUANT_TYPES[t].type_id
                                   in L8.LANE_TYPES32])
def test_several_x_rows_per_decoding_of_w_give_each_rows_value(qtype):
    """idot_lanes4 (W's 16 rows decoded once for XROWS rows of x, as the decode steps of several
    rows take them) stores for each x row the floats idot_lanes stores for it alone, bit for bit:
    an odd and an even count of blocks, a partial group of W's rows, a column offset."""
    from numba import njit

    @njit
    def four(qt, w, xq, xd, xs, y, c0):
        for n0 in range(0, w.shape[0], L8.LANES):
            L8.idot_lanes4(qt, w, n0, min(L8.LANES, w.shape[0] - n0), xq, xd, xs, 1, y, c0)

    @njit
    def one(qt, w, xq, xd, xs, y, c0):
        for b in range(1, 1 + L8.XROWS):
            for n0 in range(0, w.shape[0], L8.LANES):
                L8.idot_lanes(qt, w, n0, min(L8.LANES, w.shape[0] - n0), xq[b], xd[b], xs[b],
                              y[b, c0:])

    rng = np.random.default_rng(QUANT_TYPES[qtype].type_id + 11)
    qt = QUANT_TYPES[qtype].type_id
    for N, K in _shapes(qtype, ((37, 96), (50, 576))):
        w = random_matrix(qtype, N, K, rng).data
        M = L8.XROWS + 2
        x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
        xq = np.empty((M, K), np.int8)
        xd = np.empty((M, K // 32), np.float32)
        xs = np.empty((M, K // 16), np.float32)
        L8.quantize_rows(x, xq, xd, xs)
        got, want = np.full((M, N + 3), np.nan, np.float32), np.full((M, N + 3), np.nan,
                                                                      np.float32)
        four(qt, w, xq, xd, xs, got, 3)
        one(qt, w, xq, xd, xs, want, 3)
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got[1:1 + L8.XROWS, 3:]).all()
