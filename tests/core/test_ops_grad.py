"""Every reference op's backward (minillama.core.ops) against float64 central finite differences of
its forward. The backends' own ops are held to these by parity tests
(tests/backends/numpy/test_backend.py, ...).

Each check turns the op into a scalar L = sum(out * R) with a fixed random R, so dL/dout = R, and
compares the op's backward with (L(x + h e_i) - L(x - h e_i)) / 2h over every input entry (the
inputs are small, so every entry is perturbed). The error measure is norm-based,

    rel = ||g_analytic - g_numeric||_2 / max(||g_analytic||_2, ||g_numeric||_2),

and must be <= 1e-6. With h = 1e-6 in float64 the finite-difference truncation error is
O(h^2 |f'''|) ~ 1e-12 and the rounding error O(eps_64 |L| / h) ~ 1e-10, so a correct backward
lands near 1e-9 while any wrong term (a missing factor, a transposed axis, a lost group sum)
gives rel of order 1e-2 .. 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.core import ops
from tests.support.gradcheck import central_differences, rel_err

H_STEP = 1e-6
TOL = 1e-6


def numeric_grad(f, x, h=H_STEP):
    """Central differences of the scalar f() with respect to every entry of x (perturbed in
    place)."""
    return central_differences(f, x.reshape(-1), range(x.size), h).reshape(x.shape)


def check(forward, backward, inputs, rng, n_out=1):
    """forward(*inputs) -> (out, ctx); backward(R, ctx) -> grads of the inputs (in order)."""
    out, ctx = forward(*inputs)
    outs = out if n_out > 1 else (out,)
    Rs = [rng.standard_normal(np.shape(o)) for o in outs]

    def scalar():
        o, _ = forward(*inputs)
        o = o if n_out > 1 else (o,)
        return float(sum(np.sum(oi * Ri) for oi, Ri in zip(o, Rs)))

    grads = backward(Rs[0] if n_out == 1 else Rs, ctx)
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert len(grads) == len(inputs)
    errs = []
    for x, g in zip(inputs, grads):
        assert g.shape == x.shape and g.dtype == np.float64
        errs.append(rel_err(g, numeric_grad(scalar, x)))
    return errs


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [7, 20], ids=["V<N", "V>N"])  # N = 8 tokens
def test_embedding_grad_repeated_tokens(rng, V):
    D = 5
    w = rng.standard_normal((V, D))
    tokens = np.array([[1, 3, 1, 6], [0, 1, 3, 3]])  # repeats: the scatter-add must accumulate
    out, ctx = ops.embedding_forward(w, tokens)
    np.testing.assert_array_equal(out, w[tokens])
    R = rng.standard_normal(out.shape)
    g = ops.embedding_backward(R, ctx)
    num = numeric_grad(lambda: float(np.sum(ops.embedding_forward(w, tokens)[0] * R)), w)
    assert rel_err(g, num) <= TOL
    # rows never read get exactly zero gradient
    np.testing.assert_array_equal(g[[2, 4, 5]], 0.0)


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_linear_grad(rng, lead):
    x = rng.standard_normal((*lead, 5))
    w = rng.standard_normal((4, 5))
    for e in check(ops.linear_forward, ops.linear_backward, (x, w), rng):
        assert e <= TOL


def test_rmsnorm_grad(rng):
    x = rng.standard_normal((2, 3, 6))
    g = 1.0 + 0.3 * rng.standard_normal(6)
    eps = 1e-2  # large enough that a backward ignoring eps would fail

    def fwd(x_, g_):
        return ops.rmsnorm_forward(x_, g_, eps)

    for e in check(fwd, ops.rmsnorm_backward, (x, g), rng):
        assert e <= TOL


@pytest.mark.parametrize("gathered", [False, True])
def test_rope_grad(rng, gathered):
    B, T, nh, hd = 2, 4, 3, 6
    cos, sin = ops.rope_tables(hd, 32, 10000.0, np.float64)
    if gathered:  # per-sequence positions, (B, T, hd/2)
        pos = np.array([[3, 4, 5, 6], [10, 11, 12, 13]])
        c, s = cos[pos], sin[pos]
    else:
        c, s = cos[5:5 + T], sin[5:5 + T]
    x = rng.standard_normal((B, T, nh, hd))
    (e,) = check(lambda x_: ops.rope_forward(x_, c, s), ops.rope_backward, (x,), rng)
    assert e <= TOL


@pytest.mark.parametrize(
    "H,KVH,T,S,start",
    [
        (4, 4, 5, 5, 0),  # MHA
        (4, 2, 5, 5, 0),  # GQA
        (4, 1, 5, 5, 0),  # MQA
        (6, 2, 3, 7, 4),  # GQA, queries at positions 4..6 reading a cache of 7
        (4, 2, 2, 9, "per-seq"),  # per-sequence start positions, S > T
    ],
)
def test_attention_grad(rng, H, KVH, T, S, start):
    B, hd = 2, 4
    start_pos = np.array([3, 7]) if start == "per-seq" else start
    q = rng.standard_normal((B, T, H, hd))
    k = rng.standard_normal((B, S, KVH, hd))
    v = rng.standard_normal((B, S, KVH, hd))

    def fwd(q_, k_, v_):
        return ops.attention_forward(q_, k_, v_, start_pos)

    errs = check(fwd, ops.attention_backward, (q, k, v), rng)
    assert max(errs) <= TOL, errs


def test_attention_masked_keys_get_no_gradient(rng):
    """Keys beyond the last query's position are never read: their dK, dV are exactly zero."""
    B, T, S, H, KVH, hd = 1, 2, 6, 2, 1, 4
    q = rng.standard_normal((B, T, H, hd))
    k = rng.standard_normal((B, S, KVH, hd))
    v = rng.standard_normal((B, S, KVH, hd))
    out, ctx = ops.attention_forward(q, k, v, 2)  # queries at positions 2, 3
    _, dk, dv = ops.attention_backward(rng.standard_normal(out.shape), ctx)
    np.testing.assert_array_equal(dk[:, 4:], 0.0)
    np.testing.assert_array_equal(dv[:, 4:], 0.0)
    assert np.all(np.abs(dv[:, :4]) > 0)


def test_swiglu_grad(rng):
    a = 3.0 * rng.standard_normal((3, 7))  # wide range: exercises both branches of the sigmoid
    b = rng.standard_normal((3, 7))
    for e in check(ops.swiglu_forward, ops.swiglu_backward, (a, b), rng):
        assert e <= TOL


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_grad(rng, ignore):
    N, V = 6, 5
    z = 2.0 * rng.standard_normal((N, V))
    t = rng.integers(0, V, N)
    if ignore:
        t[[1, 4]] = -100
    ii = -100

    def loss():
        return float(ops.cross_entropy_forward(z, t, ii)[0])

    ref = np.array([np.log(np.exp(z[n]).sum()) - z[n, t[n]] for n in range(N) if t[n] != ii])
    assert loss() == pytest.approx(ref.mean(), rel=1e-12)
    _, ctx = ops.cross_entropy_forward(z, t, ii)
    dz = ops.cross_entropy_backward(0.7, ctx)  # upstream scalar is applied
    num = 0.7 * numeric_grad(loss, z)
    assert rel_err(dz, num) <= TOL
    if ignore:
        np.testing.assert_array_equal(dz[[1, 4]], 0.0)


def test_cross_entropy_all_ignored_is_zero(rng):
    z = rng.standard_normal((3, 4))
    t = np.full(3, -1)
    loss, ctx = ops.cross_entropy_forward(z, t)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(ops.cross_entropy_backward(1.0, ctx), 0.0)


def test_cross_entropy_extreme_logits_are_finite():
    z = np.array([[1000.0, 0.0, -1000.0], [-1000.0, -1000.0, 1000.0]])
    t = np.array([2, 2])
    loss, ctx = ops.cross_entropy_forward(z, t)
    assert float(loss) == pytest.approx(1000.0, rel=1e-12)  # row 0: 2000 nats, row 1: 0
    assert np.all(np.isfinite(ops.cross_entropy_backward(1.0, ctx)))


def test_sigmoid_no_overflow():
    a = np.array([-800.0, -30.0, 0.0, 30.0, 800.0])
    with np.errstate(over="raise"):
        s = ops.sigmoid(a)
    np.testing.assert_allclose(s, np.exp(-np.logaddexp(0.0, -a)), rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_keep_dtype(rng, dtype):
    """float32 stays float32 (no silent upcast) and float64 stays float64, forward and backward."""
    B, T, H, KVH, hd, D, V = 2, 3, 4, 2, 4, 16, 9
    x = rng.standard_normal((B, T, D)).astype(dtype)
    w = rng.standard_normal((D, D)).astype(dtype)
    g = np.ones(D, dtype)
    cos, sin = ops.rope_tables(hd, 8, 10000.0, dtype)
    q = rng.standard_normal((B, T, H, hd)).astype(dtype)
    k = rng.standard_normal((B, T, KVH, hd)).astype(dtype)
    results = []
    y, c = ops.linear_forward(x, w)
    results += [y, *ops.linear_backward(y, c)]
    y, c = ops.rmsnorm_forward(x, g, 1e-5)
    results += [y, *ops.rmsnorm_backward(y, c)]
    y, c = ops.rope_forward(q, cos[:T], sin[:T])
    results += [y, ops.rope_backward(y, c)]
    y, c = ops.attention_forward(q, k, k)
    results += [y, *ops.attention_backward(y, c)]
    y, c = ops.swiglu_forward(x, x)
    results += [y, *ops.swiglu_backward(y, c)]
    y, c = ops.embedding_forward(w[:V], np.zeros((B, T), np.int64))
    results += [y, ops.embedding_backward(y, c)]
    loss, c = ops.cross_entropy_forward(x.reshape(B * T, D), np.zeros(B * T, np.int64))
    results += [loss, ops.cross_entropy_backward(1.0, c)]
    for r in results:
        assert r.dtype == dtype
