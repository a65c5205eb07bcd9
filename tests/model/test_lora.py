"""LoRA: the op (minillama/core/ops.py:lora_forward / lora_backward) against float64 central
differences and torch.autograd, its properties, and the model with adapters
(minillama/model/lora.py): only the adapters get gradients, and those match central differences of
the whole model's loss."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.core import ops
from minillama.core.config import ModelConfig
from minillama.model.lora import TARGETS, LoRA, LoRAConfig
from minillama.model.transformer import Transformer
from minillama.train.optim import AdamW
from tests.support.errormodel import logits_bound
from tests.support.gradcheck import central_differences, rel_err


def _op_inputs(rng, lead=(2, 3), din=5, dout=4, r=3):
    x = rng.standard_normal((*lead, din))
    w = rng.standard_normal((dout, din))
    a = rng.standard_normal((r, din))
    b = rng.standard_normal((dout, r))
    return x, w, a, b


@pytest.mark.parametrize("with_drop", [False, True])
def test_lora_backward_matches_central_differences(with_drop):
    rng = np.random.default_rng(0)
    x, w, a, b = _op_inputs(rng)
    s = 0.7
    drop = (rng.random(x.shape) > 0.3) / 0.7 if with_drop else None
    y, ctx = ops.lora_forward(x, w, a, b, s, drop)
    R = rng.standard_normal(y.shape)

    def loss():
        return float(np.sum(ops.lora_forward(x, w, a, b, s, drop)[0] * R))

    grads = ops.lora_backward(R, ctx)
    assert len(grads) == 3  # dx, dA, dB: no dW
    for arr, g in zip((x, a, b), grads):
        assert g.shape == arr.shape
        num = central_differences(loss, arr.reshape(-1), range(arr.size), 1e-6)
        assert rel_err(g, num.reshape(arr.shape)) < 1e-7


def test_lora_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x, w, a, b = _op_inputs(rng, lead=(3, 4), din=6, dout=5, r=2)
    drop = (rng.random(x.shape) > 0.25) / 0.75
    s = 2.5
    y, ctx = ops.lora_forward(x, w, a, b, s, drop)
    dy = rng.standard_normal(y.shape)
    dx, da, db = ops.lora_backward(dy, ctx)
    tx, ta, tb = (torch.tensor(v, requires_grad=True) for v in (x, a, b))
    tw = torch.tensor(w, requires_grad=True)
    ty = tx @ tw.T + s * ((tx * torch.tensor(drop)) @ ta.T) @ tb.T
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    for mine, theirs in ((dx, tx), (da, ta), (db, tb)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert tw.grad is not None  # torch forms dW; minillama's backward returns none


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), r=st.integers(1, 4), din=st.integers(1, 7),
       dout=st.integers(1, 7), s=st.floats(0.01, 10.0))
def test_lora_properties(seed, r, din, dout, s):
    rng = np.random.default_rng(seed)
    x, w, a, b = _op_inputs(rng, lead=(3,), din=din, dout=dout, r=r)
    # B = 0 gives the base linear exactly
    y0, _ = ops.lora_forward(x, w, a, np.zeros_like(b), s)
    assert np.array_equal(y0, x @ w.T)
    # merging W + s B A gives the adapter's outputs
    y, ctx = ops.lora_forward(x, w, a, b, s)
    np.testing.assert_allclose(y, x @ (w + s * b @ a).T, rtol=1e-10, atol=1e-10)
    # the input gradient is the merged layer's, and only (dx, dA, dB) come back
    dy = rng.standard_normal(y.shape)
    out = ops.lora_backward(dy, ctx)
    assert [g.shape for g in out] == [x.shape, a.shape, b.shape]
    np.testing.assert_allclose(out[0], dy @ (w + s * b @ a), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# the model with adapters
# ---------------------------------------------------------------------------------------------
def _tiny(**kw):
    base = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=23, hidden_dim=24,
                max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def _lora_model(rng, targets=tuple(TARGETS), rank=3, dtype=np.float64, **kw):
    model = Transformer(_tiny(**kw), backend="reference", dtype=dtype, seed=3)
    lora = LoRA(model, LoRAConfig(rank=rank, alpha=5.0, targets=targets), seed=4)
    for k in lora.params:  # nonzero B so every adapter is exercised
        lora.params[k][...] = rng.standard_normal(lora.params[k].shape) * 0.3
    return model, lora.attach(model)


def test_new_adapters_start_at_the_base_model():
    model = Transformer(_tiny(), backend="reference", dtype=np.float64, seed=3)
    tok = np.array([[1, 5, 7, 2, 9]])
    base = model.forward(tok)
    LoRA(model, LoRAConfig(rank=4)).attach(model)
    assert np.array_equal(model.forward(tok), base)


@pytest.mark.parametrize("kw", [{}, {"qkv_bias": True, "tie_embeddings": False}])
def test_model_adapter_grads_match_central_differences(kw):
    rng = np.random.default_rng(5)
    model, lora = _lora_model(rng, **kw)
    tok = rng.integers(0, 23, size=(2, 6))
    tgt = rng.integers(0, 23, size=(2, 6))
    tgt[0, :2] = -1
    base_before = {k: v.copy() for k, v in model.params.items()}
    loss, grads = model.loss_and_grads(tok, tgt)
    assert set(grads) == set(lora.params)  # adapters only: nothing for W, norms, embedding
    assert len(grads) == 2 * 7 * 2
    assert abs(loss - model.loss(tok, tgt)) < 1e-12
    for name in ("layers.0.attention.wq.lora_A", "layers.1.feed_forward.w2.lora_B",
                 "layers.0.attention.wk.lora_B", "layers.1.feed_forward.w3.lora_A"):
        flat = lora.params[name].reshape(-1)
        idx = range(0, flat.size, max(1, flat.size // 12))
        num = central_differences(lambda: model.loss(tok, tgt), flat, idx, 1e-6)
        assert rel_err(grads[name].reshape(-1)[list(idx)], num) < 1e-6, name
    for k in model.params:
        assert np.array_equal(model.params[k], base_before[k])


def test_merged_weights_give_the_adapter_model():
    rng = np.random.default_rng(6)
    model, lora = _lora_model(rng, targets=("q", "v", "down"))
    tok = rng.integers(0, 23, size=(2, 7))
    merged = Transformer(model.cfg, lora.merged(model.params), backend="reference",
                         dtype=np.float64)
    np.testing.assert_allclose(model.forward(tok), merged.forward(tok), rtol=1e-10, atol=1e-10)


def test_adapter_model_decodes_with_a_cache_like_the_full_forward(backend):
    rng = np.random.default_rng(7)
    model = Transformer(_tiny(), backend=backend, dtype=np.float32, seed=3)
    lora = LoRA(model, LoRAConfig(rank=2, targets=("q", "k", "o", "up")), seed=1)
    for k in lora.params:
        lora.params[k][...] = backend.asarray(rng.standard_normal(lora.params[k].shape) * 0.3,
                                              dtype=np.float32)
    lora.attach(model)
    tok = rng.integers(0, 23, size=(1, 6))
    full = backend.to_numpy(model.forward(tok))
    cache = model.new_cache(1)
    model.forward(tok[:, :5], cache=cache)
    step = backend.to_numpy(model.forward(tok[:, 5:], start_pos=5, cache=cache))
    np.testing.assert_allclose(step[:, -1], full[:, -1], rtol=2e-4, atol=2e-4)
    merged = Transformer(model.cfg, lora.merged(model.params), backend=backend)
    np.testing.assert_allclose(backend.to_numpy(merged.forward(tok)), full, rtol=2e-4, atol=2e-4)


def test_adapter_dropout_only_while_training():
    rng = np.random.default_rng(8)
    model, lora = _lora_model(rng)
    lora.lc.dropout = 0.5
    tok = rng.integers(0, 23, size=(1, 5))
    a, b = model.forward(tok), model.forward(tok)
    assert np.array_equal(a, b)  # evaluation: no masks
    l1, _ = model.loss_and_grads(tok, tok)
    l2, _ = model.loss_and_grads(tok, tok)
    assert l1 != l2  # a new mask each training forward
    assert not lora.training


def test_adamw_over_the_adapters_only_changes_the_adapters():
    rng = np.random.default_rng(9)
    model, lora = _lora_model(rng, dtype=np.float32)
    opt = AdamW(lora.params, lr=1e-2)
    assert set(opt.m) == set(lora.params)  # no optimizer state for frozen weights
    base = {k: v.copy() for k, v in model.params.items()}
    before = {k: v.copy() for k, v in lora.params.items()}
    tok = rng.integers(0, 23, size=(2, 8))
    loss0 = None
    for _ in range(5):
        loss, g = model.loss_and_grads(tok[:, :-1], tok[:, 1:])
        loss0 = loss if loss0 is None else loss0
        opt.step(g)
    assert model.loss(tok[:, :-1], tok[:, 1:]) < loss0
    assert all(np.array_equal(model.params[k], base[k]) for k in base)
    assert all(not np.array_equal(lora.params[k], before[k]) for k in before)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_lora_on_a_quantized_base_equals_lora_on_its_dequantized_weights(qtype):
    """QLoRA-style: W stays in its GGML blocks; y, dx, dA and dB are those of the float W =
    deq(W) (the base term goes through the quantized product, dW is never formed)."""
    from minillama.core.quant import QUANT_TYPES, QuantMatrix, dequantize
    from tests.support.quantblocks import random_quant_rows

    rng = np.random.default_rng(5)
    N, K, r = 6, QUANT_TYPES[qtype].block_elems, 3
    w = QuantMatrix(qtype, (N, K), random_quant_rows(qtype, N, K, rng, scale=0.01))
    wf = dequantize(w).astype(np.float64)
    x = rng.standard_normal((2, 3, K))
    a, b = rng.standard_normal((r, K)), rng.standard_normal((N, r))
    dy = rng.standard_normal((2, 3, N))
    yq, cq = ops.lora_forward(x, w, a, b, 0.5)
    yf, cf = ops.lora_forward(x, wf, a, b, 0.5)
    np.testing.assert_allclose(yq, yf, rtol=1e-12, atol=1e-12)
    for gq, gf in zip(ops.lora_backward(dy, cq), ops.lora_backward(dy, cf)):
        np.testing.assert_allclose(gq, gf, rtol=1e-12, atol=1e-12)


def test_an_adapter_over_a_quantized_base_stays_attached(tmp_path):
    """`generate --adapter` on a quantized base (apply_adapter) keeps W in its blocks and the
    adapter attached; its logits equal the float base with the adapter merged in."""
    from minillama.core.quant import QuantMatrix
    from minillama.io.peft import apply_adapter, save_peft
    from minillama.model.transformer import init_params
    from tests.support.quantblocks import quantized_params

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, hidden_dim=64,
                      max_seq_len=16)
    qp, fp = quantized_params(init_params(cfg, seed=1), "Q8_0", np.random.default_rng(2),
                              scale=0.01)
    src = Transformer(cfg, fp, backend="reference")
    lora = LoRA(src, LoRAConfig(rank=2), seed=3)
    rng = np.random.default_rng(4)
    for _, b in lora.targets.values():  # B = 0 at init: give the adapter an effect
        lora.params[b] = rng.standard_normal(lora.params[b].shape).astype(np.float32)
    save_peft(lora, tmp_path / "ad")
    ids = np.array([[1, 5, 9, 2, 7]])
    merged = Transformer(cfg, fp, backend="reference")
    apply_adapter(merged, tmp_path / "ad")
    quant = Transformer(cfg, qp, backend="reference")
    apply_adapter(quant, tmp_path / "ad")
    assert quant.lora is not None and isinstance(quant.params["layers.0.attention.wq.weight"],
                                                 QuantMatrix)
    want = merged.forward(ids)
    assert np.abs(want - Transformer(cfg, fp, backend="reference").forward(ids)).max() > 1e-3
    assert np.abs(quant.forward(ids) - want).max() <= logits_bound(merged, ids.shape[1])
