"""Block-quantized weights in the ops and the model: a :class:`QuantMatrix` W multiplies as its
dequantization (the reference), the NumPy backend's tiled path matches the reference, W is frozen
(no gradient), and a model holding quantized matrices gives the logits and the remaining
gradients of the same model with the dequantized float weights."""

from __future__ import annotations

import types

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core import ops
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES, QuantMatrix, dequantize
from minillama.model.transformer import Transformer, init_params
from minillama.train.optim import AdamW
from tests.support.quantblocks import quantized_params, random_quant_rows


def qmatrix(qtype, N, K, seed=0, scale=0.01):
    return QuantMatrix(qtype, (N, K), random_quant_rows(qtype, N, K,
                                                        np.random.default_rng(seed), scale))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "IQ4_XS"])
def test_reference_ops_are_the_dequantized_equations(qtype):
    rng = np.random.default_rng(0)
    K = QUANT_TYPES[qtype].block_elems * 2
    w = qmatrix(qtype, 7, K)
    W = dequantize(w)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    y, ctx = ops.linear_forward(x, w)
    assert y.shape == (2, 3, 7) and np.array_equal(y, x @ W.T)
    dy = rng.standard_normal((2, 3, 7)).astype(np.float32)
    dx, dw = ops.linear_backward(dy, ctx)
    assert dw is None and np.array_equal(dx, dy @ W)
    tok = np.array([[6, 0, 6], [3, 1, 2]])
    h, c = ops.embedding_forward(w, tok)
    assert h.shape == (2, 3, K) and np.array_equal(h, W[tok])
    assert ops.embedding_backward(dy[..., :1].repeat(K, -1), c) is None


@pytest.fixture(params=["numpy", "numba"])
def fast(request):
    if request.param == "numba":
        pytest.importorskip("numba")
    return get_backend(request.param)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("threaded", [False, True])
def test_tiled_backend_matches_the_reference(fast, qtype, dtype, M, threaded, monkeypatch):
    """Row tiles of 3 (so 11 rows make 4 tiles, the last short), serial or spread over 3
    threads, give the reference's y and dx."""
    import minillama.backends.numpy.backend as nb
    from minillama.backends.numpy import threads as cpu_threads

    monkeypatch.setattr(nb, "QUANT_TILE_ROWS", 3)
    monkeypatch.setenv("MINILLAMA_NUM_THREADS", "3" if threaded else "1")
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")  # numba's float32 decode products
    if threaded:
        monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_ELEMENTS", 1)
    rng = np.random.default_rng(1)
    K = QUANT_TYPES[qtype].block_elems * 2
    w = qmatrix(qtype, 11, K, seed=2)
    x = rng.standard_normal((M, 2, K)).astype(dtype)
    dy = rng.standard_normal((M, 2, 11)).astype(dtype)
    ref = get_backend("reference")
    y0, c0 = ref.linear_forward(x, w)
    y1, c1 = fast.linear_forward(x, w)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert y1.dtype == dtype and y1.shape == y0.shape
    np.testing.assert_allclose(y1, y0, rtol=tol, atol=tol * np.abs(y0).max())
    (dx0, dw0), (dx1, dw1) = ref.linear_backward(dy, c0), fast.linear_backward(dy, c1)
    assert dw0 is None and dw1 is None and dx1.dtype == dtype
    np.testing.assert_allclose(dx1, dx0, rtol=tol, atol=tol * np.abs(dx0).max())


def test_tiles_never_hold_the_whole_matrix(monkeypatch):
    """The NumPy path dequantizes QUANT_TILE_ROWS rows at a time into one buffer."""
    import minillama.backends.numpy.backend as nb

    seen = []
    real = nb.dequantize_rows

    def spy(qtype, data, K, out=None):
        seen.append((data.shape[0], None if out is None else out.base is not None))
        return real(qtype, data, K, out=out)

    monkeypatch.setattr(nb, "dequantize_rows", spy)
    monkeypatch.setattr(nb, "QUANT_TILE_ROWS", 4)
    w = qmatrix("Q4_0", 10, 64)
    get_backend("numpy").linear_forward(np.ones((2, 64), np.float32), w)
    assert seen == [(4, True), (4, True), (2, True)]


CFG32 = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96,
                    max_seq_len=16, tie_embeddings=False)
CFG256 = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=40,
                     hidden_dim=256, max_seq_len=16, tie_embeddings=True)
TOKENS = np.array([[3, 17, 5, 9, 30, 2], [1, 0, 33, 7, 7, 12]])


@pytest.mark.parametrize("cfg,qtype", [(CFG32, "Q4_0"), (CFG32, "Q5_1"), (CFG256, "Q4_K"),
                                       (CFG256, "Q3_K")])
@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
def test_model_logits_and_grads_match_the_dequantized_model(cfg, qtype, backend, monkeypatch):
    if backend == "numba":
        pytest.importorskip("numba")
        # float32 activations in the decode products (the 8-bit ones: numba/quant/test_int8_dots.py)
        monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")
    # K-quant scales multiply 6-bit ones
    scale = 0.002 if QUANT_TYPES[qtype].block_elems == 32 else 0.0002
    quant, floats = quantized_params(init_params(cfg, seed=3), qtype, np.random.default_rng(4),
                                     scale)
    mq = Transformer(cfg, quant, backend=backend)
    mq.kv_cache = "f32"  # the weights alone here (a half cache: tests/model/test_kvcache.py)
    mf = Transformer(cfg, floats, backend="reference")
    assert mq.dtype == np.float32
    assert all(mq.params[k] is quant[k] for k in quant if isinstance(quant[k], QuantMatrix))
    tol = 1e-6 if backend == "reference" else 1e-4
    zf = mf.forward(TOKENS)
    np.testing.assert_allclose(mq.forward(TOKENS), zf, rtol=tol, atol=tol * np.abs(zf).max())
    # a KV-cached decode (the numba backend's fused step declines quantized weights)
    cache = mq.new_cache(2)
    mq.forward(TOKENS[:, :5], cache=cache)
    step = mq.forward(TOKENS[:, 5:], start_pos=5, cache=cache, last_only=True)
    np.testing.assert_allclose(step, zf[:, 5], rtol=tol, atol=tol * np.abs(zf).max())
    # gradients: none for the frozen matrices, the float model's for the rest
    targets = np.roll(TOKENS, -1, axis=1)
    lq, gq = mq.loss_and_grads(TOKENS, targets)
    lf, gf = mf.loss_and_grads(TOKENS, targets)
    assert set(gq) == {k for k, v in quant.items() if not isinstance(v, QuantMatrix)}
    assert abs(lq - lf) <= 1e-5 * abs(lf)
    for k in gq:  # norm-based relative error (float32 sums in another order)
        err = np.linalg.norm(gq[k] - gf[k]) / np.linalg.norm(gf[k])
        assert err <= (1e-6 if backend == "reference" else 1e-4), (k, err)


def test_quantized_weights_are_not_trained():
    quant, _ = quantized_params(init_params(CFG32), "Q8_0", np.random.default_rng(0))
    model = Transformer(CFG32, quant, backend="numpy")
    with pytest.raises(MinillamaError, match="cannot train .*quantized Q8_0 matrix"):
        AdamW(model.params)


def test_cuda_graph_takes_q8_0_and_declines_types_without_kernels():
    """The CUDA-graph decoder reads Q8_0 / Q4_K / Q6_K blocks with quant.cu's matvec kernel; a type
    without CUDA kernels is named in the reason (on the device such types are widened at load)."""
    from minillama.backends.cupy.graph import unsupported_reason

    for qtype, ok in (("Q8_0", True), ("Q5_0", False)):
        quant, _ = quantized_params(init_params(CFG32), qtype, np.random.default_rng(0))
        fake = types.SimpleNamespace(backend=types.SimpleNamespace(name="cupy"),
                                     dtype=np.float32, cfg=CFG32, params=quant)
        why = unsupported_reason(fake, 1)
        assert (why is None) if ok else (why is not None and "quantized Q5_0" in why), why


@pytest.mark.parametrize("backend", ["reference", "numpy"])
def test_dx_through_a_quantized_linear_is_the_central_difference(backend):
    """float64: dL/dx of L = sum(c * (x deq(W)^T)) from linear_backward against central
    differences (the float64 gradient check of the project)."""
    from tests.support.gradcheck import central_differences, rel_err

    be = get_backend(backend)
    rng = np.random.default_rng(5)
    w = qmatrix("Q5_K", 6, 256, seed=6)
    x = rng.standard_normal((3, 256))
    c = rng.standard_normal((3, 6))

    def loss():
        return float(np.sum(c * be.linear_forward(x, w)[0]))

    _, ctx = be.linear_forward(x, w)
    dx, dw = be.linear_backward(c, ctx)
    idx = rng.choice(x.size, 40, replace=False)
    num = central_differences(loss, x.reshape(-1), idx, 1e-5)
    assert dw is None and dx.dtype == np.float64
    assert rel_err(dx.reshape(-1)[idx], num) < 1e-8


def test_float64_model_with_quantized_weights():
    quant, floats = quantized_params(init_params(CFG32, seed=3), "Q4_0", np.random.default_rng(4))
    mq = Transformer(CFG32, quant, backend="reference", dtype=np.float64)
    mf = Transformer(CFG32, floats, backend="reference", dtype=np.float64)
    zq, zf = mq.forward(TOKENS), mf.forward(TOKENS)
    assert zq.dtype == np.float64 and np.abs(zq - zf).max() <= 1e-12 * np.abs(zf).max()
