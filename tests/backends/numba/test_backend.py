"""The Numba backend: lazy import, kernel parity with the NumPy reference (values and every
gradient), the decode kernel's key split, the model on Numba against NumPy, and attention's O(T)
memory (the whole-model gradient / KV-cache / golden tests run on Numba through the ``backend``
fixture of the other test files)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillama.backends import get_backend
from minillama.core import ops
from minillama.core.errors import MinillamaError
from tests.support.helpers import PARITY_TOL, max_rel_err

ROOT = Path(__file__).resolve().parents[3]
TOL = PARITY_TOL["numba"]


def _numba_backend():
    try:
        return get_backend("numba")
    except MinillamaError as e:  # pragma: no cover - numba is a dependency
        pytest.skip(f"numba backend unavailable: {e}")


rel_err = max_rel_err  # max|got - ref| / max|ref|


@contextlib.contextmanager
def parallel_threshold(value: int):
    """Force the parallel (0) or the serial (huge) twin of every kernel."""
    from minillama.backends.numba import backend as numba_backend
    from minillama.backends.numba import backend_attention

    old = (numba_backend.PARALLEL_MIN_WORK, backend_attention.ROPE_PARALLEL_MIN_SIZE)
    numba_backend.PARALLEL_MIN_WORK = backend_attention.ROPE_PARALLEL_MIN_SIZE = value
    try:
        yield
    finally:
        numba_backend.PARALLEL_MIN_WORK, backend_attention.ROPE_PARALLEL_MIN_SIZE = old


def _run_py(code: str, env_extra: dict | None = None) -> str:
    env = dict(os.environ)
    env.update(env_extra or {})
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


# ---------------------------------------------------------------------------------------------
# lazy import, missing numba, threads, flags
# ---------------------------------------------------------------------------------------------
def test_import_minillama_does_not_import_numba():
    out = _run_py("""
        import sys
        import minillama, minillama.model.transformer, minillama.backends.numba.backend
        print('numba' in sys.modules, 'minillama.backends.numba.kernels' in sys.modules)
    """)
    assert out.split() == ["False", "False"]


def test_missing_numba_is_a_clear_error(monkeypatch):
    from minillama.backends.numba.backend import NumbaBackend

    monkeypatch.setitem(sys.modules, "numba", None)  # makes `import numba` raise ImportError
    with pytest.raises(MinillamaError, match="pip install numba"):
        NumbaBackend()


def test_threads_follow_numba_num_threads():
    out = _run_py("""
        from minillama.backends import get_backend
        print(get_backend('numba').num_threads)
    """, {"NUMBA_NUM_THREADS": "1"})
    assert out.strip() == "1"


def test_fastmath_keeps_inf_and_nan():
    _numba_backend()
    from minillama.backends.numba.floats.fastmath import FASTMATH, JIT_OPTS

    assert "nnan" not in FASTMATH and "ninf" not in FASTMATH
    assert "fast" not in FASTMATH
    assert JIT_OPTS["fastmath"] is FASTMATH


def test_fast_exp_float32():
    _numba_backend()
    from numba import njit

    from minillama.backends.numba.floats.fastmath import ERROR, fexp

    @njit
    def apply(x, y):
        for i in range(x.size):
            y[i] = fexp(x[i])

    x = np.concatenate([np.linspace(-86.0, 0.0, 20001), [-np.inf, -1e4, -88.0, np.nan]])
    x32 = x.astype(np.float32)
    y = np.empty_like(x32)
    apply(x32, y)
    ref = np.exp(x32.astype(np.float64))
    ok = x32 >= -86
    assert np.max(np.abs(y[ok] - ref[ok]) / ref[ok]) < ERROR  # 3 ulp with FMA
    assert y[-4] == 0.0 and y[-3] == 0.0 and 0 <= y[-2] < 1e-37 and np.isnan(y[-1])


# ---------------------------------------------------------------------------------------------
# RoPE parity
# ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), B=st.integers(1, 3),
       T=st.integers(1, 40), nh=st.integers(1, 4), half=st.integers(1, 64),
       per_seq=st.booleans(), parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_matches_reference(dtype, B, T, nh, half, per_seq, parallel, seed):
    be = _numba_backend()
    rng = np.random.default_rng(seed)
    hd = 2 * half
    x = rng.standard_normal((B, T, nh, hd)).astype(dtype)
    dy = rng.standard_normal((B, T, nh, hd)).astype(dtype)
    cos, sin = ops.rope_tables(hd, 128, 10000.0, dtype)
    if per_seq:
        pos = rng.integers(0, 128 - T, size=B)[:, None] + np.arange(T)[None]
        c, s = cos[pos], sin[pos]
    else:
        c, s = cos[:T], sin[:T]
    tol = 1e-6 if dtype == np.float32 else 1e-15
    with parallel_threshold(0 if parallel else 1 << 60):
        y, ctx = be.rope_forward(x, c, s)
        dx = be.rope_backward(dy, ctx)
        x_in = x.copy()
        y_in, _ = be.rope_forward(x_in, c, s, out=x_in)  # in place
    y_ref, ctx_ref = ops.rope_forward(x, c, s)
    dx_ref = ops.rope_backward(dy, ctx_ref)
    assert y.dtype == dtype and dx.dtype == dtype
    assert rel_err(y, y_ref) <= tol
    assert rel_err(dx, dx_ref) <= tol
    assert y_in is x_in and rel_err(y_in, y_ref) <= tol


def test_rope_bad_tables_are_clear_errors():
    be = _numba_backend()
    x = np.zeros((1, 4, 2, 8), np.float32)
    cos, sin = ops.rope_tables(8, 16)
    with pytest.raises(MinillamaError, match="RoPE tables"):
        be.rope_forward(x, cos[:3], sin[:3])
    with pytest.raises(MinillamaError, match="even hd"):
        be.rope_forward(np.zeros((1, 4, 2, 7), np.float32), cos[:4], sin[:4])


# ---------------------------------------------------------------------------------------------
# attention parity (values and gradients)
# ---------------------------------------------------------------------------------------------
def _attention_case(rng, dtype, B, T, KVH, G, hd, starts, extra):
    S = int(np.max(starts)) + T + extra
    q = rng.standard_normal((B, T, KVH * G, hd)).astype(dtype)
    k = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    v = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    dout = rng.standard_normal((B, T, KVH * G, hd)).astype(dtype)
    return q, k, v, dout


def _check_attention(be, q, k, v, dout, start_pos, dtype):
    out, ctx = be.attention_forward(q, k, v, start_pos)
    grads = be.attention_backward(dout, ctx)
    out_ref, ctx_ref = ops.attention_forward(q, k, v, start_pos)
    grads_ref = ops.attention_backward(dout, ctx_ref)
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == out_ref.shape
    assert rel_err(out, out_ref) <= tol, "output"
    # gradients: normwise over the whole gradient (dq, dk, dv), so that an exactly-zero dq
    # (a query with one visible key) compares its rounding noise to the gradient's size
    gscale = max(np.abs(g).max(initial=0.0) for g in grads_ref)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        err = np.abs(g.astype(np.float64) - g_ref).max(initial=0.0)
        assert err <= tol * gscale, (name, err, gscale)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), B=st.integers(1, 2),
       T=st.integers(1, 200), KVH=st.integers(1, 3), G=st.sampled_from([1, 2, 3]),
       hd=st.sampled_from([2, 4, 6, 8, 16, 24, 48, 64, 128]),
       offset=st.sampled_from(["none", "same", "per_seq"]), extra=st.integers(0, 5),
       parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_matches_reference(dtype, B, T, KVH, G, hd, offset, extra, parallel, seed):
    """MHA (G=1), GQA and MQA (KVH=1); fresh sequences, a common cache offset and per-sequence
    offsets (S > T, keys beyond a sequence's own position masked)."""
    be = _numba_backend()
    rng = np.random.default_rng(seed)
    if offset == "none":
        start_pos, extra = 0, 0
    elif offset == "same":
        start_pos = int(rng.integers(1, 64))
    else:
        start_pos = rng.integers(0, 64, size=B)
    q, k, v, dout = _attention_case(rng, dtype, B, T, KVH, G, hd, start_pos, extra)
    with parallel_threshold(0 if parallel else 1 << 60):
        _check_attention(be, q, k, v, dout, start_pos, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_kernel_key_split(dtype, T, rng):
    """The decode kernel split into key chunks merges exactly (nsplit 1, 3 and 7)."""
    be = _numba_backend()
    B, KVH, G, hd = 2, 2, 3, 16
    starts = np.array([300, 17])
    q, k, v, _ = _attention_case(rng, dtype, B, T, KVH, G, hd, starts, 2)
    ref, _ = ops.attention_forward(q, k, v, starts)
    kern = be._k
    for nsplit in (1, 3, 7):
        rows = T * KVH * G
        pm = np.empty((B * nsplit, rows), dtype)
        pl = np.empty_like(pm)
        pacc = np.empty((B * nsplit, rows, hd), dtype)
        out = np.empty_like(q)
        lse = np.empty((B, KVH * G, T), dtype)
        kern.attn_dec_serial(q, k, v, starts.astype(np.int64), dtype(hd ** -0.5), nsplit,
                             pm, pl, pacc, out, lse)
        assert rel_err(out, ref) <= TOL[dtype], nsplit


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_long_decode_against_cache(dtype, rng):
    """One new query against a long cache (the decode path), parallel split and serial."""
    be = _numba_backend()
    for start in (0, 700, np.array([1000, 3])):
        q, k, v, dout = _attention_case(rng, dtype, 2, 1, 2, 3, 32, start, 0)
        for par in (True, False):
            with parallel_threshold(0 if par else 1 << 60):
                _check_attention(be, q, k, v, dout, start, dtype)


def test_attention_extreme_logits_stay_finite(rng):
    """Scores far apart (e^{s - max} underflows to 0 for most keys) give finite, matching
    results: the masked/underflowed terms are exact zeros, not NaNs."""
    be = _numba_backend()
    for dtype in (np.float32, np.float64):
        q, k, v, dout = _attention_case(rng, dtype, 1, 50, 1, 2, 8, 0, 0)
        q = q * dtype(40.0)
        out, ctx = be.attention_forward(q, k, v)
        dq, dk, dv = be.attention_backward(dout, ctx)
        ref, ctx_ref = ops.attention_forward(q, k, v)
        assert all(np.isfinite(a).all() for a in (out, dq, dk, dv))
        assert rel_err(out, ref) <= (1e-4 if dtype == np.float32 else 1e-12)
        if dtype == np.float64:
            for g, g_ref in zip((dq, dk, dv), ops.attention_backward(dout, ctx_ref)):
                assert rel_err(g, g_ref) <= 1e-11


def test_attention_noncontiguous_cache_views(rng):
    """k/v as views into a longer cache buffer (what KVCache.update returns for B > 1)."""
    be = _numba_backend()
    buf_k = rng.standard_normal((3, 90, 2, 8)).astype(np.float32)
    buf_v = rng.standard_normal((3, 90, 2, 8)).astype(np.float32)
    k, v = buf_k[:, :40], buf_v[:, :40]
    assert not k.flags.c_contiguous
    starts = np.array([35, 10, 0])
    q = rng.standard_normal((3, 5, 4, 8)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    _check_attention(be, q, k, v, dout, starts, np.float32)


def test_attention_bad_shapes_are_clear_errors():
    be = _numba_backend()
    q = np.zeros((1, 4, 3, 8), np.float32)
    k = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(MinillamaError, match="multiple of KVH"):
        be.attention_forward(q, k, k)
    with pytest.raises(MinillamaError, match=">= 0"):
        be.attention_forward(q[:, :, :2], k, k, -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [2, 9, 70])
@pytest.mark.parametrize("parallel", [False, True])
def test_attention_each_path(dtype, T, parallel, rng):
    """Each attention path on a GQA case with per-sequence offsets: decode kernel (T <= 4),
    loop kernels (short T) and the BLAS-tiled path (several query and key tiles)."""
    be = _numba_backend()
    from minillama.backends.numba import backend_attention as tiles

    starts = np.array([5, 300, 0])
    q, k, v, dout = _attention_case(rng, dtype, 3, T, 2, 3, 16, starts, 3)
    old = tiles.TILE_BQ, tiles.TILE_BK
    tiles.TILE_BQ, tiles.TILE_BK = 16, 64  # many tiles, partial ones included
    try:
        with parallel_threshold(0 if parallel else 1 << 60):
            _check_attention(be, q, k, v, dout, starts, dtype)
    finally:
        tiles.TILE_BQ, tiles.TILE_BK = old


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("blas", [True, False])
def test_attention_tiled_gqa_offsets(dtype, blas, rng, monkeypatch):
    """The BLAS-tiled kernels (one (sequence, KV head) per thread item, each owning its rows of
    dK and dV while its G query heads add into them) on partial query and key tiles, with every
    sequence at its own start position; and the same case through the loop kernels, the
    fallback when no OpenBLAS GEMM is found."""
    be = _numba_backend()
    from minillama.backends.numba import backend_attention as tiles
    from minillama.backends.numba.floats import blas as numba_blas

    if blas and not numba_blas.available():
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose GEMM could be found")
    monkeypatch.setattr(tiles, "TILE_BQ", 16)
    monkeypatch.setattr(tiles, "TILE_BK", 32)
    monkeypatch.setattr(numba_blas, "available", (lambda: True) if blas else (lambda: False))
    used = []
    real = be._tiled
    monkeypatch.setattr(be, "_tiled", lambda T: used.append(real(T)) or used[-1])
    starts = np.array([0, 40, 7, 100])
    q, k, v, dout = _attention_case(rng, dtype, 4, 50, 2, 2, 8, starts, 1)
    _check_attention(be, q, k, v, dout, starts, dtype)
    assert used == [blas, blas]  # the forward and the backward took the path under test


# ---------------------------------------------------------------------------------------------
# cross-entropy
# ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), N=st.integers(1, 60),
       V=st.integers(1, 300), spread=st.sampled_from([0.1, 3.0, 30.0]),
       ignore_frac=st.sampled_from([0.0, 0.3, 1.0]), dloss=st.floats(0.1, 3.0),
       seed=st.integers(0, 2**16))
@example(dtype=np.float32, N=1, V=2, spread=3.0, ignore_frac=0.0, dloss=1.6875, seed=3)  # p -> 1
def test_cross_entropy_matches_reference(dtype, N, V, spread, ignore_frac, dloss, seed):
    be = _numba_backend()
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((N, V)) * spread).astype(dtype)
    t = rng.integers(0, V, size=N)
    t[rng.random(N) < ignore_frac] = -1
    loss, ctx = be.cross_entropy_forward(z, t)
    dz = be.cross_entropy_backward(dloss, ctx)
    loss_ref, ctx_ref = ops.cross_entropy_forward(z, t)
    dz_ref = ops.cross_entropy_backward(dloss, ctx_ref)
    tol = TOL[dtype]
    assert loss.dtype == dtype and loss.shape == ()
    assert abs(float(loss) - float(loss_ref)) <= tol * max(abs(float(loss_ref)), 1.0)
    assert dz.dtype == dtype
    # the error model: dz = (p - onehot) dloss / |kept| with p = e^{z - lse}; in this dtype lse
    # carries an absolute error of a few eps (1 + max|z|), so every entry of dz (the reference's
    # and this kernel's) lies within a few eps (1 + max|z|) dloss / |kept| of the float64 truth,
    # however small the entry itself is (p - 1 as p -> 1)
    _, ctx64 = ops.cross_entropy_forward(z.astype(np.float64), t)
    dz64 = ops.cross_entropy_backward(dloss, ctx64)
    kept = max(int((t >= 0).sum()), 1)
    bound = 16 * np.finfo(dtype).eps * (1 + float(np.abs(z).max())) * dloss / kept
    assert np.abs(dz - dz64).max() <= bound
    assert np.abs(dz_ref - dz64).max() <= bound
    if ignore_frac == 1.0:
        assert float(loss) == 0.0 and not dz.any()


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), N=st.integers(1, 40),
       D=st.integers(1, 9), V=st.integers(1, 300), block=st.sampled_from([1, 4, 10 ** 6]),
       ignore_frac=st.sampled_from([0.0, 0.3, 1.0]), dloss=st.floats(0.1, 3.0),
       seed=st.integers(0, 2**16))
def test_loss_head_matches_reference(dtype, N, D, V, block, ignore_frac, dloss, seed):
    """The fused output projection + cross-entropy (Numba softmax pass per block of rows)
    against the two reference ops, in blocks of 1 and 4 rows and in one block, the rows split
    over the Numba threads (no size threshold)."""
    from minillama.backends.numpy import backend as numpy_backend
    from minillama.backends.numpy import threads as cpu_threads

    be = _numba_backend()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, D)) * 2).astype(dtype)
    w = rng.standard_normal((V, D)).astype(dtype)
    t = rng.integers(0, V, size=N)
    t[rng.random(N) < ignore_frac] = -1
    old = numpy_backend.LCE_BLOCK_ELEMENTS, cpu_threads.PARALLEL_MIN_ELEMENTS
    numpy_backend.LCE_BLOCK_ELEMENTS, cpu_threads.PARALLEL_MIN_ELEMENTS = block * V, 1
    try:
        loss, ctx = be.linear_cross_entropy_forward(x, w, t)
        dx, dw = be.linear_cross_entropy_backward(dloss, ctx)
    finally:
        numpy_backend.LCE_BLOCK_ELEMENTS, cpu_threads.PARALLEL_MIN_ELEMENTS = old
    loss_ref, ctx_ref = ops.linear_cross_entropy_forward(x, w, t)
    dx_ref, dw_ref = ops.linear_cross_entropy_backward(dloss, ctx_ref)
    tol = 4 * TOL[dtype]
    assert loss.dtype == dtype and loss.shape == ()
    assert abs(float(loss) - float(loss_ref)) <= tol * max(abs(float(loss_ref)), 1.0)
    assert dx.dtype == dtype and rel_err(dx, dx_ref) <= tol
    assert dw.dtype == dtype and rel_err(dw, dw_ref) <= tol
    if ignore_frac == 1.0:
        assert float(loss) == 0.0 and not dx.any() and not dw.any()


# ---------------------------------------------------------------------------------------------
# RMSNorm and SwiGLU (one Numba pass per row, row blocks over the Numba threads)
# ---------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), rows=st.integers(1, 40),
       D=st.integers(4, 70), threaded=st.booleans(), seed=st.integers(0, 2**16))
def test_rmsnorm_and_swiglu_match_reference(dtype, rows, D, threaded, seed):
    """Values and every gradient against the float64 reference, serial and with the row
    blocks forced onto the Numba threads (no size threshold); SwiGLU inputs up to |a| ~ 100,
    where e^{-a} overflows float32 (sigma must go to 0, not NaN)."""
    from minillama.backends.numpy import threads as cpu_threads

    be = _numba_backend()
    rng = np.random.default_rng(seed)
    f64 = np.float64
    x = (rng.standard_normal((2, rows, D)) * 3).astype(dtype)
    g = rng.standard_normal(D).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    a = (rng.standard_normal((rows, 2, D)) * 4).astype(dtype)
    a.flat[::7] *= 25
    b = rng.standard_normal(a.shape).astype(dtype)
    dh = rng.standard_normal(a.shape).astype(dtype)
    old = cpu_threads.PARALLEL_MIN_ELEMENTS
    if threaded:
        cpu_threads.PARALLEL_MIN_ELEMENTS = 1
    try:
        y, c = be.rmsnorm_forward(x, g, 1e-5)
        dx, dg = be.rmsnorm_backward(dy, c)
        h, c = be.swiglu_forward(a, b)
        da, db = be.swiglu_backward(dh, c)
    finally:
        cpu_threads.PARALLEL_MIN_ELEMENTS = old
    y_r, c = ops.rmsnorm_forward(x.astype(f64), g.astype(f64), 1e-5)
    dx_r, dg_r = ops.rmsnorm_backward(dy.astype(f64), c)
    with np.errstate(over="ignore"):
        h_r, c = ops.swiglu_forward(a.astype(f64), b.astype(f64))
        da_r, db_r = ops.swiglu_backward(dh.astype(f64), c)
    tol = 10 * TOL[dtype]
    for got, ref, what in ((y, y_r, "rmsnorm y"), (dx, dx_r, "rmsnorm dx"),
                           (dg, dg_r, "rmsnorm dg"), (h, h_r, "swiglu h"),
                           (da, da_r, "swiglu da"), (db, db_r, "swiglu db")):
        assert got.dtype == dtype and got.shape == ref.shape, what
        assert np.isfinite(got).all() and rel_err(got, ref) <= tol, what


def test_cross_entropy_bad_targets_are_clear_errors():
    be = _numba_backend()
    with pytest.raises(MinillamaError, match="targets must lie"):
        be.cross_entropy_forward(np.zeros((2, 5), np.float32), np.array([1, 5]))


# ---------------------------------------------------------------------------------------------
# the model on Numba against the model on NumPy
# ---------------------------------------------------------------------------------------------
def test_model_on_numba_matches_numpy(rng):
    _numba_backend()
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=61,
                      multiple_of=16, max_seq_len=64)
    ref = Transformer(cfg, backend="numpy", dtype=np.float64, seed=3)
    fast = Transformer(cfg, params=ref.params, backend="numba", dtype=np.float64)
    tok = rng.integers(0, 61, size=(2, 30))
    tgt = rng.integers(0, 61, size=(2, 30))
    tgt[0, :4] = -1
    loss_r, grads_r = ref.loss_and_grads(tok, tgt)
    loss_f, grads_f = fast.loss_and_grads(tok, tgt)
    assert abs(loss_f - loss_r) <= 1e-12 * abs(loss_r)
    for name, g in grads_r.items():
        assert rel_err(grads_f[name], g) <= 1e-11, name
    # cached decode with per-sequence positions equals the reference's
    cache_r, cache_f = ref.new_cache(2), fast.new_cache(2)
    prompt_lens = np.array([7, 3])
    for c, m in ((cache_r, ref), (cache_f, fast)):
        m.forward(tok[:, :7], 0, c)
    pos = prompt_lens.copy()
    for _ in range(5):
        step = rng.integers(0, 61, size=(2, 1))
        lr = ref.forward(step, pos, cache_r)
        lf = fast.forward(step, pos, cache_f)
        assert rel_err(lf, lr) <= 1e-12
        pos = pos + 1


def test_training_step_stays_on_the_numba_threads(rng, monkeypatch):
    """With NumPy's OpenBLAS found, a float32 training step with every op above its parallel
    threshold never wakes the Python row threads (numpy/threads.py parallel_rows): its GEMMs,
    attention, norms and loss head all run on the Numba threads. Waking that pool costs
    0.1-0.3 ms per call on a 2-core VM (an idle vCPU is woken through the hypervisor)."""
    _numba_backend()
    from minillama.backends.numba.floats import blas as numba_blas
    from minillama.backends.numpy import threads as cpu_threads
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    if not numba_blas.available():
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose GEMM could be found")

    def woken(*args, **kwargs):
        raise AssertionError("the numba training step woke the Python row threads")

    monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_ELEMENTS", 1)  # (the NumPy paths' thresholds
    monkeypatch.setattr(cpu_threads, "SPLIT_GEMM_MIN_MACS", 0)  # too: a fallback would show)
    monkeypatch.setattr(numba_blas, "SPLIT_MIN_MACS", 0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61,
                      multiple_of=16, max_seq_len=64)
    model = Transformer(cfg, backend="numba", dtype=np.float32, seed=1)
    tok = rng.integers(0, 61, size=(2, 40))
    want, _ = Transformer(cfg, params=model.params, backend="numpy",
                          dtype=np.float32).loss_and_grads(tok, tok)
    monkeypatch.setattr(cpu_threads, "parallel_rows", woken)
    loss, _ = model.loss_and_grads(tok, tok)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))


# ---------------------------------------------------------------------------------------------
# memory: O(T) per head beyond inputs and outputs
# ---------------------------------------------------------------------------------------------
def test_attention_ctx_is_linear_in_T(rng):
    """Besides q, k, v and the output, the saved context holds O(B H T) numbers (the row
    log-sum-exp), never a (T, S) matrix."""
    be = _numba_backend()
    B, T, H, KVH, hd = 2, 2048, 4, 2, 8
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k = rng.standard_normal((B, T, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((B, T, KVH, hd)).astype(np.float32)
    out, ctx = be.attention_forward(q, k, v)
    extra = 0
    for item in ctx:
        if isinstance(item, np.ndarray) and not any(
                np.shares_memory(item, a) for a in (q, k, v, out)):
            extra += item.size
    assert extra <= B * H * T + B
    ref_ctx = ops.attention_forward(q[:, :256], k[:, :256], v[:, :256])[1]
    assert max(a.size for a in ref_ctx if isinstance(a, np.ndarray)) >= B * H * 256 * 256


MEM_SCRIPT = """
import json
import numpy as np
from minillama.core import ops

which = WHICH
B, T, H, hd = 1, 2048, 4, 16
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((B, T, H, hd)).astype(np.float32) for _ in range(4))
if which == "numba":
    from minillama.backends import get_backend
    be = get_backend("numba")
    fwd, bwd = be.attention_forward, be.attention_backward
else:  # the reference alone: numba is not even imported
    fwd, bwd = ops.attention_forward, ops.attention_backward
small = [a[:, :64].copy() for a in (q, k, v, do)]
o, c = fwd(*small[:3])  # warm up (loads the kernels)
bwd(small[3], c)
del o, c


def hwm():  # peak resident size of this process image, KiB (ru_maxrss would include the parent's)
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))


before = hwm()
o, c = fwd(q, k, v)
grads = bwd(do, c)
after = hwm()
print(json.dumps({"peak_growth_kib": after - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_attention_peak_memory_T2048():
    """Growth of the peak resident size over attention forward+backward at T=2048 (H=4, hd=16,
    float32), each backend in a fresh process: one (H, T, T) float32 array is 64 MiB. Numba's
    growth is its outputs and gradients (5 x 512 KiB) and the (H, T) log-sum-exp; the reference
    holds several (H, T, T) arrays at once."""
    _numba_backend()
    res = {}
    for which in ("numba", "numpy"):
        out = _run_py(MEM_SCRIPT.replace("WHICH", repr(which)))
        res[which] = json.loads(out.strip().splitlines()[-1])["peak_growth_kib"]
    assert res["numba"] < 16 * 1024, res
    assert res["numpy"] > 96 * 1024, res


def test_prompt_rows_norm_and_swiglu_refuse_a_backward_in_one_clear_error():
    """Inside ``prompt_rows()`` RMSNorm and SwiGLU take the decode steps' kernels, which keep
    nothing for a backward (no r, no sigma(a)): a backward on their ctx is one clear error, not
    a pass over a NaN r or a None. Their values are still the reference's."""
    be = _numba_backend()
    rng = np.random.default_rng(5)
    x, g = rng.standard_normal((3, 64)).astype(np.float32), rng.random(64).astype(np.float32)
    a, b = rng.standard_normal((2, 3, 96)).astype(np.float32)
    with be.prompt_rows():
        y, ctx = be.rmsnorm_forward(x, g, 1e-5)
        h, hctx = be.swiglu_forward(a, b)
    from minillama.backends.numba.floats.fastmath import ERROR  # fexp's, for this CPU

    eps = float(np.finfo(np.float32).eps)
    # RMSNorm: the two sides' float32 sums of 64 squares differ by at most 64 roundings of the
    # sum (in r by half that), then a few roundings each; SiLU: fexp's relative error carries
    # into a / (1 + e^{-a}) at most once, then a few roundings
    np.testing.assert_allclose(y, ops.rmsnorm_forward(x, g, 1e-5)[0], rtol=(64 + 8) * eps, atol=0)
    np.testing.assert_allclose(h, ops.swiglu_forward(a, b)[0], rtol=ERROR + 8 * eps, atol=0)
    with pytest.raises(MinillamaError, match="rmsnorm backward: its forward ran inside prompt"):
        be.rmsnorm_backward(y, ctx)
    with pytest.raises(MinillamaError, match="swiglu backward: its forward ran inside prompt_rows"):
        be.swiglu_backward(h, hctx)
    y2, ctx2 = be.rmsnorm_forward(x, g, 1e-5)  # outside it: a backward as before
    assert np.isfinite(be.rmsnorm_backward(np.ones_like(y2), ctx2)[0]).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_1", "Q4_K", "Q6_K", "Q2_K"])
def test_a_quantized_embedding_is_read_by_the_decode_steps_kernel(qtype):
    """The numba backend's embedding of a block table: each row the floats the fused decode
    step's kernel (``quant.matmul._dequant_row``) gives it, so a token's embedding is the same in
    a prefill and a decode step; held to the reference's dequantization within one rounding of
    each term of w = d s q + m (an offset, a min: a fused or a separate multiply-add)."""
    from minillama.backends.numba.quant import matmul as qm
    from tests.backends.numba.quant.test_matmul import random_matrix

    be = get_backend("numba")
    rng = np.random.default_rng(5)
    w = random_matrix(qtype, 40, 512, rng)
    tok = rng.integers(0, 40, (3, 7))
    got, ctx = be.embedding_forward(w, tok)
    assert got.shape == (3, 7, 512) and got.dtype == np.float32 and ctx[1] is None
    np.testing.assert_array_equal(got.reshape(-1, 512), qm.dequantize_rows(w)[tok.reshape(-1)])
    want = ops.embedding_forward(w, tok)[0]
    eps = np.finfo(np.float32).eps
    assert np.all(np.abs(got - want) <= 2 * eps * np.abs(want) + 2 * eps * np.abs(
        want).max(axis=-1, keepdims=True))
