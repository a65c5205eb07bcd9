"""The model and its ops against an independent PyTorch re-implementation (autograd gradients).

The reference (``tests/support/torch_llama.py``) is written directly from the LLaMA paper /
Meta's code, with the obvious (not the efficient) choices: interleaved-pair RoPE via complex
multiplication, K/V repeated per group with ``repeat_interleave``, an explicit additive causal
mask. Same random weights on both sides; logits and every parameter gradient must agree within a
norm-based relative error of 1e-4 in float32 and 1e-10 in float64. torch is test-only; the test
skips when it is not importable.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama import ModelConfig, Transformer
from minillama.core import ops
from tests.support.helpers import lively_params

torch = pytest.importorskip("torch")

from tests.support.torch_llama import t_attention, t_forward, t_rmsnorm, t_rope  # noqa: E402

TOL = {np.float32: 1e-4, np.float64: 1e-10}
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}


def rel_err(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    den = max(np.linalg.norm(a), np.linalg.norm(b))
    assert den > 0
    return float(np.linalg.norm(a - b) / den)


# ---------------------------------------------------------------------------------------------
def random_params(cfg, seed):
    return lively_params(cfg, seed, scale=0.15)


CONFIGS = {
    "gqa-tied": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37,
                            hidden_dim=48, max_seq_len=32, tie_embeddings=True),
    "mqa-untied": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=37,
                              hidden_dim=40, max_seq_len=32, tie_embeddings=False),
    "mha-untied": ModelConfig(dim=24, n_layers=3, n_heads=3, n_kv_heads=3, vocab_size=29,
                              hidden_dim=64, max_seq_len=32, tie_embeddings=False,
                              rope_theta=500000.0, norm_eps=1e-6),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_matches_torch(backend, name, dtype):
    if dtype == np.float64 and not backend.supports_float64:
        pytest.skip(f"backend {backend.name} declares no float64 support")
    cfg = CONFIGS[name]
    params = {k: v.astype(dtype) for k, v in random_params(cfg, seed=11).items()}
    rng = np.random.default_rng(4)
    B, T = 3, 12
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[1, :3] = -1

    model = Transformer(cfg, params, backend=backend, dtype=dtype)
    logits = np.asarray(backend.to_numpy(model.forward(tokens)))
    loss, grads = model.loss_and_grads(tokens, targets)

    tp = {k: torch.tensor(v, dtype=TORCH_DTYPE[dtype], requires_grad=True)
          for k, v in params.items()}
    tlogits = t_forward(cfg, tp, torch.tensor(tokens))
    tloss = torch.nn.functional.cross_entropy(tlogits.reshape(B * T, -1),
                                              torch.tensor(targets.reshape(-1)),
                                              ignore_index=-1)
    tloss.backward()

    tol = TOL[dtype]
    assert rel_err(logits, tlogits.detach().numpy()) <= tol
    assert abs(loss - tloss.item()) <= tol * abs(tloss.item())
    errs = {k: rel_err(backend.to_numpy(grads[k]), tp[k].grad.numpy()) for k in params}
    bad = {k: e for k, e in errs.items() if e > tol}
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# per-op checks against torch autograd (float64)
# ---------------------------------------------------------------------------------------------
def _grads(t_out, inputs, R):
    (t_out * torch.tensor(R)).sum().backward()
    return [i.grad.numpy() for i in inputs]


@pytest.mark.parametrize("H,KVH,T,S,start", [(4, 2, 5, 5, 0), (6, 3, 3, 8, 5), (4, 1, 1, 7, 6)])
def test_attention_matches_torch(rng, H, KVH, T, S, start):
    B, hd = 2, 8
    q = rng.standard_normal((B, T, H, hd))
    k = rng.standard_normal((B, S, KVH, hd))
    v = rng.standard_normal((B, S, KVH, hd))
    out, ctx = ops.attention_forward(q, k, v, start)
    R = rng.standard_normal(out.shape)
    dq, dk, dv = ops.attention_backward(R, ctx)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tout = t_attention(tq, tk, tv, start)
    assert rel_err(out, tout.detach().numpy()) <= 1e-12
    for a, b in zip((dq, dk, dv), _grads(tout, (tq, tk, tv), R)):
        assert rel_err(a, b) <= 1e-12
    # torch's fused kernel agrees too (its causal mask is top-left aligned, so only for S == T)
    if S == T:
        ref = torch.nn.functional.scaled_dot_product_attention(
            tq.detach().transpose(1, 2), tk.detach().transpose(1, 2), tv.detach().transpose(1, 2),
            is_causal=True, enable_gqa=True).transpose(1, 2)
        assert rel_err(out, ref.numpy()) <= 1e-12


def test_rope_matches_torch_complex(rng):
    B, T, nh, hd = 2, 7, 3, 16
    cos, sin = ops.rope_tables(hd, 64, 10000.0, np.float64)
    x = rng.standard_normal((B, T, nh, hd))
    y, ctx = ops.rope_forward(x, cos[9:9 + T], sin[9:9 + T])
    tx = torch.tensor(x, requires_grad=True)
    ty = t_rope(tx, torch.arange(9, 9 + T), 10000.0)
    assert rel_err(y, ty.detach().numpy()) <= 1e-13
    R = rng.standard_normal(y.shape)
    (g,) = _grads(ty, (tx,), R)
    assert rel_err(ops.rope_backward(R, ctx), g) <= 1e-13


def test_rmsnorm_swiglu_ce_match_torch(rng):
    x = rng.standard_normal((4, 6, 10))
    g = rng.standard_normal(10)
    y, ctx = ops.rmsnorm_forward(x, g, 1e-3)
    R = rng.standard_normal(y.shape)
    tx, tg = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
    ty = t_rmsnorm(tx, tg, 1e-3)
    assert rel_err(y, ty.detach().numpy()) <= 1e-13
    for a, b in zip(ops.rmsnorm_backward(R, ctx), _grads(ty, (tx, tg), R)):
        assert rel_err(a, b) <= 1e-12

    a, b = 3 * rng.standard_normal((5, 9)), rng.standard_normal((5, 9))
    h, ctx = ops.swiglu_forward(a, b)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    th = torch.nn.functional.silu(ta) * tb
    assert rel_err(h, th.detach().numpy()) <= 1e-13
    R = rng.standard_normal(h.shape)
    for u, w in zip(ops.swiglu_backward(R, ctx), _grads(th, (ta, tb), R)):
        assert rel_err(u, w) <= 1e-12

    z = 4 * rng.standard_normal((8, 13))
    t = rng.integers(0, 13, 8)
    t[[0, 5]] = 7
    t[2] = -100
    loss, ctx = ops.cross_entropy_forward(z, t, -100)
    tz = torch.tensor(z, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(tz, torch.tensor(t), ignore_index=-100)
    assert float(loss) == pytest.approx(tl.item(), rel=1e-13)
    tl.backward()
    assert rel_err(ops.cross_entropy_backward(1.0, ctx), tz.grad.numpy()) <= 1e-12
