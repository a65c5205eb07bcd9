"""Products with GGML-block weights on the numba backend (backends/numba/quant/matmul.py, qsimd.py)
against the dequantization of gguf-py (the reference implementation of the formats): y = x W^T
and dx = dy W for every block type, few rows (the decode kernels) and many (dequantized tiles +
GEMM), random valid blocks and the tensors of a real GGUF file; the backend's linear and loss
head with a quantized W.

These are the float32 kernels (``MINILLAMA_QUANT_DOTS=float``). Tolerance: the kernels decode each
block exactly (the fp16 scales are widened exactly, the small integer codes are exact in float32)
and sum the products in float32, in another order than NumPy. Any order of a float32 sum of K
products is within (K + 2) u \\sum_k |w_k x_k| (u = 2^-24, two more roundings for the dequantized
weight d q - m); the tests hold the error to that bound, per output entry."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES, QuantMatrix, QuantType

gguf = pytest.importorskip("gguf", reason="gguf-py (the format's reference dequantizer)")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

try:
    NUMBA = get_backend("numba")
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)

from minillama.backends.numba.quant import matmul as Q  # noqa: E402

TYPES = sorted(QUANT_TYPES)
U = 2.0 ** -24


@pytest.fixture(autouse=True)
def float_dots(monkeypatch):
    """The float32 kernels throughout (the 8-bit activation path:
    tests/backends/numba/quant/test_int8_dots.py)."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")


def random_matrix(qtype, N, K, rng):
    """Random valid blocks: random bytes, every fp16 field a finite value of modest size."""
    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    nb = K // per
    data = rng.integers(0, 256, size=(N, nb, size), dtype=np.uint8)
    for o in QUANT_TYPES[qtype].scale_fields:
        h = rng.uniform(-0.05, 0.05, size=(N, nb)).astype(np.float16)
        data[:, :, o:o + 2] = h.view(np.uint8).reshape(N, nb, 2)
    return QuantMatrix(qtype, (N, K), data.reshape(N, nb * size))


def oracle(w: QuantMatrix) -> np.ndarray:
    """W (N, K) dequantized by gguf-py, float64."""
    q = gguf.GGMLQuantizationType[w.qtype]
    return gguf_dequantize(w.data, q).reshape(w.shape).astype(np.float64)


def assert_within(got, want, scale, K):
    """|got - want| <= (K + 2) u scale, entrywise (scale = the sum of |products|)."""
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    bound = (K + 2) * U * scale + 1e-30
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {worst:.2f} x the float32 bound"


def test_every_type_of_the_table_has_a_kernel(monkeypatch):
    """The kernels cover QUANT_TYPES; a type added to the table without a kernel is refused by
    name (its id would otherwise run another type's branch)."""
    assert sorted(Q.KERNEL_TYPES) == sorted(t.type_id for t in QUANT_TYPES.values())
    assert [Q.qcode(k) for k in QUANT_TYPES] == [t.type_id for t in QUANT_TYPES.values()]
    q4 = QUANT_TYPES["Q4_0"]
    monkeypatch.setitem(QUANT_TYPES, "Q9_9", QuantType("Q9_9", 99, 32, 18, (0,), q4.dequantize))
    with pytest.raises(MinillamaError, match="no kernel for GGML type Q9_9"):
        Q.qcode("Q9_9")


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows(qtype, rng):
    """The tiles of the many-row path: gguf-py's float32 values, up to the one rounding a fused
    multiply-add saves in d q - m (the types without a min match bit for bit)."""
    w = random_matrix(qtype, 9, 512, rng)
    W = oracle(w).astype(np.float32)
    tol = 0.0 if qtype in ("Q4_0", "Q5_0", "Q8_0", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS") else U
    for lo, hi in ((0, 9), (3, 7)):
        got = Q.dequantize_rows(w, lo, hi)
        assert got.dtype == np.float32 and got.shape == (hi - lo, 512)
        assert np.abs(got - W[lo:hi]).max() <= tol * np.abs(W).max()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 2, 7, 64])
@pytest.mark.parametrize("N", [37, 67])
def test_qmatmul(qtype, M, N, rng):
    K = 512
    w = random_matrix(qtype, N, K, rng)
    W = oracle(w)
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = Q.qmatmul(x, w)
    assert_within(y, x.astype(np.float64) @ W.T, np.abs(x.astype(np.float64)) @ np.abs(W).T, K)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 2, 7, 64])
def test_qmatmul_t(qtype, M, rng):
    N, K = 67, 256
    w = random_matrix(qtype, N, K, rng)
    W = oracle(w)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    dx = Q.qmatmul_t(dy, w)
    d64 = dy.astype(np.float64)
    assert_within(dx, d64 @ W, np.abs(d64) @ np.abs(W), N)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_qmatmul_serial_and_parallel_agree(qtype, rng, monkeypatch):
    """The decode kernel split over the threads and on one thread: the same rows, the same
    sums (each output entry is computed by one thread in one order)."""
    w = random_matrix(qtype, 600, 768, rng)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    assert 3 * 600 * 768 >= Q.PARALLEL_MIN_WORK  # the split path, given two threads
    y_par = Q.qmatmul(x, w)
    monkeypatch.setattr(Q, "_parallel", lambda: False)
    np.testing.assert_array_equal(Q.qmatmul(x, w), y_par)


def test_qmatmul_nonfinite_and_shapes(rng):
    w = random_matrix("Q4_0", 5, 64, rng)
    x = np.zeros((2, 64), dtype=np.float32)
    x[1, 3] = np.nan
    y = Q.qmatmul(x, w)
    assert np.all(y[0] == 0) and np.all(np.isnan(y[1]))
    assert Q.qmatmul(np.zeros((0, 64), np.float32), w).shape == (0, 5)
    with pytest.raises(ValueError):
        Q.qmatmul(np.zeros((1, 32), np.float32), w)
    with pytest.raises(ValueError):
        Q.qmatmul_t(np.zeros((1, 4), np.float32), w)


# ---------------------------------------------------------------------------------------------
# the backend's ops with a quantized weight
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 33)])
def test_backend_linear(lead, rng):
    """linear_forward / linear_backward with a QuantMatrix: y = x W^T and dx = dy W of the
    dequantized W, any leading axes, dW None (the weight is frozen)."""
    from minillama.core import ops

    w = random_matrix("Q4_K", 45, 256, rng)
    W = oracle(w)
    x = rng.standard_normal((*lead, 256)).astype(np.float32)
    y, ctx = NUMBA.linear_forward(x, w)
    y_ref, ctx_ref = ops.linear_forward(x.astype(np.float64), W)
    assert y.shape == (*lead, 45) and y.dtype == np.float32
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = NUMBA.linear_backward(dy, ctx)
    dx_ref, _ = ops.linear_backward(dy.astype(np.float64), ctx_ref)
    assert dw is None and dx.shape == x.shape and dx.dtype == np.float32
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4 * np.abs(dx_ref).max())


def test_backend_loss_head(rng):
    """The loss head with a quantized output matrix: the loss and dx of the composed reference
    ops on the dequantized W; dW None."""
    from minillama.core import ops

    w = random_matrix("Q6_K", 50, 256, rng)
    W = oracle(w)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    t = np.array([0, 5, -1, 49, 7, 7])
    loss, ctx = NUMBA.linear_cross_entropy_forward(x, w, t, ignore_index=-1)
    loss_ref, ctx_ref = ops.linear_cross_entropy_forward(x.astype(np.float64), W, t, -1)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    dx, dw = NUMBA.linear_cross_entropy_backward(np.float32(2.0), ctx)
    dx_ref, _ = ops.linear_cross_entropy_backward(2.0, ctx_ref)
    assert dw is None
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5 * np.abs(dx_ref).max())


def test_float_weights_unchanged(rng):
    """A float W still takes the float path (dW returned)."""
    x = rng.standard_normal((2, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    y, ctx = NUMBA.linear_forward(x, w)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
    dx, dw = NUMBA.linear_backward(np.ones_like(y), ctx)
    assert dw is not None and dw.shape == w.shape


# ---------------------------------------------------------------------------------------------
# the tensors of a real file
# ---------------------------------------------------------------------------------------------
def test_real_gguf_tensors(smollm2_gguf, rng):
    """Every quantized tensor of SmolLM2-135M's first block and the first 2048 rows of its Q8_0
    embedding (the tied output matrix), as the file stores them."""
    reader = gguf.GGUFReader(str(smollm2_gguf))
    seen = set()
    for t in reader.tensors:
        if not (t.name.startswith("blk.0.") or t.name == "token_embd.weight"):
            continue
        qtype = t.tensor_type.name
        if qtype not in QUANT_TYPES:
            continue
        data = np.ascontiguousarray(t.data)
        if t.name == "token_embd.weight":
            data = data[:2048]
        N, K = data.shape[0], int(t.shape[0])
        w = QuantMatrix(qtype, (N, K), data)
        W = oracle(w)
        for M in (1, 16):
            x = rng.standard_normal((M, K)).astype(np.float32)
            x64 = x.astype(np.float64)
            assert_within(Q.qmatmul(x, w), x64 @ W.T, np.abs(x64) @ np.abs(W).T, K)
        dy = rng.standard_normal((3, N)).astype(np.float32)
        d64 = dy.astype(np.float64)
        assert_within(Q.qmatmul_t(dy, w), d64 @ W, np.abs(d64) @ np.abs(W), N)
        seen.add(qtype)
    assert {"Q4_1", "Q8_0"} <= seen


# ---------------------------------------------------------------------------------------------
# the fused decode step with block matrices
# ---------------------------------------------------------------------------------------------
NO_F = np.zeros((1, 1), np.float32)
LINEAR = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
          "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
          "feed_forward.w3.weight")


def _quant_model(types_, rng, n_kv_heads=2):
    """A small LLaMA whose embedding (tied classifier) and linear weights are random blocks of
    the given types (cycled), plus the float model of their gguf-py dequantization."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer, init_params

    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=67,
                      hidden_dim=512, multiple_of=256, max_seq_len=20)
    params = init_params(cfg, seed=0, dtype=np.float32)
    quant, k = {}, 0
    for name, v in params.items():
        if v.ndim == 2:
            qt = types_[k % len(types_)]
            k += 1
            quant[name] = random_matrix(qt, v.shape[0], v.shape[1], rng)
            params[name] = oracle(quant[name]).astype(np.float32)
        else:
            params[name] = rng.normal(1.0, 0.2, v.shape).astype(np.float32)
    return cfg, quant, params, Transformer(cfg, params, backend="numpy", dtype=np.float32)


@pytest.mark.parametrize("types_", [("Q8_0",), ("Q4_K", "Q6_K"), ("Q4_0", "Q4_1", "Q5_K")])
def test_fused_quant_decode_step(types_, rng):
    """decode_step_one_q fed the blocks, position after position (single steps, then greedy
    steps in one call): the logits, cache rows and greedy tokens of the per-op float model on
    the dequantized weights."""
    import numba

    from minillama.backends.numba.decode import quant_step as qdecode

    cfg, quant, params, ref = _quant_model(types_, rng)
    L, S = cfg.n_layers, cfg.max_seq_len
    lst = numba.typed.List

    def mats(name):
        return lst([quant[f"layers.{i}.{name}"].data for i in range(L)])

    codes = np.array([[Q.qcode(quant[f"layers.{i}.{n}"].qtype) for n in LINEAR]
                      for i in range(L)], dtype=np.int64)
    emb = quant["tok_embeddings.weight"]
    out = quant.get("output.weight", emb)
    norms = (lst([params[f"layers.{i}.attention_norm.weight"] for i in range(L)]),
             lst([params[f"layers.{i}.ffn_norm.weight"] for i in range(L)]))
    c_ref = ref.new_cache(1, S)
    c_q = ref.new_cache(1, S)
    kc, vc = lst(c_q.k), lst(c_q.v)
    threads = numba.get_num_threads()

    def call(tok, p, ids):
        logits = np.empty((1, cfg.vocab_size), dtype=np.float32)
        n = qdecode.decode_step_one_q(
            np.array([tok]), np.array([p]), emb.data, Q.qcode(emb.qtype), NO_F, out.data,
            Q.qcode(out.qtype), NO_F, codes, params["norm.weight"], norms[0], mats(LINEAR[0]),
            mats(LINEAR[1]), mats(LINEAR[2]), mats(LINEAR[3]), norms[1], mats(LINEAR[4]),
            mats(LINEAR[5]), mats(LINEAR[6]), kc, vc, ref.cos, ref.sin, float(cfg.norm_eps),
            cfg.n_heads, logits, threads, np.zeros(0, np.int64), ids, Q._F16, Q._KVALUES)
        return n, logits

    toks = rng.integers(0, cfg.vocab_size, 6)
    for p, t in enumerate(toks):
        want = ref.forward(np.array([[t]]), start_pos=p, cache=c_ref, last_only=True)
        n, got = call(int(t), p, np.zeros(0, np.int64))
        assert n == 1
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for layer in range(L):
        np.testing.assert_allclose(c_q.k[layer][:, :6], c_ref.k[layer][:, :6], rtol=1e-4,
                                   atol=1e-4 * np.abs(c_ref.k[layer]).max())
        np.testing.assert_allclose(c_q.v[layer][:, :6], c_ref.v[layer][:, :6], rtol=1e-4,
                                   atol=1e-4 * np.abs(c_ref.v[layer]).max())
    # greedy: 5 steps in one call from position 6, against the reference's argmax loop
    ids = np.zeros(5, np.int64)
    n, _ = call(int(toks[-1]), 6, ids)
    assert n == 5
    t, want_ids = int(toks[-1]), []
    for p in range(6, 11):
        z = ref.forward(np.array([[t]]), start_pos=p, cache=c_ref, last_only=True)
        t = int(np.argmax(z[0]))
        want_ids.append(t)
    assert ids.tolist() == want_ids


def test_backend_fused_decode_with_quantized_linears(rng, monkeypatch):
    """A model on the numba backend whose linear weights are QuantMatrix (float embedding):
    forward with a cache takes the fused quantized step for one sequence (counted), several
    sequences the several-sequence kernel (counted apart); both give the logits of the float
    model on the dequantized weights, and greedy generation its tokens."""
    from minillama.backends.numba.decode import quant_step as qdecode
    from minillama.infer.generate import generate
    from minillama.model.transformer import Transformer

    cfg, quant, params, ref = _quant_model(("Q4_K", "Q8_0"), rng)
    fast = Transformer(cfg, params, backend="numba", dtype=np.float32)
    for name, w in quant.items():
        if name != "tok_embeddings.weight":
            fast.params[name] = w  # the blocks themselves (the loader keeps files so)
    fast.kv_cache = "f32"  # as the reference's (a half cache: decode/test_quant_step.py)
    calls = {"n": 0, "rows": 0}
    kernel, rows_kernel = qdecode.decode_step_one_q, qdecode.decode_step_rows_q

    def counting(*args):
        calls["n"] += 1
        return kernel(*args)

    def counting_rows(*args):
        calls["rows"] += 1
        return rows_kernel(*args)

    monkeypatch.setattr(qdecode, "decode_step_one_q", counting)
    monkeypatch.setattr(qdecode, "decode_step_rows_q", counting_rows)
    S = cfg.max_seq_len
    for B in (1, 2):
        c_ref, c_fast = ref.new_cache(B, S), fast.new_cache(B, S)
        prompts = rng.integers(0, cfg.vocab_size, (B, 4))
        ref.forward(prompts, cache=c_ref, last_only=True)
        fast.forward(prompts, cache=c_fast, last_only=True)
        before, before_rows = calls["n"], calls["rows"]
        tok = rng.integers(0, cfg.vocab_size, (B, 1))
        want = ref.forward(tok, start_pos=4, cache=c_ref, last_only=True)
        got = fast.forward(tok, start_pos=4, cache=c_fast, last_only=True)
        assert calls["n"] == before + (B == 1)
        assert calls["rows"] == before_rows + (B > 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    before = calls["n"]
    assert generate(fast, [3, 1, 4], max_new_tokens=12) == generate(ref, [3, 1, 4],
                                                                   max_new_tokens=12)
    assert calls["n"] > before
