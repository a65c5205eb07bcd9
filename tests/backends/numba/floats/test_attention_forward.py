"""Attention of every prompt row on its own (backends/numba/floats/attention_forward.py:
attend_rows): the reference's outputs within the rounding of float32 sums, and each row's output
bit for bit the same whatever else the call holds: the prompt cut into chunks at any row (tiles
of ROW_TILE rows then start elsewhere), other sequences beside it, any thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minillama.core import ops

fa = pytest.importorskip("minillama.backends.numba.floats.attention_forward")

U = float(np.finfo(np.float32).eps) / 2


def _case(rng, B, S, H, KVH, hd, T):
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k = rng.standard_normal((B, S, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((B, S, KVH, hd)).astype(np.float32)
    return q, k, v


def _rows(q, k, v, starts):
    out = np.empty(q.shape, np.float32)
    fa.attend_rows(q, k, v, np.asarray(starts, np.int64), np.float32(q.shape[3] ** -0.5), out)
    return out


def _bound(q, k, v, n, hd):
    r"""The most float32 rounding moves an output from the exact one: each score q.k / sqrt(hd)
    is off by at most hd u \sum_d |q_d k_d| / sqrt(hd), which moves each softmax weight by at
    most twice that relatively; e^x (a few u), the sums of at most n weights and of n weighted
    values (n u each) and the join of the spans (a few u) add (2 n + 32) u; all times max |v|."""
    qk = np.abs(q).max() * np.abs(k).max() * hd / np.sqrt(hd)
    return (2 * hd * U * qk + (2 * n + 32) * U) * np.abs(v).max()


@pytest.mark.parametrize("B,T,start,H,KVH,hd", [(1, 150, 0, 6, 2, 16), (2, 23, 70, 4, 4, 8),
                                                (1, 1, 200, 9, 3, 64), (3, 9, 5, 2, 1, 32)])
def test_attend_rows_matches_the_reference(B, T, start, H, KVH, hd):
    rng = np.random.default_rng(T + start)
    q, k, v = _case(rng, B, start + T, H, KVH, hd, T)
    got = _rows(q, k, v, np.full(B, start))
    want = ops.attention_forward(q.astype(np.float64), k.astype(np.float64),
                                 v.astype(np.float64), start)[0]
    assert np.abs(got - want).max() <= _bound(q, k, v, start + T, hd)


def test_a_row_does_not_depend_on_the_rest_of_the_call():
    rng = np.random.default_rng(3)
    T, H, KVH, hd = 3 * fa.SPAN + 11, 6, 2, 16
    q, k, v = _case(rng, 3, T, H, KVH, hd, T)
    whole = _rows(q[:1], k[:1], v[:1], [0])
    for cut in (1, fa.ROW_TILE - 1, fa.ROW_TILE + 3, fa.SPAN, 2 * fa.SPAN + 5):
        head = _rows(q[:1, :cut], k[:1], v[:1], [0])
        tail = _rows(np.ascontiguousarray(q[:1, cut:]), k[:1], v[:1], [cut])
        np.testing.assert_array_equal(np.concatenate([head, tail], axis=1), whole)
    # beside two other sequences, each at its own start (its rows are 5.. of the third)
    group = _rows(np.ascontiguousarray(q[:, 5:]), k, v, [5, 5, 5])
    alone = _rows(np.ascontiguousarray(q[2:, 5:]), k[2:], v[2:], [5])
    np.testing.assert_array_equal(group[2], alone[0])
    np.testing.assert_array_equal(group[0], whole[0, 5:])
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        np.testing.assert_array_equal(_rows(q[:1], k[:1], v[:1], [0]), whole)
    finally:
        numba.set_num_threads(before)


def test_the_span_kernels_give_one_value_per_output_whichever_computes_it():
    """span_ir: an output's fused multiply-add chain is the same in the one- and two-row kernels
    and in the 64- and 16-float value kernels (so the heads' pairing never moves a result), and
    it is the chain in order: q_0 k_0 first, then each next term."""
    ir = pytest.importorskip("minillama.backends.numba.floats.span_ir")
    from numba import njit

    @njit
    def scores(q, kt, s1, s2):
        ir.span_scores1(q[1].ctypes.data, 0, kt.ctypes.data, kt.strides[0], q.shape[1],
                        s1.ctypes.data, 0)
        ir.span_scores2(q.ctypes.data, q.strides[0], kt.ctypes.data, kt.strides[0], q.shape[1],
                        s2.ctypes.data, s2.strides[0])

    @njit
    def values(w, vr, o4, o1, o2):
        L = w.shape[1]
        ir.span_values4(w[1].ctypes.data, 0, vr.ctypes.data, vr.strides[0], L, o4.ctypes.data, 0)
        for d in range(0, 64, 16):
            ir.span_values1(w[1].ctypes.data, 0, vr.ctypes.data + 4 * d, vr.strides[0], L,
                            o1.ctypes.data + 4 * d, 0)
        ir.span_values4x2(w.ctypes.data, w.strides[0], vr.ctypes.data, vr.strides[0], L,
                          o2.ctypes.data, o2.strides[0])

    rng = np.random.default_rng(7)
    hd, L = 48, 37
    q = rng.standard_normal((2, hd)).astype(np.float32)
    kt = rng.standard_normal((hd, fa.SPAN)).astype(np.float32)
    s1, s2 = np.empty(fa.SPAN, np.float32), np.empty((2, fa.SPAN), np.float32)
    scores(q, kt, s1, s2)
    np.testing.assert_array_equal(s1, s2[1])
    # fma(q_d, k_d, acc) in order, one rounding per step (the float64 sum of the exact product
    # and acc, then float32: the seed fixes the data, so the comparison is the same on any CPU)
    chain = np.zeros(fa.SPAN, np.float32)
    for d in range(hd):
        chain = (q[1, d].astype(np.float64) * kt[d] + chain).astype(np.float32)
    np.testing.assert_array_equal(s2[1], chain)
    w = rng.standard_normal((2, L)).astype(np.float32)
    vr = rng.standard_normal((L, 64)).astype(np.float32)
    start = rng.standard_normal((2, 64)).astype(np.float32)
    o4, o1, o2 = start[1].copy(), start[1].copy(), start.copy()
    values(w, vr, o4, o1, o2)
    np.testing.assert_array_equal(o4, o1)
    np.testing.assert_array_equal(o4, o2[1])
    chain = start[1].copy()
    for j in range(L):
        chain = (w[1, j].astype(np.float64) * vr[j] + chain).astype(np.float32)
    np.testing.assert_array_equal(o4, chain)


@pytest.mark.parametrize("H,KVH,hd", [(9, 3, 64), (4, 2, 16), (2, 2, 80), (6, 1, 32)])
@pytest.mark.parametrize("half", [False, True])
def test_a_decode_step_attends_as_the_prompt_rows(H, KVH, hd, half):
    """The decode steps' attention (decode/float_step.py: _attend_span, by span and joined) gives
    a position the output attend_rows gives its prompt row, bit for bit, on a float32 cache
    and on a half one (whose entries the prompt rows read widened to float32): keys gathered
    from the cache into lanes, the same chains, softmax and join."""
    fs = pytest.importorskip("minillama.backends.numba.decode.float_step")
    from numba import njit

    @njit
    def step(q, Kc, Vc, n, G, scale, out):
        H = q.shape[0] // Kc.shape[2]
        P = fs._spans(n)
        sc = np.empty((P, H, fs.SPAN), np.float32)
        ml = np.empty((P, H, 2), np.float32)
        parts = np.empty((P, q.shape[0]), np.float32)
        for u in range(P):
            fs._attend_span(q, Kc, Vc, u * fs.SPAN, min(n, (u + 1) * fs.SPAN), G, scale, sc[u],
                            ml[u], parts[u])
        fs._join_spans(ml, parts, out)

    rng = np.random.default_rng(H * hd + half)
    S = 3 * fa.SPAN + 7
    q, k, v = _case(rng, 1, S, H, KVH, hd, S)
    if half:  # the cache holds halves; the prompt rows read them widened
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    rows = _rows(q, k, v, [0])[0]
    Kc = k[0].astype(np.float16).view(np.uint16) if half else k[0]
    Vc = v[0].astype(np.float16).view(np.uint16) if half else v[0]
    scale = np.float32(hd ** -0.5)
    for p in (0, 1, 15, 16, fa.SPAN - 1, fa.SPAN, fa.SPAN + 17, S - 1):
        out = np.empty(H * hd, np.float32)
        step(np.ascontiguousarray(q[0, p].reshape(-1)), Kc, Vc, p + 1, H // KVH, scale, out)
        np.testing.assert_array_equal(out, rows[p].reshape(-1), err_msg=f"position {p}")
