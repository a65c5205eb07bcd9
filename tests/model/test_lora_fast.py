"""The CPU backends' LoRA step against the reference: ``lora_forward`` / ``lora_backward``
(backends/numpy/lora.py), the beta-1 GEMM that adds the rank-r terms (backends/numpy/cblas.py),
dx alone for frozen weights and a frozen loss head; and at the model level, a LoRA step that
gives the reference's adapter gradients without ever forming a frozen weight's gradient."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core import ops
from minillama.core.config import ModelConfig
from minillama.model.lora import LoRA, LoRAConfig
from minillama.model.transformer import Transformer
from tests.support.helpers import BACKEND_PARAMS
from tests.support.helpers import max_rel_err as _rel

CPU = [p for p in BACKEND_PARAMS if getattr(p, "values", (p,))[0] in ("numpy", "numba")]
TOL = {np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture(params=CPU)
def cpu(request):
    return get_backend(request.param)


@pytest.fixture(params=["sizes", "split"])
def split(request, monkeypatch):
    """The GEMMs as the sizes choose, and with every product split over 3 row threads."""
    if request.param == "split":
        from minillama.backends.numpy import cblas, threads

        monkeypatch.setattr(threads, "SPLIT_GEMM_MIN_MACS", 1)
        monkeypatch.setattr(threads, "SPLIT_GEMM_MIN_ROWS", 2)
        monkeypatch.setattr(cblas, "SPLIT_MIN_MACS", 1)
        monkeypatch.setattr(cblas, "SPLIT_MIN_ROWS", 2)
        monkeypatch.setenv("MINILLAMA_NUM_THREADS", "3")
    return request.param


# ---------------------------------------------------------------------------------------------
# out += a b
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,K,N", [(5, 3, 4), (300, 16, 1000), (700, 600, 16)])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_gemm_acc_adds_the_product(M, K, N, ta, tb, dt):
    """Both operand layouts, one call and rows split over the threads (the large shapes)."""
    from minillama.backends.numpy.cblas import gemm_acc

    rng = np.random.default_rng(M + K)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(dt)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(dt)
    a, b = (a.T if ta else a), (b.T if tb else b)
    c = rng.standard_normal((M, N)).astype(dt)
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    gemm_acc(a, b, c)
    assert _rel(c, want) < TOL[dt]


def test_gemm_acc_without_openblas_falls_back_to_numpy(monkeypatch):
    from minillama.backends.numpy import cblas

    monkeypatch.setattr(cblas, "_fns", {})
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((9, 4)), rng.standard_normal((4, 7))
    c = rng.standard_normal((9, 7))
    want = c + a @ b
    cblas.gemm_acc(a, b, c)
    np.testing.assert_allclose(c, want, rtol=1e-13, atol=1e-13)


def test_gemm_acc_into_a_strided_output_falls_back():
    """Columns of ``out`` not contiguous: CBLAS cannot write them, NumPy's add does."""
    from minillama.backends.numpy.cblas import gemm_acc

    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 3)), rng.standard_normal((3, 5))
    big = rng.standard_normal((6, 10))
    want = big.copy()
    want[:, ::2] += a @ b
    gemm_acc(a, b, big[:, ::2])
    np.testing.assert_allclose(big, want, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# the ops against minillama/core/ops.py
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("with_drop", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 20, 12, 4), (4, 128, 96, 160, 16)])
def test_lora_ops_match_the_reference(cpu, dt, with_drop, shape, split):
    B, T, din, dout, r = shape
    rng = np.random.default_rng(din)
    x = rng.standard_normal((B, T, din)).astype(dt)
    w = rng.standard_normal((dout, din)).astype(dt)
    a, b = rng.standard_normal((r, din)).astype(dt), rng.standard_normal((dout, r)).astype(dt)
    drop = ((rng.random(x.shape) > 0.25) / 0.75).astype(dt) if with_drop else None
    dy = rng.standard_normal((B, T, dout)).astype(dt)
    y0, c0 = ops.lora_forward(x, w, a, b, 1.7, drop)
    y1, c1 = cpu.lora_forward(x, w, a, b, 1.7, drop)
    assert y1.shape == y0.shape and y1.dtype == dt
    assert _rel(y1, y0) < TOL[dt]
    for g1, g0 in zip(cpu.lora_backward(dy, c1), ops.lora_backward(dy, c0)):
        assert g1.shape == g0.shape and g1.dtype == dt
        assert _rel(g1, g0) < TOL[dt]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_lora_ops_over_a_quantized_base(cpu, qtype):
    from minillama.core.quant import QUANT_TYPES, QuantMatrix
    from tests.support.quantblocks import random_quant_rows

    rng = np.random.default_rng(3)
    N, K, r = 40, QUANT_TYPES[qtype].block_elems, 4
    w = QuantMatrix(qtype, (N, K), random_quant_rows(qtype, N, K, rng, scale=0.01))
    x = rng.standard_normal((2, 9, K)).astype(np.float32)
    a = rng.standard_normal((r, K)).astype(np.float32)
    b = rng.standard_normal((N, r)).astype(np.float32)
    dy = rng.standard_normal((2, 9, N)).astype(np.float32)
    y0, c0 = ops.lora_forward(x, w, a, b, 0.5)
    y1, c1 = cpu.lora_forward(x, w, a, b, 0.5)
    assert _rel(y1, y0) < 1e-5
    for g1, g0 in zip(cpu.lora_backward(dy, c1), ops.lora_backward(dy, c0)):
        assert _rel(g1, g0) < 1e-5


def test_frozen_linear_input_gradient_is_linear_backwards_dx(backend):
    rng = np.random.default_rng(4)
    x = backend.asarray(rng.standard_normal((2, 70, 48)), dtype=np.float32)
    w = backend.asarray(rng.standard_normal((80, 48)), dtype=np.float32)
    dy = backend.asarray(rng.standard_normal((2, 70, 80)), dtype=np.float32)
    _, ctx = backend.linear_forward(x, w)
    want = backend.to_numpy(backend.linear_backward(dy, ctx)[0])
    got = backend.to_numpy(backend.linear_backward_input(dy, ctx))
    assert got.shape == want.shape and _rel(got, want) < 1e-6


def test_frozen_head_input_gradient_skips_dw(cpu, monkeypatch):
    """dx of the fused loss head alone equals the full backward's dx; no (V, D) product is made,
    the logits buffer goes back to the spare slot, and a second call is refused."""
    from minillama.core.errors import MinillamaError

    rng = np.random.default_rng(5)
    N, D, V = 96, 32, 300
    x = rng.standard_normal((N, D)).astype(np.float32)
    w = rng.standard_normal((V, D)).astype(np.float32)
    t = rng.integers(0, V, size=N)
    t[:7] = -1
    loss0, c0 = cpu.linear_cross_entropy_forward(x, w, t)
    want = cpu.linear_cross_entropy_backward(0.5, c0)[0].copy()
    loss1, c1 = cpu.linear_cross_entropy_forward(x, w, t)
    shapes = []
    gemm = cpu._gemm
    monkeypatch.setattr(cpu, "_gemm", lambda a, b, out: (shapes.append(out.shape),
                                                         gemm(a, b, out)))
    got = cpu.linear_cross_entropy_backward_input(0.5, c1)
    assert float(loss1) == float(loss0)
    assert _rel(got, want) < 1e-6
    assert (V, D) not in shapes and cpu._lce_spare is not None
    with pytest.raises(MinillamaError, match="twice"):
        cpu.linear_cross_entropy_backward_input(0.5, c1)


# ---------------------------------------------------------------------------------------------
# the model: adapter gradients as the reference's, frozen gradients never formed
# ---------------------------------------------------------------------------------------------
def _model(backend, targets, **kw):
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                      hidden_dim=96, max_seq_len=32, **kw)
    model = Transformer(cfg, backend=backend, dtype=np.float32, seed=3)
    lora = LoRA(model, LoRAConfig(rank=4, alpha=8.0, targets=targets), seed=1)
    rng = np.random.default_rng(6)
    for k in lora.params:  # nonzero B: every adapter term counts
        lora.params[k] = model.backend.asarray(
            rng.standard_normal(lora.params[k].shape) * 0.2, dtype=np.float32)
    return model, lora.attach(model)


class _Spy:
    """Counts the backend calls that would form a frozen weight's gradient."""

    FORMING = ("linear_backward", "linear_cross_entropy_backward", "embedding_backward")

    def __init__(self, be, monkeypatch):
        self.calls = []
        for name in self.FORMING:
            fn = getattr(be, name)
            monkeypatch.setattr(be, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def call(*a, **k):
            self.calls.append(name)
            return fn(*a, **k)
        return call


@pytest.mark.parametrize("targets,kw", [
    (("q", "k", "v", "o", "gate", "up", "down"), {}),
    (("q", "v", "down"), {"tie_embeddings": False}),
    (("k", "up"), {"logit_scale": 0.5})])
def test_lora_step_matches_the_reference_and_forms_no_frozen_gradient(cpu, targets, kw,
                                                                      monkeypatch):
    rng = np.random.default_rng(7)
    tok = rng.integers(0, 97, size=(3, 20))
    tgt = rng.integers(0, 97, size=(3, 20))
    tgt[1, :4] = -1
    ref_model, ref_lora = _model(get_backend("reference"), targets, **kw)
    loss0, g0 = ref_model.loss_and_grads(tok, tgt)
    model, lora = _model(cpu, targets, **kw)
    spy = _Spy(cpu, monkeypatch)
    base = {k: np.array(v) for k, v in model.params.items()}
    loss1, g1 = model.loss_and_grads(tok, tgt)
    assert spy.calls == []  # no dW of a frozen linear, of the head or of the embedding
    assert set(g1) == set(lora.params) == set(g0)
    assert abs(loss1 - loss0) < 1e-5 * abs(loss0)
    for k in g0:
        assert _rel(g1[k], g0[k]) < 1e-4, k
    assert all(np.array_equal(model.params[k], base[k]) for k in base)


def test_a_full_step_still_forms_every_gradient(cpu, monkeypatch):
    """Without adapters nothing is skipped: the dW paths run and every parameter has a grad."""
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50,
                                    hidden_dim=48, max_seq_len=16), backend=cpu, seed=2)
    spy = _Spy(cpu, monkeypatch)
    tok = np.random.default_rng(8).integers(0, 50, size=(2, 9))
    _, grads = model.loss_and_grads(tok, tok)
    assert set(grads) == set(model.params)
    assert {"linear_backward", "linear_cross_entropy_backward", "embedding_backward"} \
        <= set(spy.calls)
