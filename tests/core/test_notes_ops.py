"""The notes' other ops (LayerNorm, BatchNorm, sinusoidal positions, GELU/ReLU FFNs, post-norm,
logit scale, cross-attention, the latent block): float64 central differences of every backward
and, where PyTorch has the op, torch.autograd (skipped when torch is absent).

The error measure and step are those of tests/core/test_ops_grad.py: a correct backward lands near
1e-9, a wrong term near 1e-2 .. 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.core import notes_latent as latent
from minillama.core import notes_ops as ops
from tests.core.test_ops_grad import numeric_grad, rel_err

TOL = 1e-6


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def grad_errors(forward, backward, inputs, rng):
    """forward(*inputs) -> (out, ctx); backward(R, ctx) -> grads of inputs (None = not checked)."""
    out, ctx = forward(*inputs)
    R = rng.standard_normal(out.shape)

    def scalar():
        return float(np.sum(forward(*inputs)[0] * R))

    grads = backward(R, ctx)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return [rel_err(g, numeric_grad(scalar, x)) for x, g in zip(inputs, grads) if g is not None]


def test_layernorm_grad(rng):
    x, g, b = rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal(6)
    errs = grad_errors(lambda x, g, b: ops.layernorm_forward(x, g, b, 1e-5),
                       ops.layernorm_backward, [x, g, b], rng)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2, 2)])
def test_batchnorm_grad(rng, shape):
    x, g, b = rng.standard_normal(shape), rng.standard_normal(3), rng.standard_normal(3)
    errs = grad_errors(lambda x, g, b: ops.batchnorm_forward(x, g, b, 1e-5),
                       ops.batchnorm_backward, [x, g, b], rng)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_mlp_grad(rng, act):
    x = rng.standard_normal((2, 3, 4))
    w1, w2 = rng.standard_normal((6, 4)), rng.standard_normal((4, 6))
    errs = grad_errors(lambda x, w1, w2: ops.mlp_forward(x, w1, w2, act), ops.mlp_backward,
                       [x, w1, w2], rng)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("layernorm", [False, True])
def test_postnorm_residual_grad(rng, layernorm):
    x, fx = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
    g, b = rng.standard_normal(5), rng.standard_normal(5) if layernorm else None
    inputs = [x, fx, g] + ([b] if layernorm else [])

    def fwd(x, fx, g, b=None):
        return ops.postnorm_residual_forward(x, fx, g, b, 1e-5)

    errs = grad_errors(fwd, ops.postnorm_residual_backward, inputs, rng)
    assert len(errs) == len(inputs) and max(errs) < TOL, errs


def test_logit_scale_grad(rng):
    z = rng.standard_normal((3, 7))
    errs = grad_errors(lambda z: ops.logit_scale_forward(z, 0.3), ops.logit_scale_backward, [z],
                       rng)
    assert errs[0] < TOL


@pytest.mark.parametrize("H,KVH", [(4, 4), (4, 2), (4, 1)])
def test_cross_attention_grad(rng, H, KVH):
    B, M, L, hd = 2, 3, 5, 4
    q = rng.standard_normal((B, M, H, hd))
    k, v = rng.standard_normal((2, B, L, KVH, hd))
    errs = grad_errors(ops.cross_attention_forward, ops.cross_attention_backward, [q, k, v], rng)
    assert max(errs) < TOL, errs


def test_latent_expand_grad(rng):
    z = rng.standard_normal((3, 4))
    errs = grad_errors(lambda z: ops.latent_expand_forward(z, 5), ops.latent_expand_backward,
                       [z], rng)
    assert errs[0] < TOL


def test_latent_block_grad(rng):
    cfg = latent.LatentConfig(dim=6, n_latents=3, n_heads=3, n_kv_heads=1, hidden_dim=5)
    p = latent.init_block(cfg, rng)
    z, x = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 4, 6))
    fwd = lambda z, x: latent.latent_block_forward(z, x, p, 3, 1)  # noqa: E731
    out, ctx = fwd(z, x)
    R = rng.standard_normal(out.shape)
    dz, dx, grads = latent.latent_block_backward(R, ctx)

    def scalar():
        return float(np.sum(fwd(z, x)[0] * R))

    assert rel_err(dz, numeric_grad(scalar, z)) < TOL
    assert rel_err(dx, numeric_grad(scalar, x)) < TOL
    assert set(grads) == set(p)
    for name in p:
        assert rel_err(grads[name], numeric_grad(scalar, p[name])) < TOL, name


def test_perceiver_grads(rng):
    cfg = latent.LatentConfig(vocab_size=5, dim=8, n_latents=2, n_heads=2, n_kv_heads=1,
                              hidden_dim=8, n_blocks=2, n_classes=3)
    model = latent.PerceiverClassifier(cfg, seed=1)
    tok, lab = rng.integers(0, 5, (3, 6)), rng.integers(0, 3, 3)
    _, grads = model.loss_and_grads(tok, lab)
    for name in ("latents", "blocks.0.cross.wk.weight", "blocks.1.ffn_norm.bias"):
        num = numeric_grad(lambda: model.loss_and_grads(tok, lab)[0], model.params[name])
        assert rel_err(grads[name], num) < TOL, name


def test_batchnorm_running_stats_and_inference(rng):
    x = rng.standard_normal((6, 3, 4)) * 2 + 1
    g, b = rng.standard_normal(3), rng.standard_normal(3)
    running = {"mean": np.zeros(3), "var": np.ones(3)}
    ops.batchnorm_forward(x, g, b, 1e-5, running, momentum=0.25)
    mu, var_u = x.mean(axis=(0, 2)), x.var(axis=(0, 2), ddof=1)
    np.testing.assert_allclose(running["mean"], 0.25 * mu, rtol=1e-12)
    np.testing.assert_allclose(running["var"], 0.75 + 0.25 * var_u, rtol=1e-12)
    # inference with the batch's own (biased) statistics reproduces training mode
    y_train, _ = ops.batchnorm_forward(x, g, b, 1e-5)
    y_inf = ops.batchnorm_inference(x, g, b, mu, x.var(axis=(0, 2)), 1e-5)
    np.testing.assert_allclose(y_inf, y_train, rtol=1e-10, atol=1e-12)
    # and one sample's inference output does not depend on the rest of the batch
    one = ops.batchnorm_inference(x[:1], g, b, running["mean"], running["var"], 1e-5)
    allb = ops.batchnorm_inference(x, g, b, running["mean"], running["var"], 1e-5)
    np.testing.assert_array_equal(one[0], allb[0])


def test_sinusoidal_table():
    P = ops.sinusoidal_positions(50, 8, dtype=np.float64)
    assert P.shape == (50, 8)
    np.testing.assert_allclose(P[:, 0], np.sin(np.arange(50)))
    np.testing.assert_allclose(P[:, 1], np.cos(np.arange(50)))
    np.testing.assert_allclose(P[7, 6], np.sin(7 / 10000 ** (6 / 8)))
    np.testing.assert_allclose(P[0], [0, 1] * 4)
    with pytest.raises(ops_error()):
        ops.sinusoidal_positions(4, 7)


def ops_error():
    from minillama.core.errors import MinillamaError

    return MinillamaError


def test_latent_config_rejects_zero_latents():
    with pytest.raises(ops_error(), match="n_latents"):
        latent.LatentConfig(n_latents=0)


# ---------------------------------------------------------------------------------------------
# against torch.autograd
# ---------------------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


def _t(torch, a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def test_layernorm_batchnorm_gelu_vs_torch(rng):
    torch = _torch()
    F = torch.nn.functional
    x, g, b = rng.standard_normal((3, 4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    R = rng.standard_normal(x.shape)
    y, ctx = ops.layernorm_forward(x, g, b, 1e-5)
    tx, tg, tb = _t(torch, x), _t(torch, g), _t(torch, b)
    ty = F.layer_norm(tx, (6,), tg, tb, 1e-5)
    (ty * torch.tensor(R)).sum().backward()
    assert rel_err(y, ty.detach().numpy()) < 1e-12
    for ours, theirs in zip(ops.layernorm_backward(R, ctx), (tx, tg, tb)):
        assert rel_err(ours, theirs.grad.numpy()) < 1e-10

    x, g, b = rng.standard_normal((5, 4, 3)), rng.standard_normal(4), rng.standard_normal(4)
    R = rng.standard_normal(x.shape)
    running = {"mean": np.zeros(4), "var": np.ones(4)}
    y, ctx = ops.batchnorm_forward(x, g, b, 1e-5, running, momentum=0.1)
    tx, tg, tb = _t(torch, x), _t(torch, g), _t(torch, b)
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    ty = F.batch_norm(tx, rm, rv, tg, tb, training=True, momentum=0.1, eps=1e-5)
    (ty * torch.tensor(R)).sum().backward()
    assert rel_err(y, ty.detach().numpy()) < 1e-12
    for ours, theirs in zip(ops.batchnorm_backward(R, ctx), (tx, tg, tb)):
        assert rel_err(ours, theirs.grad.numpy()) < 1e-10
    np.testing.assert_allclose(running["mean"], rm.numpy(), rtol=1e-12)
    np.testing.assert_allclose(running["var"], rv.numpy(), rtol=1e-12)
    yi = ops.batchnorm_inference(x, g, b, running["mean"], running["var"], 1e-5)
    tyi = F.batch_norm(torch.tensor(x), rm, rv, torch.tensor(g), torch.tensor(b), training=False,
                       eps=1e-5)
    assert rel_err(yi, tyi.numpy()) < 1e-12

    a = rng.standard_normal((4, 5)) * 3
    R = rng.standard_normal(a.shape)
    h, ctx = ops.gelu_forward(a)
    ta = _t(torch, a)
    th = F.gelu(ta, approximate="tanh")
    (th * torch.tensor(R)).sum().backward()
    assert rel_err(h, th.detach().numpy()) < 1e-12
    assert rel_err(ops.gelu_backward(R, ctx), ta.grad.numpy()) < 1e-12


def test_cross_attention_vs_torch(rng):
    torch = _torch()
    B, M, L, H, KVH, hd = 2, 3, 7, 4, 2, 4
    q = rng.standard_normal((B, M, H, hd))
    k, v = rng.standard_normal((2, B, L, KVH, hd))
    R = rng.standard_normal((B, M, H, hd))
    o, ctx = ops.cross_attention_forward(q, k, v)
    tq, tk, tv = _t(torch, q), _t(torch, k), _t(torch, v)
    rep = H // KVH
    to = torch.nn.functional.scaled_dot_product_attention(
        tq.transpose(1, 2), tk.repeat_interleave(rep, dim=2).transpose(1, 2),
        tv.repeat_interleave(rep, dim=2).transpose(1, 2)).transpose(1, 2)
    (to * torch.tensor(R)).sum().backward()
    assert rel_err(o, to.detach().numpy()) < 1e-12
    for ours, theirs in zip(ops.cross_attention_backward(R, ctx), (tq, tk, tv)):
        assert rel_err(ours, theirs.grad.numpy()) < 1e-10


# ---------------------------------------------------------------------------------------------
# the latent block end to end: a Perceiver-style classifier learns a toy task
# ---------------------------------------------------------------------------------------------
def majority_task(rng, n, L=24, K=3):
    """Sequences of L symbols from {0..K-1}; the label is the most frequent symbol (ties broken
    by re-drawing). Needs every token (order does not matter). Chance accuracy is 1/K."""
    x = rng.integers(0, K, (n * 2, L))
    counts = np.stack([(x == c).sum(1) for c in range(K)], 1)
    top = np.sort(counts, 1)
    keep = top[:, -1] > top[:, -2]
    x, counts = x[keep][:n], counts[keep][:n]
    return x, counts.argmax(1)


def test_perceiver_learns_majority():
    from minillama.train.optim import AdamW

    rng = np.random.default_rng(0)
    K = 3
    cfg = latent.LatentConfig(vocab_size=K, dim=16, n_latents=4, n_heads=2, n_kv_heads=1,
                              hidden_dim=32, n_blocks=1, n_classes=K)
    model = latent.PerceiverClassifier(cfg, seed=0)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    for _ in range(150):
        x, y = majority_task(rng, 32)
        _, grads = model.loss_and_grads(x, y)
        opt.step(grads)
    xt, yt = majority_task(np.random.default_rng(1), 600)
    acc = float((model.forward(xt).argmax(-1) == yt).mean())
    # chance is 1/3; three standard errors of a chance-level accuracy on 600 samples are ~0.06
    assert acc > 0.7, acc
