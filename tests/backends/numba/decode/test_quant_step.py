r"""The numba backend's fused decode step of several sequences on GGML-block weights
(backends/numba/decode/quant_step.py, ``decode_step_rows_q``) against the backend's own per-op path:
rows at their own positions (up to the context's last slot), quantized and float embeddings, float32
and 8-bit activations, and the continuous-batching engine's greedy tokens as rows join and leave.

Like is compared with like: both paths take the same block weights and round the activations
the same way (``MINILLAMA_QUANT_DOTS``), so they differ only by float32 rounding in another
order (norms, attention, the residual adds). With float32 activations that is an error of a few
u times the sums of |terms| (held to 1e-4 of max |logit|, as the single-sequence kernel's tests
do); with 8-bit activations a rounding difference can move one activation code by one step
(d_b = max |x| / 127 in its block), whose effect on a logit is bounded by d_b times a column
sum of |W|: held to 2e-3 of max |logit|, where a wrong position or row would be off by O(1)."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES
from minillama.infer.engine import Engine
from minillama.infer.generate import generate
from minillama.model.transformer import Transformer, init_params

try:
    NUMBA = get_backend("numba")
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)

from minillama.backends.numba.decode import quant_step as qdecode  # noqa: E402
from tests.backends.numba.quant.test_matmul import random_matrix  # noqa: E402

TOL = {"float": 1e-4, "int8": 2e-3}


def quant_model(types_, seed=0, quant_emb=True, n_kv_heads=2, max_seq_len=40):
    """A small LLaMA on the numba backend whose linear weights (and, with ``quant_emb``, the
    tied embedding) are random blocks of ``types_`` (cycled); random norm gains."""
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=67,
                      hidden_dim=512, multiple_of=256, max_seq_len=max_seq_len)
    rng = np.random.default_rng(seed)
    model = Transformer(cfg, init_params(cfg, seed=seed, dtype=np.float32), backend="numba",
                        dtype=np.float32)
    k = 0
    for name, v in list(model.params.items()):
        if v.ndim == 1:
            v[...] = rng.normal(1.0, 0.2, v.shape)
        elif quant_emb or name != "tok_embeddings.weight":
            model.params[name] = random_matrix(types_[k % len(types_)], *v.shape, rng)
            k += 1
    return model


@pytest.fixture
def rows_calls(monkeypatch):
    """Counts the calls of the several-sequence kernel (so a test knows the fused path ran)."""
    n = {"calls": 0}
    kernel = qdecode.decode_step_rows_q

    def counting(*args):
        n["calls"] += 1
        return kernel(*args)

    monkeypatch.setattr(qdecode, "decode_step_rows_q", counting)
    return n


def _per_op_forward(monkeypatch, model, *args):
    """``model.forward(*args, last_only=True)`` on the per-op path (the fused step declines)."""
    with monkeypatch.context() as mp:
        mp.setattr(model.backend, "decode_step", lambda *a, **kw: None, raising=False)
        return model.forward(*args, last_only=True)


#: the 8-bit activations' own error, relative to the largest logit (README: about 2e-2)
INT8_ERROR = 2.5e-2


def _half_tols(tol: float, mode: str) -> tuple[float, float]:
    """(logits, cache rows) tolerances of two evaluations whose new K/V rows may land one half
    step apart: 2^-11 and 2^-10 of the largest with float32 products; with 8-bit products an
    activation near a rounding boundary may then round the other way in a later layer, so the
    two differ by up to the 8-bit rounding's own error."""
    if mode == "int8":
        return max(tol, INT8_ERROR), max(tol, INT8_ERROR)
    return max(tol, 2.0 ** -11), max(tol, 2.0 ** -10)


@pytest.mark.parametrize("kv", ["auto", "f32"])
@pytest.mark.parametrize("mode", ["float", "int8"])
@pytest.mark.parametrize("types_,quant_emb", [(("Q4_1",), True), (("Q4_K", "Q6_K", "Q8_0"), True),
                                              (("Q4_0", "Q5_1"), False)])
def test_rows_at_their_own_positions_match_the_per_op_path(types_, quant_emb, mode, kv,
                                                          rows_calls, monkeypatch):
    """Rows prefilled to different lengths (one reaching the context's last slot), then three
    decode steps of all rows at once: each step one fused call, whose logits and every cache
    row equal the per-op path's on a copy of the cache, within the tolerance of the module;
    with the default half cache a new K/V entry, the same float32 number up to the order of
    its sums before it is rounded to half, may land one half step (up to 2^-10 of its row's
    scale) apart, which moves a logit by about 2^-11 of the largest."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", mode)
    model = quant_model(types_, quant_emb=quant_emb)
    model.kv_cache = kv
    half = model.kv_dtype == np.float16
    rng = np.random.default_rng(1)
    S, V = model.cfg.max_seq_len, model.cfg.vocab_size
    lens = np.array([3, 17, 9, S - 3, 1])
    fused = model.new_cache(len(lens), S)
    for b, n in enumerate(lens):
        model.forward(rng.integers(0, V, (1, int(n))), 0, fused.rows(b, b + 1), last_only=True)
    ref = model.new_cache(len(lens), S)
    for a, r in zip(fused.k + fused.v, ref.k + ref.v):
        r[...] = a
    tok, tol = rng.integers(0, V, (len(lens), 1)), TOL[mode]
    for step in range(3):
        before = rows_calls["calls"]
        got = model.forward(tok, lens + step, fused, last_only=True)
        assert rows_calls["calls"] == before + 1
        want = _per_op_forward(monkeypatch, model, tok, lens + step, ref)
        assert got.shape == want.shape == (len(lens), V) and got.dtype == np.float32
        z_tol, row_tol = _half_tols(tol, mode) if half else (tol, tol)
        np.testing.assert_allclose(got, want, rtol=z_tol, atol=z_tol * np.abs(want).max())
        for a, r in zip(fused.k + fused.v, ref.k + ref.v):
            a, r = a.astype(np.float32), r.astype(np.float32)
            np.testing.assert_allclose(a, r, rtol=row_tol, atol=row_tol * np.abs(r).max())
        tok = np.argmax(want, axis=-1)[:, None]


@pytest.mark.parametrize("mode", ["float", "int8"])
def test_batched_rows_equal_each_row_alone(mode, rows_calls, monkeypatch):
    """Batching shares the reads of the weights and nothing else: on as many threads, each row
    of a fused step of 6 sequences gets bit for bit the logits and K/V the single-sequence fused
    step gives it alone (a one-row view of a copy of the cache, at its position)."""
    from minillama.backends.tuner import ThreadTuner

    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", mode)
    monkeypatch.setattr(NUMBA, "_tuner", ThreadTuner(NUMBA.num_threads, adapt=False),
                        raising=False)
    fixed = ThreadTuner(NUMBA.num_threads, adapt=False)
    monkeypatch.setattr(NUMBA, "rows_tuner", lambda B: fixed, raising=False)
    model = quant_model(("Q4_1", "Q8_0"), seed=2)
    rng = np.random.default_rng(3)
    S, V = model.cfg.max_seq_len, model.cfg.vocab_size
    lens = np.array([5, 30, 2, 11, 24, 8])
    B = len(lens)
    cache, alone = model.new_cache(B, S), model.new_cache(B, S)
    for b, n in enumerate(lens):
        prompt = rng.integers(0, V, (1, int(n)))
        model.forward(prompt, 0, cache.rows(b, b + 1), last_only=True)
        model.forward(prompt, 0, alone.rows(b, b + 1), last_only=True)
    tok = rng.integers(0, V, (B, 1))
    got = model.forward(tok, lens, cache, last_only=True)
    assert rows_calls["calls"] == 1
    for b in range(B):
        one = model.forward(tok[b:b + 1], int(lens[b]), alone.rows(b, b + 1), last_only=True)
        np.testing.assert_array_equal(got[b], one[0])
    assert rows_calls["calls"] == 1  # the single rows took the one-sequence kernel
    for a, r in zip(cache.k + cache.v, alone.k + alone.v):
        np.testing.assert_array_equal(a, r)


def test_engine_greedy_tokens_unchanged_as_rows_join_and_leave(rows_calls, monkeypatch):
    """The engine on a quantized model, 8-bit activations: requests of different prompt
    lengths and budgets through 3 slots (rows join as others leave, and move) get the greedy
    tokens of the per-op path's engine, and of ``generate`` alone."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "int8")
    model = quant_model(("Q4_1", "Q4_K"), seed=4)
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(0, 67, int(n)).tolist(), int(k))
            for n, k in zip(rng.integers(1, 14, 7), rng.integers(2, 16, 7))]

    def run():
        engine = Engine(model, max_batch=3)
        try:
            with engine._cv:  # held: all are queued before the scheduler admits any
                reqs = [engine.submit(p, max_tokens=k) for p, k in jobs]
            for r in reqs:
                assert list(r.events(timeout=120))[-1] == ("done", "length")
            assert engine.max_active == 3
            return [r.tokens for r in reqs]
        finally:
            engine.close()

    fused = run()
    assert rows_calls["calls"] > 0
    with monkeypatch.context() as mp:
        mp.setattr(model.backend, "decode_step", lambda *a, **kw: None, raising=False)
        before = rows_calls["calls"]
        assert run() == fused
        assert rows_calls["calls"] == before
    for (prompt, k), got in zip(jobs, fused):
        assert got == list(generate(model, prompt, max_new_tokens=k))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("K", [576, 96])  # an even and an odd number of blocks of 32
def test_multi_row_integer_dots_equal_the_single_row_kernel(qtype, K):
    """idot_rows (one decoding of W's row for ROWS activation rows) stores exactly the floats
    that idot returns row by row, written only where asked (the columns and rows around stay)."""
    from numba import njit

    from minillama.backends.numba.quant import int8_dots as qint8

    rng = np.random.default_rng(6)
    w = random_matrix(qtype, 5, K, rng)
    qt = QUANT_TYPES[qtype].type_id
    B, R = 7, qint8.ROWS
    x = rng.normal(0, 1, (B, K)).astype(np.float32)
    K8 = K + 64  # row strides wider than K, as the fused step's buffers
    xq = np.zeros((B, K8), np.int8)
    xd, xs = np.zeros((B, K8 // 32), np.float32), np.zeros((B, K8 // 16), np.float32)
    for b in range(B):
        qint8.quantize_row(x[b], xq[b, :K], xd[b, :K // 32], xs[b, :K // 16])

    @njit
    def both(w, xq, xd, xs, one, many):
        for n in range(w.shape[0]):
            for b in range(xq.shape[0]):
                one[b, n + 1] = qint8.idot(qt, w, n, xq[b], xd[b], xs[b])
            qint8.idot_rows(qt, w, n, xq, xd, xs, 1, many, n + 1)

    one, many = np.full((B, 7), 9.0, np.float32), np.full((B, 7), 9.0, np.float32)
    both(w.data, xq[:, :K], xd[:, :K // 32], xs[:, :K // 16], one, many)
    assert np.array_equal(many[1:1 + R, 1:6], one[1:1 + R, 1:6])
    assert np.all(many[0] == 9.0) and np.all(many[1 + R:] == 9.0)
    assert np.all(many[:, 0] == 9.0) and np.all(many[:, 6] == 9.0)
    assert np.abs(one[:, 1:6]).max() > 0
