"""Packed fine-tuning batches (``minillama finetune --pack``): several examples per row, each
attending only within itself (block-diagonal causal mask) with RoPE positions restarting at every
example. The reference attention with segments against each example run alone and against float64
central differences; the packer's rows; and (with the model) a packed batch's logits and loss
gradients against those of its examples run separately."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.core import ops
from minillama.model.packing import draw_packed, pack_batch
from minillama.train.finetune import Example, Sampler, pad_batch
from tests.support.gradcheck import central_differences, rel_err
from tests.train.test_finetune import base, chat_data  # noqa: F401 (fixtures)


def test_segment_positions_restart_per_example():
    seg = np.array([[0, 0, 0, 1, 1, 2, 3, 3], [0, 0, 0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(ops.segment_positions(seg),
                                  [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]])


def test_segment_mask_is_block_diagonal_causal():
    seg = np.array([[0, 0, 1, 1, 1]])
    m = ops.causal_mask(np, 5, 5, 0, segments=seg)[0, 0, 0]
    want = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                     [0, 0, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(m, want)


def _qkv(rng, B, T, H=4, KVH=2, hd=4):
    return (rng.standard_normal((B, T, H, hd)), rng.standard_normal((B, T, KVH, hd)),
            rng.standard_normal((B, T, KVH, hd)))


def test_packed_attention_equals_each_example_alone(rng):
    lengths = [3, 5, 2]
    q, k, v = _qkv(rng, 1, sum(lengths))
    seg = np.repeat(np.arange(3), lengths)[None]
    out, _ = ops.attention_forward(q, k, v, 0, segments=seg)
    at = 0
    for n in lengths:
        alone, _ = ops.attention_forward(q[:, at:at + n], k[:, at:at + n], v[:, at:at + n], 0)
        np.testing.assert_allclose(out[:, at:at + n], alone, rtol=1e-12, atol=1e-14)
        at += n


def test_packed_attention_gradient_against_central_differences(rng):
    B, T = 2, 6
    q, k, v = _qkv(rng, B, T)
    seg = np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    R = rng.standard_normal(q.shape)
    out, ctx = ops.attention_forward(q, k, v, 0, segments=seg)
    grads = ops.attention_backward(R, ctx)
    for x, g in zip((q, k, v), grads):
        def loss():
            return float(np.sum(ops.attention_forward(q, k, v, 0, segments=seg)[0] * R))
        num = central_differences(loss, x.reshape(-1), range(x.size), 1e-6).reshape(x.shape)
        assert rel_err(g, num) <= 1e-6


def _examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        train = rng.random(n) < 0.7
        train[0] = False
        out.append(Example(rng.integers(3, 50, n), train))
    return out


def test_pack_batch_lays_examples_end_to_end():
    ex = _examples([4, 3, 6])
    x, y, seg = pack_batch([[ex[0], ex[1]], [ex[2]]], pad_id=0)
    assert x.shape == (2, 5)  # 3 + 2 positions, then 5
    np.testing.assert_array_equal(x[0], np.r_[ex[0].ids[:-1], ex[1].ids[:-1]])
    np.testing.assert_array_equal(seg, [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    px, py = pad_batch([ex[0]])
    np.testing.assert_array_equal(y[0, :3], py[0])
    x2, y2, seg2 = pack_batch([[ex[1]], [ex[2]]], pad_id=0)
    np.testing.assert_array_equal(seg2[0], [0, 0, 1, 1, 1])  # the padding: a segment of its own
    np.testing.assert_array_equal(y2[0, 2:], -1)


def test_draw_packed_fills_rows_in_sampler_order_and_loses_nothing():
    lengths = [5, 9, 3, 17, 2, 8, 8, 4, 12, 6, 3, 7]
    ex = _examples(lengths)
    index = {id(e): i for i, e in enumerate(ex)}
    s, ref = Sampler(len(ex), seed=3), Sampler(len(ex), seed=3)
    drawn = []
    for _ in range(5):
        rows = draw_packed(ex, s, B=2, T=20)
        assert len(rows) <= 2
        for row in rows:
            assert sum(len(e.ids) - 1 for e in row) <= 20
        drawn += [index[id(e)] for row in rows for e in row]
    assert drawn == ref.next(len(drawn))  # the sampler's order, nothing skipped or repeated
    assert s.state() == ref.state()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backend_packed_attention_matches_reference(backend, dtype, rng):
    """The numpy backend's attention with a segment mask (the numba backend runs the same pair
    for packed rows), forward and backward, against the reference."""
    from minillama.backends import get_backend
    from tests.support.helpers import PARITY_TOL

    if backend == "numba":
        pytest.importorskip("numba")
    be = get_backend(backend)
    q, k, v = (a.astype(dtype) for a in _qkv(rng, 3, 7, H=6, KVH=2, hd=8))
    seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 2, 2, 2, 3], [0] * 7])
    out, ctx = be.attention_forward_packed(q, k, v, 0, segments=seg)
    ref, rctx = ops.attention_forward(q, k, v, 0, segments=seg)
    dout = rng.standard_normal(q.shape).astype(dtype)
    tol = PARITY_TOL["numpy"][dtype]
    for got, want in zip((out, *be.attention_backward_packed(dout, ctx)),
                         (ref, *ops.attention_backward(dout, rctx))):
        assert got.dtype == dtype
        assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))


# ---------------------------------------------------------------------------------------------
# the model: a packed batch against its examples run alone
# ---------------------------------------------------------------------------------------------
ROWS = [[5, 9, 3], [11, 4]]  # example lengths (tokens) per packed row


def _packed_model(backend, lora):
    from minillama.core.config import ModelConfig
    from minillama.model.lora import LoRA, LoRAConfig
    from minillama.model.transformer import Transformer

    if backend == "numba":
        pytest.importorskip("numba")
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                      max_seq_len=64)
    m = Transformer(cfg, backend=backend, dtype=np.float64, seed=0)
    if lora:
        LoRA(m, LoRAConfig(rank=4), seed=1).attach(m)
        rng = np.random.default_rng(2)
        for v in m.lora.params.values():  # B = 0 would hide the adapters
            v[...] = rng.standard_normal(v.shape) * 0.1
    return m


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    rows = [[Example(rng.integers(0, 97, n + 1), rng.random(n + 1) < 0.8) for n in row]
            for row in ROWS]
    for row in rows:
        for e in row:
            e.train[0], e.train[1] = False, True
    return rows


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_batch_equals_its_examples_alone(backend, lora):
    m = _packed_model(backend, lora)
    rows = _rows()
    x, y, seg = pack_batch(rows)
    logits = m.forward(x, segments=seg)
    loss, grads = m.loss_and_grads(x, y, segments=seg)
    total, want, n_all = 0.0, {k: np.zeros_like(v) for k, v in grads.items()}, 0
    for b, row in enumerate(rows):
        at = 0
        for e in row:
            xe, ye = pad_batch([e])
            n = xe.shape[1]
            np.testing.assert_allclose(logits[b, at:at + n], m.forward(xe)[0], rtol=1e-9,
                                       atol=1e-11)
            k = int((ye >= 0).sum())
            le, ge = m.loss_and_grads(xe, ye)
            total += le * k
            n_all += k
            for name in want:
                want[name] += ge[name] * k
            at += n
    assert n_all == int((y >= 0).sum())
    assert loss == pytest.approx(total / n_all, rel=1e-11)
    for name, g in grads.items():
        np.testing.assert_allclose(g, want[name] / n_all, rtol=1e-8, atol=1e-12)


def test_packed_recomputed_gradient_against_central_differences():
    """The packed step's gradient (here with --recompute too) against float64 central
    differences of the packed loss, on random entries of every kind of parameter."""
    from tests.support.gradcheck import central_differences, rel_err

    m = _packed_model("reference", lora=False)
    for v in m.params.values():  # larger weights: gradients well above the differences' noise
        if v.ndim == 2:
            v *= 6.0
    m.recompute = True
    x, y, seg = pack_batch(_rows(1))
    _, grads = m.loss_and_grads(x, y, segments=seg)
    rng = np.random.default_rng(5)
    for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight",
                 "layers.1.attention.wk.weight", "layers.0.feed_forward.w2.weight",
                 "layers.1.attention_norm.weight", "norm.weight"):
        flat = m.params[name].reshape(-1)
        idx = rng.choice(flat.size, 6, replace=False)
        num = central_differences(lambda: m.loss(x, y, segments=seg), flat, idx, 1e-5)
        assert rel_err(grads[name].reshape(-1)[idx], num) <= 1e-6, name


def test_packed_rows_refuse_bad_segments():
    from minillama.core.errors import MinillamaError

    m = _packed_model("reference", lora=False)
    x, y, seg = pack_batch(_rows())
    with pytest.raises(MinillamaError, match="segments must be"):
        m.loss_and_grads(x, y, segments=seg[:, :-1])


def test_finetune_pack_trains_and_resumes_bit_for_bit(base, chat_data, tmp_path, capsys):  # noqa: F811 (fixture)
    """``--pack`` on chat data (the random HF llama and its chat template of
    tests/train/test_finetune.py): the held-out loss falls and an interrupted packed run resumes to
    the same adapter."""
    import json

    from minillama.cli import main as cli

    common = ["finetune", "-c", str(base), "--data", str(chat_data / "train.jsonl"),
              "--val-data", str(chat_data / "val.jsonl"), "--steps", "12", "--batch-size", "2",
              "--context", "96", "--lr", "1e-2", "--warmup", "2", "--eval-interval", "6",
              "--pack", "--no-progress"]
    assert cli.main(common + ["--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert "packed" in out.err
    assert summary["val_loss"] < summary["first_val_loss"]
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--stop-at", "5"]) == 0
    assert cli.main(["finetune", "--out", str(tmp_path / "b"), "--resume", "--no-progress"]) == 0
    from safetensors.numpy import load_file
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
