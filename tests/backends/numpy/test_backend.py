"""The ``numpy`` backend's fast ops held to the reference (minillama.core.ops): every op pair it
overrides, forward and backward, float32 and float64, several shapes (GQA/MQA/MHA, a KV cache,
per-sequence start positions, odd sizes), run serially and with its row threads forced on.
Then the threading helpers themselves (bit-identical chunking, BLAS thread count restored).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.backends.numpy import threads as cpu_threads
from minillama.backends.numpy.backend import NumpyBackend
from minillama.backends.reference import ReferenceBackend
from minillama.core import notes_ops, ops
from tests.support.helpers import PARITY_TOL

#: max |fast - ref| / max |ref| allowed: float64 is exact up to reordered sums
TOL = PARITY_TOL["numpy"]


def _std(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _rope_args(rng, dtype, B, T, nh, hd, gathered):
    cos, sin = ops.rope_tables(hd, 32, 10000.0, dtype)
    if gathered:  # per-sequence positions, as in batched decoding
        pos = np.arange(T)[None, :] + np.array([3, 0, 7][:B])[:, None]
        cos, sin = cos[pos], sin[pos]
    else:
        cos, sin = cos[2:2 + T], sin[2:2 + T]
    return (_std(rng, (B, T, nh, hd), dtype), cos, sin)


def _attn_args(rng, dtype, B, T, H, KVH, hd, S, start):
    return (_std(rng, (B, T, H, hd), dtype), _std(rng, (B, S, KVH, hd), dtype),
            _std(rng, (B, S, KVH, hd), dtype), start)


def _xent_args(rng, dtype, N, V, ignore):
    t = rng.integers(0, V, N)
    if ignore:
        t[::3] = -1
    return (_std(rng, (N, V), dtype) * 3, t)


def _lce_args(rng, dtype, N, D, V, ignore):
    z, t = _xent_args(rng, dtype, N, V, ignore)
    return (_std(rng, (N, D), dtype), _std(rng, (V, D), dtype), t)


#: op -> list of (id, make(rng, dtype) -> forward args)
CASES = {
    "embedding": [
        ("V<N", lambda r, dt: (_std(r, (7, 5), dt), r.integers(0, 7, (3, 4)))),  # sort+reduceat
        ("V>N", lambda r, dt: (_std(r, (50, 6), dt), np.array([[4, 4, 9]]))),  # add.at
    ],
    "linear": [
        ("rows", lambda r, dt: (_std(r, (5, 7), dt), _std(r, (3, 7), dt))),
        ("BTD", lambda r, dt: (_std(r, (2, 9, 11), dt), _std(r, (13, 11), dt))),
        ("one-row", lambda r, dt: (_std(r, (1, 1, 8), dt), _std(r, (6, 8), dt))),
    ],
    "lora": [
        ("BTD", lambda r, dt: (_std(r, (2, 9, 11), dt), _std(r, (13, 11), dt),
                               _std(r, (3, 11), dt), _std(r, (13, 3), dt), 1.5)),
        ("dropout", lambda r, dt: (_std(r, (2, 5, 8), dt), _std(r, (6, 8), dt),
                                   _std(r, (2, 8), dt), _std(r, (6, 2), dt), 0.5,
                                   (r.random((2, 5, 8)) > 0.3).astype(dt) / 0.7)),
        ("one-row", lambda r, dt: (_std(r, (1, 1, 8), dt), _std(r, (6, 8), dt),
                                   _std(r, (1, 8), dt), _std(r, (6, 1), dt), 2.0)),
    ],
    "rmsnorm": [
        ("BTD-odd", lambda r, dt: (_std(r, (3, 7, 13), dt), _std(r, 13, dt), 1e-5)),
        ("one-row", lambda r, dt: (_std(r, (1, 1, 8), dt), _std(r, 8, dt), 1e-6)),
    ],
    "rope": [
        ("tables", lambda r, dt: _rope_args(r, dt, 2, 5, 3, 8, False)),
        ("gathered", lambda r, dt: _rope_args(r, dt, 3, 4, 2, 6, True)),
    ],
    "attention": [
        ("gqa", lambda r, dt: _attn_args(r, dt, 2, 5, 4, 2, 8, 5, 0)),
        ("mqa-cache", lambda r, dt: _attn_args(r, dt, 3, 3, 6, 1, 4, 7, 4)),
        ("mha-starts", lambda r, dt: _attn_args(r, dt, 2, 4, 3, 3, 6, 9, np.array([5, 2]))),
        ("decode", lambda r, dt: _attn_args(r, dt, 1, 1, 4, 2, 8, 6, 5)),
    ],
    "swiglu": [
        ("BTF-odd", lambda r, dt: (_std(r, (2, 5, 17), dt) * 4, _std(r, (2, 5, 17), dt))),
    ],
    "cross_entropy": [
        ("all-kept", lambda r, dt: _xent_args(r, dt, 9, 23, False)),
        ("ignored", lambda r, dt: _xent_args(r, dt, 10, 5, True)),
    ],
    "linear_cross_entropy": [
        ("all-kept", lambda r, dt: _lce_args(r, dt, 9, 6, 23, False)),
        ("ignored", lambda r, dt: _lce_args(r, dt, 31, 4, 5, True)),
    ],
}
#: ops whose output is the scalar loss (their backward takes the upstream scalar dloss)
LOSS_OPS = ("cross_entropy", "linear_cross_entropy")


def _overridden_ops() -> set[str]:
    """The op names whose forward or backward NumpyBackend replaces."""
    names = set()
    for attr in dir(ReferenceBackend):
        if attr.endswith(("_forward", "_backward")):
            if getattr(NumpyBackend, attr) is not getattr(ReferenceBackend, attr):
                names.add(attr.rsplit("_", 1)[0])
    return names


def test_every_override_has_parity_cases():
    overridden = _overridden_ops()
    assert overridden, "NumpyBackend overrides nothing: the parity tests would be vacuous"
    assert overridden <= set(CASES), f"no parity cases for {overridden - set(CASES)}"


@pytest.fixture(params=["serial", "threaded"])
def threads(request, monkeypatch):
    """Serial, and with the row threads forced on (3 threads, no size threshold)."""
    if request.param == "threaded":
        monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_ELEMENTS", 1)
        monkeypatch.setenv("MINILLAMA_NUM_THREADS", "3")
    else:
        monkeypatch.setenv("MINILLAMA_NUM_THREADS", "1")
    return request.param


def _close(got, ref, dtype, what):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, what
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got.astype(np.float64) - ref), initial=0.0)) / scale
    assert err <= TOL[dtype], f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op,case", [(op, c) for op, cs in CASES.items() for c in cs],
                         ids=[f"{op}-{c[0]}" for op, cs in CASES.items() for c in cs])
def test_numpy_op_matches_reference(op, case, dtype, threads):
    be = get_backend("numpy")
    rng = np.random.default_rng(zlib.crc32(f"{op}-{case[0]}".encode()))
    args = case[1](rng, dtype)
    ref_args = [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == dtype else a
                for a in args]  # the reference in float64: the oracle
    out, ctx = getattr(be, f"{op}_forward")(*args)
    ref_out, ref_ctx = getattr(ops, f"{op}_forward")(*ref_args)
    _close(out, ref_out, dtype, f"{op} forward")
    dout = 0.7 if op in LOSS_OPS else _std(rng, np.shape(ref_out), dtype)
    grads = getattr(be, f"{op}_backward")(dout, ctx)
    ref_dout = dout if op in LOSS_OPS else dout.astype(np.float64)
    ref_grads = getattr(ops, f"{op}_backward")(ref_dout, ref_ctx)
    grads = grads if isinstance(grads, tuple) else (grads,)
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        _close(g, r, dtype, f"{op} backward output {i}")


def test_threaded_ops_match_serial_bitwise(rng, monkeypatch):
    """Row-wise ops give bit-identical results however the rows are chunked over threads."""
    be = get_backend("numpy")
    B, T, H, KVH, hd, D, F, V = 5, 7, 4, 2, 8, 32, 24, 19
    f32 = np.float32
    x = rng.standard_normal((B, T, D)).astype(f32)
    g = rng.standard_normal(D).astype(f32)
    q = rng.standard_normal((B, T, H, hd)).astype(f32)
    k = rng.standard_normal((B, T + 3, KVH, hd)).astype(f32)
    v = rng.standard_normal((B, T + 3, KVH, hd)).astype(f32)
    a = rng.standard_normal((B, T, F)).astype(f32)
    z = rng.standard_normal((B * T, V)).astype(f32)
    t = rng.integers(0, V, B * T)
    cos, sin = ops.rope_tables(hd, 32, 10000.0, f32)
    pos = np.arange(T)[None, :] + np.arange(B)[:, None]

    def run_all():
        out = []
        y, c = be.rmsnorm_forward(x, g, 1e-5)
        out += [y, *be.rmsnorm_backward(x, c)]
        y, c = be.rope_forward(q, cos[pos], sin[pos])
        out += [y, be.rope_backward(q, c)]
        y, c = be.attention_forward(q, k, v, np.array([3, 0, 2, 1, 3]))
        out += [y, *be.attention_backward(q, c)]
        y, c = be.swiglu_forward(a, a[::-1].copy())
        out += [y, *be.swiglu_backward(a, c)]
        y, c = be.cross_entropy_forward(z, t)
        out += [y, be.cross_entropy_backward(1.0, c)]
        y, c = be.linear_forward(x, x[0, :5])
        out += [y, *be.linear_backward(y, c)]
        return out

    monkeypatch.setenv("MINILLAMA_NUM_THREADS", "1")
    serial = run_all()
    monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_ELEMENTS", 1)
    for n in ("2", "3", "8"):
        monkeypatch.setenv("MINILLAMA_NUM_THREADS", n)
        for i, (u, w) in enumerate(zip(serial, run_all())):
            if i == 2:  # dg sums per-chunk partial sums: same value up to float32 rounding
                np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-5)
            elif i >= len(serial) - 3:  # GEMMs: BLAS may block a row slice differently
                np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(u, w)


def test_single_threaded_blas_restores_thread_count(rng, monkeypatch):
    api = cpu_threads.openblas_api()
    if api is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS this process can reach")
    get, set_ = api
    before = get()
    try:
        set_(2)
        with cpu_threads.single_threaded_blas():
            assert get() == 1
        assert get() == 2
        monkeypatch.setenv("MINILLAMA_NUM_THREADS", "2")
        be = get_backend("numpy")
        q = rng.standard_normal((4, 3, 2, 4))
        be.attention_backward(q, be.attention_forward(q, q, q)[1])
        assert get() == 2
    finally:
        set_(before)


def test_reference_backend_is_the_plain_ops():
    """``--backend reference`` runs minillama.core.ops itself: every op the backend has is the
    reference function, and every reference op the model wires is there."""
    be = get_backend("reference")
    ops_names = [a for a in dir(be) if a.endswith(("_forward", "_backward"))]
    for attr in ops_names:
        assert getattr(be, attr) is getattr(ops if hasattr(ops, attr) else notes_ops, attr), attr
    for op in CASES:
        assert f"{op}_forward" in ops_names and f"{op}_backward" in ops_names


@pytest.mark.parametrize("block", [1, 3, 10 ** 6])
def test_loss_head_blocks_and_buffer_reuse(rng, monkeypatch, block):
    """The fused loss head in blocks of 1 and 3 rows and in one block, on 3 threads, equals the
    reference; a second step reuses the (N, V) buffer and still gives the same answer; a second
    backward of one forward is a clear error."""
    from minillama.backends.numpy import backend as numpy_backend
    from minillama.core.errors import MinillamaError

    monkeypatch.setattr(numpy_backend, "LCE_BLOCK_ELEMENTS", block * 13)
    monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setenv("MINILLAMA_NUM_THREADS", "3")
    be = NumpyBackend()
    x, w, t = _lce_args(rng, np.float32, 11, 5, 13, True)
    loss_ref, c = ops.linear_cross_entropy_forward(x.astype(np.float64), w.astype(np.float64), t)
    dx_ref, dw_ref = ops.linear_cross_entropy_backward(1.3, c)
    for _ in range(2):
        loss, ctx = be.linear_cross_entropy_forward(x, w, t)
        _close(loss, loss_ref, np.float32, "loss")
        dx, dw = be.linear_cross_entropy_backward(1.3, ctx)
        _close(dx, dx_ref, np.float32, "dx")
        _close(dw, dw_ref, np.float32, "dW")
        assert be._lce_spare is not None  # handed back for the next step
    with pytest.raises(MinillamaError, match="called twice"):
        be.linear_cross_entropy_backward(1.0, ctx)
    with pytest.raises(MinillamaError, match="targets must lie"):
        be.linear_cross_entropy_forward(x, w, np.full(11, 13))
