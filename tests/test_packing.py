"""Packed fine-tuning batches (``minillama finetune --pack``): several examples per row, each
attending only within itself (block-diagonal causal mask) with RoPE positions restarting at every
example. The reference attention with segments against each example run alone and against float64
central differences; the packer's rows; and (with the model) a packed batch's logits and loss
gradients against those of its examples run separately."""

from __future__ import annotations

import numpy as np
import pytest

from minillama import ops
from minillama.finetune import Example, Sampler, draw_packed, pack_batch, pad_batch

from gradcheck import central_differences, rel_err


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

    from helpers import PARITY_TOL

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

