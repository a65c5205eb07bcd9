r"""The 8-bit activation products of the numba backend (backends/numba/quant/int8_dots.py):
activations rounded to blocks of 32 int8 codes with a float32 scale, integer dots with the GGML
blocks.

Two bounds, per output entry, for y = W x with x^ the rounded activations (x^_k = d_b q_k):

* the kernel against the float64 product W x^ (gguf-py's dequantization of W): the integer dots
  are exact, the rest is float32 arithmetic on terms A u x^ and (o A + B) x^ whose magnitude is
  at most a few times |w x^| (w = A (u - o) - B); we hold it to 4 (K + 2) u \sum_k |w_k x^_k|;
* against the exact product W x: |x_k - x^_k| <= d_b / 2 (plus the float32 rounding of
  x_k 127 / max|x|), so |y - W x| <= 1/2 \sum_b d_b \sum_{k in b} |w_k| + 4 (K + 2) u
  \sum_k |w_k| (|x_k| + d_b).

Both kernel builds are checked where the host allows: VNNI (``vpdpbusd``, and GFNI's
``vgf2p8affineqb`` for the nibbles where the host has it) and the portable IR.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES

pytest.importorskip("gguf", reason="gguf-py (the format's reference dequantizer)")

try:
    get_backend("numba")
except MinillamaError as e:  # pragma: no cover - numba missing
    pytest.skip(f"numba backend unavailable: {e}", allow_module_level=True)

from numba import njit  # noqa: E402

from minillama.backends.numba.quant import int8_dots as I8  # noqa: E402
from minillama.backends.numba.quant import matmul as Q  # noqa: E402
from tests.backends.numba.quant.test_matmul import oracle, random_matrix  # noqa: E402

U = 2.0 ** -24
INT8 = sorted(t for t in QUANT_TYPES if QUANT_TYPES[t].type_id in I8.INT8_TYPES)
VARIANTS = [False] + ([True] if I8.VNNI else [])
_KERNELS = {}


def row_loop(qt: int, vnni: bool):
    """A new compiled loop calling the row kernel of type qt built with or without VNNI (its IR
    written when the loop first runs)."""
    irow = I8._make(qt, vnni)
    per = 8 if qt in I8._TYPESK else 1

    @njit
    def rows(w, xq, xd, xs, y):
        for n in range(w.shape[0]):
            y[n] = irow(w.ctypes.data + n * w.shape[1], xq.ctypes.data, xd.ctypes.data,
                        xs.ctypes.data, xd.shape[0] // per)

    return rows


def kernel(qt: int, vnni: bool):
    """:func:`row_loop`, one per (qt, vnni) for the module."""
    key = (qt, vnni)
    if key not in _KERNELS:
        _KERNELS[key] = row_loop(qt, vnni)
    return _KERNELS[key]


def rounded(x):
    K = x.shape[0]
    xq, xd, xs = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 16, np.float32)
    I8.quantize_row(x, xq, xd, xs)
    return xq, xd, xs


def test_the_int8_types_are_those_the_fused_decode_step_takes():
    """INT8_TYPES (qint8's kernel lists) and qdecode's compiled test agree on every id; every
    int8 type is a type of QUANT_TYPES."""
    from minillama.backends.numba.decode import quant_step as qdecode

    ids = {t.type_id for t in QUANT_TYPES.values()}
    assert set(I8.INT8_TYPES) <= ids
    assert [qt for qt in range(40) if qdecode._int8(qt)] == sorted(I8.INT8_TYPES)


def test_quantize_row():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(256) * np.repeat(rng.uniform(0.01, 100, 8), 32)).astype(np.float32)
    x[64:96] = 0  # an all-zero block
    x[100] = 1e4  # an outlier
    xq, xd, xs = rounded(x)
    d = np.repeat(xd.astype(np.float64), 32)
    assert np.all(np.abs(x - d * xq) <= d / 2 * (1 + 1e-5))
    amax = np.abs(x.reshape(8, 32)).max(1)
    assert np.allclose(xd, amax / 127, rtol=1e-6)
    assert np.all(np.abs(xq.reshape(8, 32)).max(1)[amax > 0] == 127) and np.all(xq[64:96] == 0)
    np.testing.assert_allclose(xs, (d * xq).reshape(16, 16).sum(1), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("vnni", VARIANTS)
@pytest.mark.parametrize("qtype", INT8)
def test_kernel_against_the_rounded_activations(qtype, vnni):
    """The row kernel equals the float64 product of the dequantized W with the rounded x
    (odd and even numbers of 32-blocks), and the exact product within the rounding bound."""
    rng = np.random.default_rng(QUANT_TYPES[qtype].type_id)
    qt, per = QUANT_TYPES[qtype].type_id, QUANT_TYPES[qtype].block_elems
    for K in ([512, 768] if per == 256 else [160, 192, 32]):
        w = random_matrix(qtype, 23, K, rng)
        W = oracle(w)
        x = (rng.standard_normal(K) * rng.uniform(0.1, 3)).astype(np.float32)
        x[rng.integers(0, K)] *= 40  # an outlier in one block
        xq, xd, xs = rounded(x)
        y = np.empty(23, np.float32)
        kernel(qt, vnni)(w.data, xq, xd, xs, y)
        d = np.repeat(xd.astype(np.float64), 32)
        xr = d * xq
        err = np.abs(y - W @ xr)
        assert np.all(err <= 4 * (K + 2) * U * (np.abs(W) @ np.abs(xr)) + 1e-30), qtype
        bound = 0.5 * np.abs(W) @ d + 4 * (K + 2) * U * (np.abs(W) @ (np.abs(x) + d))
        assert np.all(np.abs(y - W @ x.astype(np.float64)) <= bound), qtype


@pytest.mark.skipif(not I8.VNNI, reason="the host has no AVX512-VNNI")
@pytest.mark.parametrize("qtype", INT8)
def test_vnni_and_portable_kernels_agree(qtype):
    """The same integer sums, the same float operations: bit for bit."""
    rng = np.random.default_rng(1)
    K = 512
    w = random_matrix(qtype, 17, K, rng)
    xq, xd, xs = rounded(rng.standard_normal(K).astype(np.float32))
    ys = [np.empty(17, np.float32) for _ in range(2)]
    for y, v in zip(ys, (False, True)):
        kernel(QUANT_TYPES[qtype].type_id, v)(w.data, xq, xd, xs, y)
    np.testing.assert_array_equal(ys[0], ys[1])


def portable(build, monkeypatch):
    """What ``build()`` compiles with the byte dots as the portable IR (no AVX2 intrinsics):
    the IR is written when the kernel first compiles, inside the patch."""
    with monkeypatch.context() as m:
        m.setattr(I8, "AVX2", False)
        return build()


@pytest.mark.skipif(I8.VNNI or not I8.AVX2, reason="the AVX2 byte dots serve hosts with AVX2 "
                    "and no AVX512-VNNI")
@pytest.mark.parametrize("qtype", INT8)
def test_avx2_and_portable_kernels_agree(qtype, monkeypatch):
    """vpmaddubsw / vpmaddwd give the integer sums of the portable IR, bit for bit, also at the
    edges of 16 bits: every activation code +-127 (x of one magnitude), every weight byte
    random (Q8_0's codes -128..127, the pairs that would saturate in one pass)."""
    rng = np.random.default_rng(2)
    K, N = 512, 17
    qt = QUANT_TYPES[qtype].type_id
    w = random_matrix(qtype, N, K, rng)
    for x in (rng.standard_normal(K), np.where(rng.random(K) < 0.5, -1.0, 1.0),
              np.ones(K)):
        xq, xd, xs = rounded(x.astype(np.float32))
        ys = [np.empty(N, np.float32) for _ in range(2)]
        kernel(qt, False)(w.data, xq, xd, xs, ys[0])

        portable(lambda: row_loop(qt, False)(w.data, xq, xd, xs, ys[1]), monkeypatch)
        np.testing.assert_array_equal(ys[0], ys[1])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_qmatmul_takes_the_int8_path(qtype, monkeypatch):
    """qmatmul with few rows: each row of x rounded and multiplied by the kernel (serial and
    split over threads alike); MINILLAMA_QUANT_DOTS=float keeps the float32 kernels; many rows
    take the float32 tiles either way."""
    rng = np.random.default_rng(2)
    K = 768
    w = random_matrix(qtype, 600, K, rng)
    W = oracle(w)
    x = rng.standard_normal((3, K)).astype(np.float32)
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    y = Q.qmatmul(x, w)
    for m in range(3):
        xq, xd, xs = rounded(x[m])
        xr = np.repeat(xd.astype(np.float64), 32) * xq
        assert np.all(np.abs(y[m] - W @ xr) <= 4 * (K + 2) * U * (np.abs(W) @ np.abs(xr)))
    monkeypatch.setattr(Q, "_parallel", lambda: False)
    np.testing.assert_array_equal(Q.qmatmul(x, w), y)
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")
    yf = Q.qmatmul(x, w)
    exact = x.astype(np.float64) @ W.T
    assert np.all(np.abs(yf - exact) <= (K + 2) * U * (np.abs(x) @ np.abs(W).T))
    assert np.abs(y - exact).max() > np.abs(yf - exact).max()  # the int8 path was taken


def _quantized_init_model(types_, seed):
    """A small LLaMA at its initialisation (Gaussian matrices, unit norms), every matrix
    quantized by minillama's quantizers to the given types (cycled), and the float model of the
    dequantized weights."""
    from minillama.core.config import ModelConfig
    from minillama.core.quant import dequantize
    from minillama.core.quantize import quantize
    from minillama.model.transformer import Transformer, init_params

    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=67,
                      hidden_dim=512, multiple_of=256, max_seq_len=20)
    params = init_params(cfg, seed=seed, dtype=np.float32)
    quant, k = {}, 0
    for name, v in params.items():
        if v.ndim == 2:
            quant[name] = quantize(v, types_[k % len(types_)])
            params[name] = dequantize(quant[name]).astype(np.float32)
            k += 1
    return cfg, quant, params, Transformer(cfg, params, backend="numpy", dtype=np.float32)


@pytest.mark.parametrize("types_", [("Q8_0",), ("Q4_K", "Q6_K"), ("Q4_0", "Q4_1", "Q5_K"),
                                    ("Q5_0", "Q5_1", "Q3_K", "Q2_K")])
def test_fused_decode_step_logits_within_tolerance(types_, monkeypatch):
    """The fused quantized decode step with 8-bit activations: the logits of the float model on
    the dequantized weights within 3e-2 of max |logit| at every position (measured: at most
    1.2e-2), where the float32 activations stay within 1e-4."""
    import numba

    from minillama.backends.numba.decode import quant_step as qdecode

    cfg, quant, params, ref = _quantized_init_model(types_, 3)
    rng = np.random.default_rng(3)
    from tests.backends.numba.quant.test_matmul import LINEAR, NO_F

    L = cfg.n_layers
    lst = numba.typed.List
    codes = np.array([[Q.qcode(quant[f"layers.{i}.{n}"].qtype) for n in LINEAR]
                      for i in range(L)], dtype=np.int64)
    emb = quant["tok_embeddings.weight"]
    norms = (lst([params[f"layers.{i}.attention_norm.weight"] for i in range(L)]),
             lst([params[f"layers.{i}.ffn_norm.weight"] for i in range(L)]))
    mats = [lst([quant[f"layers.{i}.{n}"].data for i in range(L)]) for n in LINEAR]

    def run(mode):
        monkeypatch.setenv("MINILLAMA_QUANT_DOTS", mode)
        c = ref.new_cache(1, cfg.max_seq_len)
        kc, vc = lst(c.k), lst(c.v)
        out = []
        for p, t in enumerate(toks):
            logits = np.empty((1, cfg.vocab_size), dtype=np.float32)
            qdecode.decode_step_one_q(
                np.array([t]), np.array([p]), emb.data, Q.qcode(emb.qtype), NO_F, emb.data,
                Q.qcode(emb.qtype), NO_F, codes, params["norm.weight"], norms[0], *mats[:4],
                norms[1], *mats[4:], kc, vc, ref.cos, ref.sin, float(cfg.norm_eps),
                cfg.n_heads, logits, numba.get_num_threads(), np.zeros(0, np.int64),
                np.zeros(0, np.int64), Q._F16, Q._KVALUES)
            out.append(logits[0].copy())
        return np.array(out)

    toks = rng.integers(0, cfg.vocab_size, 6)
    c_ref = ref.new_cache(1, cfg.max_seq_len)
    want = np.array([ref.forward(np.array([[t]]), start_pos=p, cache=c_ref, last_only=True)[0]
                     for p, t in enumerate(toks)])
    got8, gotf = run("int8"), run("float")
    scale = np.abs(want).max(axis=1)
    rel8 = np.abs(got8 - want).max(axis=1) / scale
    relf = np.abs(gotf - want).max(axis=1) / scale
    assert np.all(rel8 <= 3e-2), rel8
    assert np.all(relf <= 1e-4) and rel8.max() > relf.max()  # the paths differ as documented


@pytest.mark.slow
def test_smollm2_int8_decode(smollm2_gguf, monkeypatch):
    """SmolLM2-135M (Q4_1): teacher-forced decode logits with 8-bit activations against the
    float32-activation path, within 1e-1 of max |logit| (measured 7e-2 at worst, 3e-2 on
    average), and the same greedy token at least 22 of 24 steps."""
    from minillama.io.load import load_model

    model, tok = load_model(smollm2_gguf, backend="numba")
    ids = [int(i) for i in tok.encode("The capital of France is", bos=False)]

    def run(mode, forced=None):
        monkeypatch.setenv("MINILLAMA_QUANT_DOTS", mode)
        cache = model.new_cache(1)
        z = model.forward(np.array([ids]), cache=cache, last_only=True)
        toks, zs = [], []
        t = int(np.argmax(z[0]))
        for i in range(24):
            t = forced[i] if forced is not None else t
            toks.append(t)
            z = model.forward(np.array([[t]]), start_pos=len(ids) + i, cache=cache,
                              last_only=True)
            zs.append(z[0].copy())
            t = int(np.argmax(z[0]))
        return toks, np.array(zs)

    toks, zf = run("float")
    _, z8 = run("int8", toks)
    rel = np.abs(z8 - zf).max(axis=1) / np.abs(zf).max(axis=1)
    assert rel.max() <= 1e-1 and rel.mean() <= 5e-2, rel
    assert (np.argmax(z8, 1) == np.argmax(zf, 1)).sum() >= 22
