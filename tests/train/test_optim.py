"""AdamW, gradient clipping and the learning-rate schedule against hand-computed references and
torch.optim.AdamW / torch.nn.utils.clip_grad_norm_ (when torch is installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minillama.core.errors import MinillamaError
from minillama.train.optim import AdamW, clip_grad_norm, global_grad_norm, lr_at

SHAPES = {"tok_embeddings.weight": (7, 4), "layers.0.attention_norm.weight": (4,),
          "layers.0.attention.wq.weight": (4, 4), "norm.weight": (4,)}


def _params(rng, dtype=np.float64):
    return {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}


def _grads(rng, scale=1.0, dtype=np.float64):
    return {k: (scale * rng.normal(size=s)).astype(dtype) for k, s in SHAPES.items()}


def _reference_adamw(p, g, m, v, t, lr, b1, b2, eps, wd):
    """The AdamW update written out from the paper's equations, one scalar formula at a time."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def test_adamw_matches_hand_computed_steps(rng):
    params = _params(rng)
    ref = {k: v.copy() for k, v in params.items()}
    ms = {k: np.zeros_like(v) for k, v in params.items()}
    vs = {k: np.zeros_like(v) for k, v in params.items()}
    lr, b1, b2, eps, wd = 3e-2, 0.9, 0.95, 1e-8, 0.1
    opt = AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t in range(1, 5):
        grads = _grads(rng)
        step_lr = lr * t / 4  # a schedule passes a different lr each step
        opt.step(grads, lr=step_lr)
        for k in ref:
            wd_k = 0.0 if k.endswith("norm.weight") else wd
            ref[k], ms[k], vs[k] = _reference_adamw(ref[k], grads[k], ms[k], vs[k], t, step_lr,
                                                    b1, b2, eps, wd_k)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-12, atol=1e-14, err_msg=k)
        np.testing.assert_allclose(opt.m[k], ms[k], rtol=1e-12, err_msg=k)
        np.testing.assert_allclose(opt.v[k], vs[k], rtol=1e-12, err_msg=k)
    assert opt.t == 4


def test_weight_decay_only_where_allowed(rng):
    """Zero gradients: Adam's part of the update is 0, so only the decay moves a parameter."""
    for decay_emb in (True, False):
        params = _params(rng)
        before = {k: v.copy() for k, v in params.items()}
        opt = AdamW(params, lr=0.1, weight_decay=0.5, decay_embeddings=decay_emb)
        opt.step({k: np.zeros_like(v) for k, v in params.items()})
        for k in params:
            decays = not k.endswith("norm.weight") and (decay_emb or k != "tok_embeddings.weight")
            expected = before[k] * (1 - 0.1 * 0.5) if decays else before[k]
            np.testing.assert_allclose(params[k], expected, rtol=1e-14, err_msg=k)


def test_custom_no_decay_predicate(rng):
    params = _params(rng)
    before = {k: v.copy() for k, v in params.items()}
    opt = AdamW(params, lr=0.1, weight_decay=0.5, no_decay=lambda name: "wq" in name)
    opt.step({k: np.zeros_like(v) for k, v in params.items()})
    np.testing.assert_array_equal(params["layers.0.attention.wq.weight"],
                                  before["layers.0.attention.wq.weight"])
    np.testing.assert_allclose(params["norm.weight"], before["norm.weight"] * 0.95)


def test_float32_params_stay_float32_in_place(rng):
    params = _params(rng, np.float32)
    ids = {k: id(v) for k, v in params.items()}
    opt = AdamW(params, lr=1e-3)
    opt.step(_grads(rng, dtype=np.float32))
    for k, v in params.items():
        assert v.dtype == np.float32 and id(v) == ids[k]
        assert opt.m[k].dtype == np.float32 and opt.v[k].dtype == np.float32


def test_state_dict_round_trip_continues_identically(rng):
    grads = [_grads(rng) for _ in range(6)]
    p0 = _params(rng)
    a = {k: v.copy() for k, v in p0.items()}
    opt_a = AdamW(a, lr=1e-2)
    for g in grads:
        opt_a.step({k: v.copy() for k, v in g.items()})

    b = {k: v.copy() for k, v in p0.items()}
    opt_b = AdamW(b, lr=1e-2)
    for g in grads[:3]:
        opt_b.step({k: v.copy() for k, v in g.items()})
    state = opt_b.state_dict()
    saved = {"step": state["step"], "m": {k: v.copy() for k, v in state["m"].items()},
             "v": {k: v.copy() for k, v in state["v"].items()}}
    c = {k: v.copy() for k, v in b.items()}
    opt_c = AdamW(c, lr=1e-2)
    opt_c.load_state_dict(saved)
    for g in grads[3:]:
        opt_c.step({k: v.copy() for k, v in g.items()})
    for k in a:
        np.testing.assert_array_equal(c[k], a[k])


def test_load_state_dict_rejects_mismatch(rng):
    opt = AdamW(_params(rng), lr=1e-3)
    state = opt.state_dict()
    bad = {"step": 1, "m": dict(state["m"]), "v": dict(state["v"])}
    bad["m"]["norm.weight"] = np.zeros(5)
    with pytest.raises(MinillamaError, match="norm.weight"):
        opt.load_state_dict(bad)
    missing = {"step": 1, "m": {}, "v": dict(state["v"])}
    with pytest.raises(MinillamaError, match="lacks m"):
        opt.load_state_dict(missing)


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=0.0),
                                    dict(weight_decay=-0.1)])
def test_bad_hyperparameters(rng, kwargs):
    with pytest.raises(MinillamaError):
        AdamW(_params(rng), **kwargs)


def test_step_rejects_missing_or_misshapen_grads(rng):
    params = _params(rng)
    opt = AdamW(params)
    g = _grads(rng)
    del g["norm.weight"]
    with pytest.raises(MinillamaError, match="norm.weight"):
        opt.step(g)
    g = _grads(rng)
    g["norm.weight"] = np.zeros(3)
    with pytest.raises(MinillamaError, match="shape"):
        opt.step(g)


# --- clipping ----------------------------------------------------------------------------------
def test_clip_grad_norm_scales_to_max_norm(rng):
    g = _grads(rng, scale=10.0)
    expected_norm = math.sqrt(sum(float((v ** 2).sum()) for v in g.values()))
    before = {k: v.copy() for k, v in g.items()}
    norm = clip_grad_norm(g, 1.0)
    assert norm == pytest.approx(expected_norm, rel=1e-12)
    assert global_grad_norm(g) == pytest.approx(1.0, rel=1e-5)
    coef = 1.0 / (expected_norm + 1e-6)
    for k in g:
        np.testing.assert_allclose(g[k], before[k] * coef, rtol=1e-12)


def test_clip_grad_norm_leaves_small_or_nonfinite_grads(rng):
    g = _grads(rng, scale=1e-3)
    before = {k: v.copy() for k, v in g.items()}
    clip_grad_norm(g, 1.0)
    for k in g:
        np.testing.assert_array_equal(g[k], before[k])
    g["norm.weight"][0] = np.nan
    assert math.isnan(clip_grad_norm(g, 1.0))
    g = _grads(rng, scale=10.0)
    before = {k: v.copy() for k, v in g.items()}
    assert clip_grad_norm(g, 0.0) > 1.0  # 0 disables clipping
    for k in g:
        np.testing.assert_array_equal(g[k], before[k])


# --- schedule ----------------------------------------------------------------------------------
def test_lr_schedule_warmup_then_cosine():
    max_lr, min_lr, W, N = 1e-3, 1e-4, 10, 110
    lrs = [lr_at(s, max_lr, W, N, min_lr) for s in range(N + 5)]
    np.testing.assert_allclose(lrs[:W], [max_lr * (s + 1) / W for s in range(W)])
    assert lrs[W] == pytest.approx(max_lr)
    assert lrs[W + 50] == pytest.approx((max_lr + min_lr) / 2)  # half way through the cosine
    assert all(a >= b for a, b in zip(lrs[W:N], lrs[W + 1:N + 1]))
    assert lrs[N] == lrs[N + 4] == min_lr
    assert lr_at(0, 1.0, 0, 10, 0.0) == pytest.approx(1.0)  # no warmup


# --- against PyTorch ---------------------------------------------------------------------------
def test_adamw_and_clipping_match_torch(rng):
    torch = pytest.importorskip("torch")
    params = _params(rng)
    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    decay = [tparams[k] for k in params if not k.endswith("norm.weight")]
    no_decay = [tparams[k] for k in params if k.endswith("norm.weight")]
    lr, betas, eps, wd = 5e-2, (0.9, 0.95), 1e-8, 0.1
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=eps)
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for step in range(6):
        scale = 5.0 if step % 2 else 0.1  # clipping active on odd steps only
        grads = _grads(rng, scale=scale)
        step_lr = lr * (0.5 + 0.1 * step)
        for group in topt.param_groups:
            group["lr"] = step_lr
        for k, p in tparams.items():
            p.grad = torch.tensor(grads[k])
        tnorm = torch.nn.utils.clip_grad_norm_(list(tparams.values()), 1.0)
        norm = clip_grad_norm(grads, 1.0)
        assert norm == pytest.approx(float(tnorm), rel=1e-10)
        topt.step()
        opt.step(grads, lr=step_lr)
        for k in params:
            np.testing.assert_allclose(params[k], tparams[k].detach().numpy(), rtol=1e-10,
                                       atol=1e-12, err_msg=f"step {step} {k}")


def test_adamw_on_each_backend(backend, rng):
    """The optimizer runs on the backend's array module and agrees with the NumPy one."""
    host = _params(rng, np.float32)
    grads = [_grads(rng, dtype=np.float32) for _ in range(3)]
    ref = {k: v.copy() for k, v in host.items()}
    ref_opt = AdamW(ref, lr=1e-2)
    dev = {k: backend.asarray(v) for k, v in host.items()}
    dev_opt = AdamW(dev, lr=1e-2, backend=backend)  # the fused kernel where the backend has one
    for g in grads:
        ref_opt.step({k: v.copy() for k, v in g.items()})
        dg = {k: backend.asarray(v.copy()) for k, v in g.items()}
        clip_grad_norm(dg, 1e9)
        dev_opt.step(dg)
    for k in ref:
        np.testing.assert_allclose(backend.to_numpy(dev[k]), ref[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numba_fused_adamw_matches_array_path_and_hand_computed(dtype):
    """The numba backend's one-pass AdamW (serial for small buffers, chunked over the threads
    for a large one) against the NumPy array path and the scalar formulas."""
    from minillama.backends import get_backend

    try:
        be = get_backend("numba")
    except MinillamaError as e:
        pytest.skip(f"numba backend unavailable: {e}")
    rng = np.random.default_rng(3)
    shapes = dict(SHAPES, **{"layers.0.feed_forward.w1.weight": (600, 512)})  # > 2^14: parallel
    start = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
    fused = {k: a.copy() for k, a in start.items()}
    plain = {k: a.copy() for k, a in start.items()}
    ref = {k: a.astype(np.float64) for k, a in start.items()}
    ms = {k: np.zeros(s) for k, s in shapes.items()}
    vs = {k: np.zeros(s) for k, s in shapes.items()}
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    o_fused = AdamW(fused, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, backend=be)
    o_plain = AdamW(plain, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    assert o_fused._fused is not None and o_plain._fused is None
    for t in range(1, 4):
        grads = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
        grads["norm.weight"] = np.repeat(grads["norm.weight"], 2)[::2]  # a strided gradient
        o_fused.step(grads, lr=lr / t)
        o_plain.step(grads, lr=lr / t)
        for k in ref:
            wd_k = 0.0 if k.endswith("norm.weight") else wd
            ref[k], ms[k], vs[k] = _reference_adamw(ref[k], grads[k].astype(np.float64), ms[k],
                                                    vs[k], t, lr / t, b1, b2, eps, wd_k)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == np.float64 else dict(rtol=2e-6, atol=1e-7)
    for k in ref:
        assert fused[k].dtype == dtype
        np.testing.assert_allclose(fused[k], ref[k], **tol, err_msg=k)
        np.testing.assert_allclose(plain[k], ref[k], **tol, err_msg=k)
        np.testing.assert_allclose(o_fused.m[k], ms[k], **tol, err_msg=k)
        np.testing.assert_allclose(o_fused.v[k], vs[k], rtol=tol["rtol"], atol=1e-12, err_msg=k)
    with pytest.raises(MinillamaError, match="shapes differ"):
        be.adamw_update(fused["norm.weight"], np.zeros(3, dtype), o_fused.m["norm.weight"],
                        o_fused.v["norm.weight"], lr, b1, b2, eps, 0.0, 1)
