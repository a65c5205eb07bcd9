"""The CuPy backend's CUDA kernels against the NumPy reference ops (needs a CUDA GPU).

Every kernel, forward and every gradient, under hypothesis over random shapes: sizes that are not
multiples of the block/tile sizes, T = 1 (the decode kernel), head dimensions up to 128, MHA, GQA
and MQA, per-sequence start positions and KV-cache views. float32 agrees to 1e-4 relative, float64
to 1e-10. The whole-model tests (gradient checks, KV-cache equivalence, golden tokens) run on this
backend through the ``backend`` fixture of conftest.py.

Without a GPU (or without CuPy) the whole module is skipped with the reason.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.backends import get_backend
from minillama.core import ops
from minillama.core.errors import MinillamaError
from tests.support.helpers import PARITY_TOL, max_rel_err

try:
    BE = get_backend("cupy")
except MinillamaError as _e:
    pytestmark = pytest.mark.skip(reason=str(_e))  # "no CUDA GPU found (...)" / "CuPy is not ..."
    BE = None
else:
    import cupy as cp

    from minillama.backends.cupy import backend as cbk
    from minillama.backends.cupy import build as cb

    pytestmark = pytest.mark.gpu

TOL = PARITY_TOL["cupy"]
#: hypothesis examples per test (MINILLAMA_GPU_EXAMPLES overrides, e.g. for a quick run)
N_EXAMPLES = int(os.environ.get("MINILLAMA_GPU_EXAMPLES", "30"))
EXAMPLES = settings(max_examples=N_EXAMPLES, deadline=None)


def rel_err(got, ref, floor: float = 1e-2) -> float:
    """max |got - ref| / max(max |ref|, floor), ``got`` on the device."""
    return max_rel_err(BE.to_numpy(got), ref, floor)


def close(got, ref, dtype, what="", floor: float = 1e-2):
    err = rel_err(got, ref, floor)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def dev(a):
    return cp.asarray(a)


dtypes = st.sampled_from([np.float32, np.float64])


# ------------------------------------------------------------------------------------------------
@EXAMPLES
@given(st.integers(1, 300), st.integers(1, 1100), dtypes, st.integers(0, 2 ** 31 - 1))
def test_rmsnorm(N, D, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)).astype(dtype)
    g = rng.standard_normal(D).astype(dtype)
    dy = rng.standard_normal((N, D)).astype(dtype)
    y_ref, c_ref = ops.rmsnorm_forward(x, g, 1e-5)
    dx_ref, dg_ref = ops.rmsnorm_backward(dy, c_ref)
    y, c = BE.rmsnorm_forward(dev(x), dev(g), 1e-5)
    dx, dg = BE.rmsnorm_backward(dev(dy), c)
    close(y, y_ref, dtype, "rmsnorm y")
    close(dx, dx_ref, dtype, "rmsnorm dx")
    close(dg, dg_ref, dtype, "rmsnorm dg")


def test_rmsnorm_3d_keeps_shape():
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    g = np.ones(5, np.float32)
    y, c = BE.rmsnorm_forward(dev(x), dev(g), 1e-6)
    assert y.shape == x.shape
    dx, dg = BE.rmsnorm_backward(dev(np.ones_like(x)), c)
    assert dx.shape == x.shape and dg.shape == (5,)


# ------------------------------------------------------------------------------------------------
@EXAMPLES
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 5), st.integers(1, 64), st.booleans(),
       dtypes, st.integers(0, 2 ** 31 - 1))
def test_rope(B, T, nh, half, per_seq, dtype, seed):
    rng = np.random.default_rng(seed)
    hd = 2 * half
    cos, sin = ops.rope_tables(hd, 128, 10000.0, dtype)
    if per_seq:
        pos = rng.integers(0, 128 - T, B)[:, None] + np.arange(T)[None]
        cs, sn = cos[pos], sin[pos]
    else:
        s = int(rng.integers(0, 128 - T))
        cs, sn = cos[s:s + T], sin[s:s + T]
    x = rng.standard_normal((B, T, nh, hd)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y_ref, c_ref = ops.rope_forward(x, cs, sn)
    dx_ref = ops.rope_backward(dy, c_ref)
    xd = dev(x)
    y, c = BE.rope_forward(xd, dev(cs), dev(sn))
    close(y, y_ref, dtype, "rope y")
    close(xd, x, dtype, "rope must not modify its input by default")
    close(BE.rope_backward(dev(dy), c), dx_ref, dtype, "rope dx")
    y2, _ = BE.rope_forward(xd, dev(cs), dev(sn), out=xd)  # in place
    assert y2 is xd
    close(xd, y_ref, dtype, "rope in place")


# ------------------------------------------------------------------------------------------------
@st.composite
def attn_case(draw):
    KVH = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))  # G = 1: MHA; KVH = 1: MQA; else GQA
    B = draw(st.integers(1, 3))
    T = draw(st.one_of(st.just(1), st.integers(1, 80)))
    extra = draw(st.one_of(st.just(0), st.integers(0, 40)))  # earlier positions from a cache
    hd = draw(st.sampled_from([2, 6, 8, 16, 24, 40, 64, 72, 96, 128]))
    per_seq = draw(st.booleans())
    return B, T, KVH * G, KVH, hd, extra, per_seq, draw(dtypes), draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=N_EXAMPLES + 10, deadline=None)
@given(attn_case())
def test_attention(case):
    B, T, H, KVH, hd, extra, per_seq, dtype, seed = case
    rng = np.random.default_rng(seed)
    S = T + extra
    start = rng.integers(0, extra + 1, B) if per_seq else extra
    q = rng.standard_normal((B, T, H, hd)).astype(dtype)
    k = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    v = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    do = rng.standard_normal((B, T, H, hd)).astype(dtype)
    o_ref, c_ref = ops.attention_forward(q, k, v, start)
    grads_ref = ops.attention_backward(do, c_ref)
    o, c = BE.attention_forward(dev(q), dev(k), dev(v), start)
    close(o, o_ref, dtype, f"attention out {case}")
    grads = BE.attention_backward(dev(do), c)
    # dq and dk are exactly 0 when a query sees one key (S = 1): dP - D cancels, and both sides
    # keep float32 noise of eps |dO . v| ~ 1e-6, so their floor is 0.1 (the gradients are O(1))
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        close(g, r, dtype, f"attention {name} {case}", floor=0.1 if name != "dv" else 1e-2)


@settings(max_examples=max(N_EXAMPLES // 2, 1), deadline=None)
@given(st.integers(1, 8), st.integers(1, 60), st.sampled_from([(4, 4), (8, 2), (6, 1)]),
       st.sampled_from([8, 48, 64, 128]), dtypes, st.integers(0, 2 ** 31 - 1))
def test_decode_reads_a_kv_cache_view(B, filled, heads, hd, dtype, seed):
    """T = 1 against a strided (B, :end) view of a longer cache, each sequence at its position."""
    H, KVH = heads
    rng = np.random.default_rng(seed)
    Smax = filled + 7
    kc = rng.standard_normal((B, Smax, KVH, hd)).astype(dtype)
    vc = rng.standard_normal((B, Smax, KVH, hd)).astype(dtype)
    q = rng.standard_normal((B, 1, H, hd)).astype(dtype)
    pos = rng.integers(0, filled, B)
    end = int(pos.max()) + 1
    o_ref, _ = ops.attention_forward(q, kc[:, :end], vc[:, :end], pos)
    kd, vd = dev(kc), dev(vc)
    o, _ = BE.attention_forward(dev(q), kd[:, :end], vd[:, :end], pos)
    close(o, o_ref, dtype, "decode")
    o_int, _ = BE.attention_forward(dev(q), kd[:, :end], vd[:, :end], end - 1)
    o_ref_int, _ = ops.attention_forward(q, kc[:, :end], vc[:, :end], end - 1)
    close(o_int, o_ref_int, dtype, "decode, int start")


FLASH_SHAPES = [  # (B, T, H, KVH, hd, extra cached positions): MHA, GQA, MQA; tiles not full
    (2, 77, 4, 4, 64, 0), (1, 200, 6, 2, 64, 9), (3, 33, 8, 1, 64, 0),
    (1, 130, 4, 4, 128, 0), (2, 65, 8, 2, 128, 5), (1, 150, 4, 1, 128, 0),
]


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("shape", FLASH_SHAPES, ids=str)
def test_flash_attention_matches_reference(shape, precision, monkeypatch):
    """The tensor-core kernels (flash_attention.cu) against the float64 reference: 3xTF32 within
    the float32 tolerance, one TF32 product within 5e-3; every element finite."""
    if not BE.flash:
        pytest.skip("the flash kernels need compute capability 8.0+")
    monkeypatch.setattr(BE, "attention_precision", precision)
    B, T, H, KVH, hd, extra = shape
    rng = np.random.default_rng(T * H + hd)
    S = T + extra
    start = rng.integers(0, extra + 1, B) if extra else 0
    q, do = (rng.standard_normal((B, T, H, hd)) for _ in range(2))
    k, v = (rng.standard_normal((B, S, KVH, hd)) for _ in range(2))
    o_ref, c_ref = ops.attention_forward(q, k, v, start)
    grads_ref = ops.attention_backward(do, c_ref)
    assert BE._flash_expr(np.float32, hd, T) is not None
    f32 = [dev(a.astype(np.float32)) for a in (q, k, v, do)]
    o, c = BE.attention_forward(f32[0], f32[1], f32[2], start)
    grads = BE.attention_backward(f32[3], c)
    tol = 1e-4 if precision == "fp32" else 5e-3
    for name, g, r in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        assert bool(cp.isfinite(g).all()), name
        err = rel_err(g, r, floor=0.1)
        assert err <= tol, f"{name} {shape} {precision}: {err:.3g} > {tol}"


def test_attention_is_repeatable_bit_for_bit():
    """The same inputs give the same bits (no atomics, no order that depends on timing)."""
    rng = np.random.default_rng(11)
    q, do = (dev(rng.standard_normal((2, 300, 8, 64)).astype(np.float32)) for _ in range(2))
    k, v = (dev(rng.standard_normal((2, 300, 2, 64)).astype(np.float32)) for _ in range(2))
    runs = []
    for _ in range(2):
        o, c = BE.attention_forward(q, k, v, 0)
        runs.append([cp.asnumpy(x) for x in (o, *BE.attention_backward(do, c))])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    tok = dev(rng.integers(0, 7, (4, 64)))  # many repeated tokens: the embedding scatter-add
    W = dev(rng.standard_normal((7, 96)).astype(np.float32))
    dh = dev(rng.standard_normal((4, 64, 96)).astype(np.float32))
    d1 = BE.embedding_backward(dh, BE.embedding_forward(W, tok)[1])
    d2 = BE.embedding_backward(dh, BE.embedding_forward(W, tok)[1])
    np.testing.assert_array_equal(cp.asnumpy(d1), cp.asnumpy(d2))


def test_attention_large_head_dim_falls_back_to_reference():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 160)).astype(np.float32)
    k = rng.standard_normal((1, 3, 1, 160)).astype(np.float32)
    o, _ = BE.attention_forward(dev(q), dev(k), dev(k), 0)
    close(o, ops.attention_forward(q, k, k, 0)[0], np.float32, "hd 160")


# ------------------------------------------------------------------------------------------------
@EXAMPLES
@given(st.integers(1, 5000), dtypes, st.integers(0, 2 ** 31 - 1))
def test_swiglu(n, dtype, seed):
    rng = np.random.default_rng(seed)
    a = (4 * rng.standard_normal(n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    dh = rng.standard_normal(n).astype(dtype)
    h_ref, c_ref = ops.swiglu_forward(a, b)
    da_ref, db_ref = ops.swiglu_backward(dh, c_ref)
    h, c = BE.swiglu_forward(dev(a), dev(b))
    da, db = BE.swiglu_backward(dev(dh), c)
    close(h, h_ref, dtype, "swiglu h")
    close(da, da_ref, dtype, "swiglu da")
    close(db, db_ref, dtype, "swiglu db")


@EXAMPLES
@given(st.integers(1, 70), st.integers(2, 3000), st.floats(0.0, 1.0), st.sampled_from([-1, -100]),
       dtypes, st.integers(0, 2 ** 31 - 1))
def test_cross_entropy(N, V, frac_ignored, ignore, dtype, seed):
    rng = np.random.default_rng(seed)
    z = (3 * rng.standard_normal((N, V))).astype(dtype)
    t = rng.integers(0, V, N)
    t[rng.random(N) < frac_ignored] = ignore
    L_ref, c_ref = ops.cross_entropy_forward(z, t, ignore)
    dz_ref = ops.cross_entropy_backward(0.5, c_ref)
    L, c = BE.cross_entropy_forward(dev(z), dev(t), ignore)
    assert L.shape == () and L.dtype == dtype
    close(L, L_ref, dtype, "cross-entropy loss")
    close(BE.cross_entropy_backward(0.5, c), dz_ref, dtype, "cross-entropy dlogits")


@EXAMPLES
@given(st.integers(1, 300), st.integers(1, 700), st.integers(1, 4), st.integers(1, 50), dtypes,
       st.integers(0, 2 ** 31 - 1))
def test_embedding(V, D, B, T, dtype, seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((V, D)).astype(dtype)
    tok = rng.integers(0, min(V, 5) if seed % 2 else V, (B, T))  # many repeats on odd seeds
    dh = rng.standard_normal((B, T, D)).astype(dtype)
    h_ref, c_ref = ops.embedding_forward(W, tok)
    h, c = BE.embedding_forward(dev(W), dev(tok))
    close(h, h_ref, dtype, "embedding h")
    close(BE.embedding_backward(dev(dh), c), ops.embedding_backward(dh, c_ref), dtype,
          "embedding dW (atomic scatter-add)")


@EXAMPLES
@given(st.integers(1, 3000), st.floats(0.0, 0.3), dtypes, st.integers(0, 2 ** 31 - 1))
def test_adamw_update_matches_optim(n, wd, dtype, seed):
    from minillama.train.optim import AdamW

    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(dtype)
    ref = {"w": p.copy()}
    opt = AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    pd, m, v = dev(p), cp.zeros(n, dtype=dtype), cp.zeros(n, dtype=dtype)
    for step in range(1, 5):
        g = rng.standard_normal(n).astype(dtype)
        opt.step({"w": g})
        cbk.adamw_update(pd, dev(g), m, v, 3e-3, 0.9, 0.95, 1e-8, wd, step)
    close(pd, ref["w"], dtype, "adamw param")
    close(m, opt.m["w"], dtype, "adamw m")
    close(v, opt.v["w"], dtype, "adamw v")


def test_adamw_update_rejects_bad_input():
    a = cp.zeros(4, dtype=cp.float32)
    with pytest.raises(MinillamaError, match="step"):
        cbk.adamw_update(a, a, a.copy(), a.copy(), 1e-3, 0.9, 0.95, 1e-8, 0.0, 0)
    with pytest.raises(MinillamaError, match="shapes"):
        cbk.adamw_update(a, cp.zeros(5, cp.float32), a.copy(), a.copy(), 1e-3, 0.9, 0.95, 1e-8,
                         0.0, 1)


# ------------------------------------------------------------------------------------------------
@settings(max_examples=N_EXAMPLES + 10, deadline=None)
@given(st.integers(2, 500), st.sampled_from([0.0, 0.7, 1.0, 1.5]),
       st.sampled_from([None, 1, 5, 1000]), st.sampled_from([None, 0.3, 0.9, 1.0]),
       st.integers(0, 2 ** 31 - 1))
def test_device_sampling_matches_host_sampling(V, temperature, top_k, top_p, seed):
    from minillama.core.sampling import sample

    z = np.random.default_rng(seed).standard_normal(V) * 3
    got = BE.sample_tokens(dev(z[None]), temperature, top_k, top_p, np.random.default_rng(seed))
    want = sample(z, np.random.default_rng(seed), temperature, top_k, top_p)
    assert got.shape == (1,) and int(got[0]) == want


def test_device_sampling_one_uniform_per_sequence():
    from minillama.core.sampling import sample

    Z = np.random.default_rng(5).standard_normal((6, 300)) * 2
    u = np.array([np.random.default_rng(10 + b).random() for b in range(6)])
    got = BE.sample_tokens(dev(Z), 0.9, 20, 0.8, uniforms=u)
    want = [sample(Z[b], np.random.default_rng(10 + b), 0.9, 20, 0.8) for b in range(6)]
    assert got.tolist() == want
    assert BE.sample_tokens(dev(Z), 0.0).tolist() == Z.argmax(axis=1).tolist()


# ------------------------------------------------------------------------------------------------
def test_modules_compile_once_per_device():
    m1 = cb.get_module("swiglu")
    m2 = cb.get_module("swiglu")
    assert m1 is m2
    assert cb.get_kernel("swiglu", "swiglu_fwd", np.float32) is \
        cb.get_kernel("swiglu", "swiglu_fwd", np.float32)


def test_runtime_compile_error_points_at_file_and_line(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text("template <typename T>\n__global__ void bad(T* x) {\n  x[0] = oops;\n}\n"
                   "// KERNELS: bad\n")
    with pytest.raises(cb.KernelCompileError) as err:
        cb.get_module(bad)
    assert f"{bad.as_posix()}:3:" in str(err.value)


def test_model_step_stays_on_device():
    """A training step's parameters, activations and gradients are CuPy arrays; only the loss
    crosses to the host."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, hidden_dim=96,
                      max_seq_len=64)
    m_gpu = Transformer(cfg, backend="cupy", seed=1)
    m_cpu = Transformer(cfg, backend="numpy", seed=1)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 97, (3, 33))
    tgt = rng.integers(0, 97, (3, 33))
    loss_g, grads_g = m_gpu.loss_and_grads(tok, tgt)
    loss_c, grads_c = m_cpu.loss_and_grads(tok, tgt)
    assert all(isinstance(g, cp.ndarray) for g in grads_g.values())
    assert abs(loss_g - loss_c) <= 1e-5 * abs(loss_c)
    for k in grads_c:
        close(grads_g[k], grads_c[k], np.float32, k)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_quantized_gguf_on_the_gpu_gives_the_host_logits(qtype, tmp_path):
    """A GGUF file's Q8_0 / Q4_K / Q6_K matrices stay in their blocks on the GPU (quant.cu): prefill
    (more rows than the matvec kernel takes: dequantized tiles and a GEMM) and batch-1 decode
    steps (the matvec kernel) give the logits of the NumPy backend on the same file."""
    from minillama.core.config import ModelConfig
    from minillama.core.quant import QuantMatrix
    from minillama.io.gguf import save_gguf
    from minillama.io.load import load_model
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      hidden_dim=512, max_seq_len=32, tie_embeddings=False)
    path = save_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, init_params(cfg, seed=3),
                     matrix_type=qtype)
    gpu, _ = load_model(path, backend="cupy")
    host, _ = load_model(path, backend="numpy")
    assert isinstance(gpu.params["layers.0.attention.wq.weight"], QuantMatrix)
    assert isinstance(gpu.params["layers.0.attention.wq.weight"].data, cp.ndarray)
    tok = np.random.default_rng(0).integers(0, 64, (1, 12))
    close(gpu.forward(tok), host.forward(tok), np.float32, f"{qtype} prefill")
    caches = [m.new_cache(1, 32) for m in (gpu, host)]
    for t in range(4):  # one token at a time through the KV cache: matrix-vector products
        zg, zh = (m.forward(tok[:, t:t + 1], t, c, last_only=True)
                  for m, c in zip((gpu, host), caches))
        close(zg, zh, np.float32, f"{qtype} decode step {t}")


def test_graph_decoder_matches_eager_greedy_decode():
    """The decode step captured once as a CUDA graph (positions and tokens advanced on the
    device) gives the ids of the eager KV-cached greedy decode, at batch 1 and 3, and again
    when the captured graph is replayed after a new prefill."""
    from minillama.backends.cupy.graph import GraphDecoder
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, hidden_dim=96,
                      max_seq_len=64)
    model = Transformer(cfg, backend=BE, seed=7)
    for B in (1, 3):
        prompt = np.random.default_rng(B).integers(0, 97, (B, 5))
        cache = model.new_cache(B, 40)
        nxt = BE.sample_tokens(model.forward(prompt, 0, cache, last_only=True), 0.0)
        ref = [nxt]
        for i in range(19):
            nxt = BE.sample_tokens(model.forward(nxt[:, None], 5 + i, cache, last_only=True), 0.0)
            ref.append(nxt)
        ref = np.stack(ref, axis=1)
        dec = GraphDecoder(model, B, 40)
        np.testing.assert_array_equal(dec.generate(prompt, 20), ref)
        np.testing.assert_array_equal(dec.generate(prompt, 20), ref)  # replays the same graph


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_graph_decoder_reads_quantized_blocks(qtype, tmp_path):
    """A GGUF file's Q8_0 / Q4_K / Q6_K matrices (and embedding table) in the CUDA graph: the
    greedy ids of the eager op-by-op decode of the same model, batch 1 and 3."""
    from minillama.backends.cupy.graph import GraphDecoder
    from minillama.core.config import ModelConfig
    from minillama.io.gguf import save_gguf
    from minillama.io.load import load_model
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      hidden_dim=512, max_seq_len=64, tie_embeddings=qtype == "Q8_0")
    path = save_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, init_params(cfg, seed=5),
                     matrix_type=qtype)
    model, _ = load_model(path, backend="cupy")
    for B in (1, 3):
        prompt = np.random.default_rng(B).integers(0, 64, (B, 5))
        cache = model.new_cache(B, 40)
        nxt = BE.sample_tokens(model.forward(prompt, 0, cache, last_only=True), 0.0)
        ref = [nxt]
        for i in range(15):
            nxt = BE.sample_tokens(model.forward(nxt[:, None], 5 + i, cache, last_only=True), 0.0)
            ref.append(nxt)
        dec = GraphDecoder(model, B, 40)
        np.testing.assert_array_equal(dec.generate(prompt, 16), np.stack(ref, axis=1))


def test_graph_decoder_streams_in_chunks_like_the_eager_loop():
    """stream_greedy over the real GraphDecoder (replays in chunks, one read-back per chunk)
    gives generate_steps' greedy tokens, with a stop token in the middle of a chunk and with
    the context's end capping the budget."""
    from minillama.backends.cupy.graph import GraphDecoder, stream_greedy
    from minillama.core.config import ModelConfig
    from minillama.infer.generate import generate_steps
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, hidden_dim=96,
                      max_seq_len=48)
    model = Transformer(cfg, backend=BE, seed=11)
    for P, n_new, stop_at in ((5, 30, None), (5, 30, 7), (40, 30, None)):
        prompt = [int(t) for t in np.random.default_rng(P).integers(0, 97, P)]
        free = [t for s in generate_steps(model, [prompt], n_new) for _, t in s]
        stop = {free[stop_at]} if stop_at is not None else set()
        ref = [t for s in generate_steps(model, [prompt], n_new, stop_ids=stop)
               for _, t in s]
        dec = GraphDecoder(model, 1, min(cfg.max_seq_len, P + n_new))
        got = [t for s in stream_greedy(dec, prompt, n_new, cfg.max_seq_len, stop, chunk=4)
               for _, t in s]
        assert got == ref, (P, n_new, stop_at)


def test_cli_generate_cuda_graph_gives_the_eager_text(tmp_path, capsys):
    """``minillama generate --backend cupy --temperature 0``: --cuda-graph on (and auto, the
    default) print the text of --cuda-graph off, and say that they ran the graph."""
    from minillama.cli.main import main
    from minillama.core.config import ModelConfig
    from minillama.io.checkpoint import save_checkpoint
    from minillama.io.tokenizer import ByteTokenizer
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258,
                      hidden_dim=96, max_seq_len=96)
    ckpt = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=2),
                           tokenizer=ByteTokenizer())
    outs = {}
    for mode in ("off", "on", "auto"):
        rc = main(["generate", "-c", str(ckpt), "--backend", "cupy", "--prompt", "To be",
                   "-n", "40", "--temperature", "0", "--cuda-graph", mode])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert ("one CUDA graph per decode step" in err) == (mode != "off"), err
        outs[mode] = out
    assert outs["on"] == outs["off"] == outs["auto"]
    rc = main(["generate", "-c", str(ckpt), "--backend", "cupy", "--dtype", "float64",
               "--temperature", "0", "-n", "3", "--cuda-graph", "on"])
    assert rc == 2
    assert "decodes float32 models" in capsys.readouterr().err


@pytest.mark.parametrize("precision, tol", [("bf16", 1e-4), ("tf32", 5e-3)])
def test_mixed_precision_products_match_the_emulation(precision, tol):
    """The cuBLAS bf16 / TF32 products of MixedPrecisionBackend against the NumPy emulation of
    the same equations (bf16: the products of rounded operands are exact, only the summation
    order differs; TF32: cuBLAS may round the operands otherwise than cvt.rna (truncation would
    double the operand error to 2^-10), hence 5e-3; a wrong call plan errs by O(1))."""
    from minillama.backends.cupy import mixed_precision as mp

    fast = mp.MixedPrecisionBackend(BE, precision)
    emu = mp.MixedPrecisionBackend(get_backend("numpy"), precision, emulate=True)
    rng = np.random.default_rng(4)
    for M, N, K in ((7, 5, 12), (64, 96, 128), (513, 257, 384)):
        x = rng.standard_normal((1, M, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        dy = rng.standard_normal((1, M, N)).astype(np.float32)
        y, c = fast.linear_forward(dev(x), dev(w))
        ye, ce = emu.linear_forward(x, w)
        assert y.dtype == cp.float32
        assert rel_err(y, ye) <= tol
        for got, ref in zip(fast.linear_backward(dev(dy), c), emu.linear_backward(dy, ce)):
            assert rel_err(got, ref) <= tol
    if precision == "bf16":
        x = rng.standard_normal(4097).astype(np.float32)
        np.testing.assert_array_equal(cp.asnumpy(fast._operand(dev(x)[None])[0]),
                                      mp.bf16_bits(x))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_train_with_mixed_precision_tracks_fp32(tmp_path, precision):
    """`minillama train --backend cupy --precision P` runs, and its first losses stay within
    3% of the float32 run's on the same batches."""
    import json as _json

    from minillama.cli.main import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 400)
    losses = {}
    for prec in ("fp32", precision):
        out = tmp_path / prec
        rc = main(["train", "--backend", "cupy", "--precision", prec, "--data", str(corpus),
                   "--out", str(out), "--steps", "8", "--dim", "64", "--n-layers", "2",
                   "--n-heads", "4", "--n-kv-heads", "2", "--context", "64", "--batch-size",
                   "8", "--eval-interval", "8", "--eval-iters", "1", "--plot", "false",
                   "--no-progress"])
        assert rc == 0
        from minillama.io.checkpoint import load_checkpoint
        _, _, meta = load_checkpoint(out / "ckpt.safetensors")
        losses[prec] = np.array([v for _, v in meta["train_state"]["history"]["train"]])
        assert meta["train_state"]["config"]["precision"] == prec
    rel = np.abs(losses[precision] - losses["fp32"]) / losses["fp32"]
    assert rel.max() <= 0.03, (precision, rel, _json.dumps(losses, default=list))
