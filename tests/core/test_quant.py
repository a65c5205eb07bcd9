"""Block dequantization (minillama/core/quant.py) held bit for bit to the `gguf` package's (the
Python port llama.cpp's authors publish) on random valid blocks of every type, and properties the
block equations imply: scaling the float16 d scales the values exactly, rows are independent."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.core.errors import MinillamaError
from minillama.core.quant import (
    QUANT_TYPES,
    QuantMatrix,
    dequantize,
    dequantize_rows,
)
from tests.support.quantblocks import finite_f16, random_blocks, random_quant_rows

TYPES = list(QUANT_TYPES)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape \
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_every_type_has_a_dequantizer_and_the_ggml_sizes():
    gguf = pytest.importorskip("gguf")
    assert len({t.type_id for t in QUANT_TYPES.values()}) == len(QUANT_TYPES)
    for name, t in QUANT_TYPES.items():
        q = gguf.GGMLQuantizationType[name]
        assert t.name == name and callable(t.dequantize), name
        assert q.value == t.type_id, name
        assert gguf.GGML_QUANT_SIZES[q] == (t.block_elems, t.block_bytes), name
        assert all(0 <= at <= t.block_bytes - 2 for at in t.scale_fields), name


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("scale", [None, 0.01])
def test_bit_for_bit_equal_to_the_gguf_package(qtype, scale):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(sum(map(ord, qtype)))
    N, K = 6, QUANT_TYPES[qtype].block_elems * 5
    data = random_quant_rows(qtype, N, K, rng, scale)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    got = dequantize(QuantMatrix(qtype, (N, K), data))
    assert same_bits(got, want.astype(np.float32)), (qtype, np.abs(got - want).max())
    assert np.isfinite(got).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_independent(qtype):
    """Dequantizing any subset of rows, in any order, gives those rows of the whole."""
    rng = np.random.default_rng(1)
    N, K = 9, QUANT_TYPES[qtype].block_elems * 2
    data = random_quant_rows(qtype, N, K, rng)
    whole = dequantize_rows(qtype, data, K)
    rows = np.array([7, 2, 2, 0])
    assert same_bits(dequantize_rows(qtype, data[rows], K), whole[rows])
    assert same_bits(dequantize_rows(qtype, data[3:5], K), whole[3:5])


def test_known_blocks():
    """Blocks written by hand: the equations, not just agreement with another port."""
    d = np.array([0.5], np.float16).view(np.uint8)
    q8 = np.concatenate([d, np.arange(-16, 16, dtype=np.int8).view(np.uint8)])[None]
    assert np.array_equal(dequantize_rows("Q8_0", q8, 32)[0], 0.5 * np.arange(-16, 16))
    q4 = np.concatenate([d, np.full(16, 0x3A, np.uint8)])[None]  # low nibble 10, high 3
    assert np.array_equal(dequantize_rows("Q4_0", q4, 32)[0], 0.5 * np.repeat([2.0, -5.0], 16))
    m = np.array([-1.0], np.float16).view(np.uint8)
    q41 = np.concatenate([d, m, np.full(16, 0x3A, np.uint8)])[None]
    assert np.array_equal(dequantize_rows("Q4_1", q41, 32)[0], np.repeat([4.0, 0.5], 16))
    nl = np.concatenate([d, np.full(16, 0xF0, np.uint8)])[None]  # index 0 then index 15
    assert np.array_equal(dequantize_rows("IQ4_NL", nl, 32)[0],
                          0.5 * np.repeat([-127.0, 113.0], 16))


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(["Q8_0", "Q4_0", "Q6_K", "IQ4_NL"]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 8))
def test_doubling_d_doubles_the_block_exactly(qtype, seed, n):
    """x = d * (something of the other bytes): doubling the float16 d (exact while it stays
    finite) doubles every value exactly, in float32."""
    rng = np.random.default_rng(seed)
    b = random_blocks(qtype, n, rng)
    at = QUANT_TYPES[qtype].scale_fields[0]
    d = finite_f16(rng, n)
    d[np.abs(d.astype(np.float32)) >= 32768] = np.float16(1.0)
    b[:, at:at + 2] = d.view(np.uint8).reshape(n, 2)
    b2 = b.copy()
    b2[:, at:at + 2] = (d * np.float16(2)).view(np.uint8).reshape(n, 2)
    K = QUANT_TYPES[qtype].block_elems
    x, x2 = QUANT_TYPES[qtype].dequantize(b), QUANT_TYPES[qtype].dequantize(b2)
    assert x.shape == (n, K)
    assert same_bits(x2, (2 * x).astype(np.float32))


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(["Q4_1", "Q5_1"]), seed=st.integers(0, 2**32 - 1))
def test_zero_scale_gives_the_offset(qtype, seed):
    """x = d q + m: with d = 0 every value of the block is m."""
    rng = np.random.default_rng(seed)
    b = random_blocks(qtype, 3, rng)
    b[:, 0:2] = 0
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    assert np.array_equal(QUANT_TYPES[qtype].dequantize(b), np.broadcast_to(m, (3, 32)))


def test_quant_matrix_refuses_a_wrong_shape():
    with pytest.raises(MinillamaError, match="Q4_K"):
        QuantMatrix("Q4_K", (2, 100), np.zeros((2, 144), np.uint8))
    with pytest.raises(MinillamaError, match="uint8 data of shape"):
        QuantMatrix("Q8_0", (2, 64), np.zeros((2, 34), np.uint8))
    with pytest.raises(MinillamaError, match="not supported"):
        QuantMatrix("IQ2_XXS", (2, 256), np.zeros((2, 66), np.uint8))
