r"""The integer GEMM of the numba backend (backends/numba/quant/int8_gemm.py): many rows of x
rounded to 8-bit blocks times GGML block weights, the prefill products of ``qmatmul``.

The bounds are those of tests/backends/numba/quant/test_int8_dots.py (module docstring), per output
entry: against the float64 product of the dequantized W (gguf-py) with the rounded x, 4 (K + 2) u
times \sum_k |w_k x^_k| (the integer sums are exact; the float32 work is a few terms per sub-block
of magnitude at most a few |w x^|, plus the term -128 S_b folded into the integer sum); against the
exact product, the rounding of x on top.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.backends.numba.quant import int8_gemm as G8  # after the skips: it imports numba
from minillama.core.quant import QUANT_TYPES

# skips where tests/backends/numba/quant/test_int8_dots.py skips (no gguf-py, no numba)
from tests.backends.numba.quant.test_int8_dots import (
    I8,
    Q,
    U,
    njit,
    oracle,
    portable,
    random_matrix,
    rounded,
)

TYPES = sorted(t for t in QUANT_TYPES if QUANT_TYPES[t].type_id in G8.GEMM8_TYPES)


def rounded_rows(x):
    """The rows of x as the kernels round them, float64 (M, K)."""
    out = np.empty(x.shape)
    for m in range(x.shape[0]):
        xq, xd, _ = rounded(x[m])
        out[m] = np.repeat(xd.astype(np.float64), 32) * xq
    return out


def test_the_integer_types_are_those_of_the_decode_kernels():
    assert sorted(G8.GEMM8_TYPES) == sorted(I8.INT8_TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_against_the_rounded_activations(qtype):
    """Row counts that leave partial tiles on both sides (x: not a multiple of 32, W: not of 4
    or 16), one and two threads: within the bound of W x^, and within the rounding bound of
    the exact product."""
    rng = np.random.default_rng(QUANT_TYPES[qtype].type_id)
    per = QUANT_TYPES[qtype].block_elems
    qt = QUANT_TYPES[qtype].type_id
    for M, N, K in ((37, 21, max(per, 256)), (9, 35, 768), (70, 16, 2 * max(per, 256))):
        w = random_matrix(qtype, N, K, rng)
        W = oracle(w)
        x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
        x[0, rng.integers(0, K)] *= 40  # an outlier in one block
        xr = rounded_rows(x)
        for parts in (1, 2):
            y = np.full((M, N), np.nan, np.float32)
            G8.gemm(qt, x, w.data, y, parts)
            assert np.all(np.abs(y - xr @ W.T) <= 4 * (K + 2) * U * (np.abs(xr) @ np.abs(W).T)
                          + 1e-30), (qtype, M, N, K, parts)
        d = np.abs(x - xr)  # at most half a step of each block
        exact = x.astype(np.float64) @ W.T
        bound = d @ np.abs(W).T + 4 * (K + 2) * U * ((np.abs(x) + 2 * d) @ np.abs(W).T)
        assert np.all(np.abs(y - exact) <= bound), qtype


def tile_runner(qtype, x, rng):
    """(w, run): 4 random rows w of type qtype unpacked, x (32, K) packed, and run(tile) that
    calls a tile (:func:`.int8_gemm._make_tile`) on them in a new compiled function (its IR
    written then) and returns its (4, 32) outputs."""
    qt, K = QUANT_TYPES[qtype].type_id, x.shape[1]
    G = G8.GROUP[qt]
    w = random_matrix(qtype, 4, K, rng)
    xt = np.empty((2, K // 4, 16, 4), np.uint8)
    dt = np.empty((2, K // 32, 16), np.float32)
    st = np.empty((2, K // 16, 16), np.float32)
    G8.pack_x(x, xt, dt, st)
    nsub = K // G
    u = np.zeros((4, K), np.int8)
    a, c = np.zeros((4, nsub), np.float32), np.zeros((4, nsub), np.float32)
    s = np.zeros((4, nsub), np.int32)
    for r in range(4):
        G8._unpack(qt, w.data, r, u[r], a[r], c[r], s[r], G)

    def run(tile):
        @njit
        def call(out):
            tile(xt.ctypes.data, dt.ctypes.data, st.ctypes.data, u.ctypes.data, a.ctypes.data,
                 c.ctypes.data, s.ctypes.data, nsub, K, out.ctypes.data)

        out = np.empty((4, 32), np.float32)
        call(out)
        return out

    return w, run


@pytest.mark.skipif(not I8.VNNI, reason="the host has no AVX512-VNNI")
@pytest.mark.parametrize("G", [32, 16])
def test_vnni_and_portable_tiles_agree(G):
    """The same integer sums, the same float operations: bit for bit."""
    qtype = "Q4_K" if G == 32 else "Q6_K"
    rng = np.random.default_rng(G)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    w, run = tile_runner(qtype, x, rng)
    outs = [run(G8._make_tile(G, vnni)) for vnni in (False, True)]
    np.testing.assert_array_equal(outs[0], outs[1])
    W = oracle(w)
    np.testing.assert_allclose(outs[1], W @ rounded_rows(x).T, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(I8.VNNI or not I8.AVX2, reason="the AVX2 byte dots serve hosts with AVX2 "
                    "and no AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_avx2_and_portable_tiles_agree(qtype, monkeypatch):
    """The tiles by vpmaddubsw / vpmaddwd (Q8_0's in two passes) against the portable IR: the
    same integer sums bit for bit, x's codes at +-127 (its bytes + 128 at 1 and 255)."""
    qt = QUANT_TYPES[qtype].type_id
    rng = np.random.default_rng(qt)
    x = np.where(rng.random((32, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[:8] *= rng.standard_normal((8, 512)).astype(np.float32)
    _, run = tile_runner(qtype, x, rng)

    def build():
        return run(G8._make_tile(G8.GROUP[qt], False, I8.fits16(qt)))

    np.testing.assert_array_equal(build(), portable(build, monkeypatch))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qmatmul_rounds_many_rows_unless_asked_for_float(qtype, monkeypatch):
    """Many rows of x take the integer GEMM by default; ``MINILLAMA_QUANT_DOTS=float`` and the
    ``exact_products`` context (the training forward) take the float32 tiles."""
    rng = np.random.default_rng(5)
    K, M = 768, 40
    w = random_matrix(qtype, 50, K, rng)
    W = oracle(w)
    x = rng.standard_normal((M, K)).astype(np.float32)
    exact = x.astype(np.float64) @ W.T
    tight = (K + 2) * U * (np.abs(x) @ np.abs(W).T)
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    y8 = Q.qmatmul(x, w)
    xr = rounded_rows(x)
    assert np.all(np.abs(y8 - xr @ W.T) <= 4 * (K + 2) * U * (np.abs(xr) @ np.abs(W).T))
    assert not np.all(np.abs(y8 - exact) <= tight)  # rounded: the integer path was taken
    with get_backend("numba").exact_products():
        assert np.all(np.abs(Q.qmatmul(x, w) - exact) <= tight)
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")
    assert np.all(np.abs(Q.qmatmul(x, w) - exact) <= tight)


def test_training_forward_is_exact_on_a_quantized_model(monkeypatch):
    """loss_and_grads of a model with block matrices on numba is that of the float32 products
    (``MINILLAMA_QUANT_DOTS=float``) bit for bit, while its inference forward rounds
    activations."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32,
                      hidden_dim=128)
    rng = np.random.default_rng(7)
    model = Transformer(cfg, backend="numba", seed=3)
    for name, v in list(model.params.items()):
        if v.ndim == 2 and name.startswith("layers."):
            model.params[name] = random_matrix("Q8_0", v.shape[0], v.shape[1], rng)
    tok = rng.integers(0, 96, (2, 12))
    tgt = rng.integers(0, 96, (2, 12))
    out = {}
    for dots in ("int8", "float"):
        monkeypatch.setenv("MINILLAMA_QUANT_DOTS", dots)
        out[dots] = (model.loss_and_grads(tok, tgt), model.forward(tok))
    (l0, g0), z0 = out["float"]
    (l1, g1), z1 = out["int8"]
    assert l0 == l1 and g0.keys() == g1.keys()
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k])
    err = np.abs(z1 - z0).max() / np.abs(z0).max()
    assert 1e-5 < err < 0.1  # inference: rounded activations, within the documented size
