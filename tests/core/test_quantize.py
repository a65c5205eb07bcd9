"""The quantizers of minillama.core.quantize: the legacy types bit for bit against the ``gguf``
package's (ggml's reference rounding), the K types by their error (decoded by the ``gguf``
package, an independent reader) against a stated bound and against llama-quantize's when that
tool is built; hypothesis properties of the block equations."""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES, QuantMatrix
from minillama.core.quantize import QUANTIZERS, quantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LEGACY = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")
OTHERS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
#: relative RMS error bound ||x^ - x|| / ||x|| on Gaussian rows (measured: 0.27, 0.146, 0.07,
#: 0.036, 0.017, 0.075 on N(0, 1); the legacy types for scale: Q4_0 0.087, Q5_1 0.038)
REL_BOUND = {"Q2_K": 0.29, "Q3_K": 0.16, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02,
             "IQ4_NL": 0.085}
#: a type with more bits per weight has less error than this one
LESS_BITS = {"Q2_K": None, "Q3_K": "Q2_K", "Q4_K": "Q4_0", "Q5_K": "Q4_K", "Q6_K": "Q5_K",
             "IQ4_NL": "Q4_0"}
#: our K-type error may exceed llama-quantize's (no importance matrix, --pure) by this factor;
#: measured 0.94 to 1.00 (our unweighted search minimises the plain squared error it reports)
LLAMA_FACTOR = 1.05


def decode(m: QuantMatrix) -> np.ndarray:
    """The float matrix the file holds, read by the gguf package."""
    return gguf.quants.dequantize(m.data, Q[m.qtype]).reshape(m.shape)


def gaussian(n=16, k=512, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.exponential(1.0, (n, 1))).astype(np.float32)


def special_rows():
    """Rows with ties, zeros, one-sign blocks and exact rounding midpoints."""
    rows = np.zeros((6, 256), np.float32)
    rows[1] = 1.0
    rows[2] = -np.arange(256) / 7
    rows[3, ::2] = 3.0
    rows[3, 1::2] = -3.0
    rows[4] = np.arange(256) % 17 - 8.0  # multiples of a step: .5 midpoints after scaling
    rows[5] = np.linspace(-1, 1, 256) ** 3
    return rows


# ---------------------------------------------------------------------------------------------
# the legacy types: bit for bit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", LEGACY)
@pytest.mark.parametrize("x", [gaussian(), special_rows()], ids=["gaussian", "special"])
def test_legacy_bit_exact(qtype, x):
    m = quantize(x, qtype)
    assert m.qtype == qtype and m.shape == x.shape and m.data.dtype == np.uint8
    np.testing.assert_array_equal(m.data, gguf.quants.quantize(x, Q[qtype]))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(LEGACY),
       st.lists(st.floats(-1e4, 1e4, width=32), min_size=64, max_size=64))
def test_legacy_bit_exact_property(qtype, values):
    x = np.array(values, np.float32).reshape(2, 32)
    np.testing.assert_array_equal(quantize(x, qtype).data, gguf.quants.quantize(x, Q[qtype]))


@pytest.mark.parametrize("qtype", QUANTIZERS)
def test_layout_and_size(qtype):
    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    x = gaussian(3, 512)
    m = quantize(x, qtype)
    assert m.data.shape == (3, 512 // per * size)
    # rows are independent: quantizing one row alone gives its bytes
    np.testing.assert_array_equal(quantize(x[1:2], qtype).data, m.data[1:2])


# ---------------------------------------------------------------------------------------------
# the other types: the error, decoded independently
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", OTHERS)
def test_error_within_bound(qtype):
    x = gaussian(32, 512, seed=3)
    err = np.linalg.norm(decode(quantize(x, qtype)) - x) / np.linalg.norm(x)
    assert err < REL_BOUND[qtype], err
    # and more bits mean less error
    if LESS_BITS[qtype]:
        assert err < np.linalg.norm(decode(quantize(x, LESS_BITS[qtype])) - x) / np.linalg.norm(x)


@pytest.mark.parametrize("qtype", OTHERS)
def test_zero_and_constant_blocks(qtype):
    x = special_rows()
    y = decode(quantize(x, qtype))
    np.testing.assert_array_equal(y[0], 0.0)
    assert np.abs(y - x).max() <= (0.5 if qtype in ("Q2_K", "Q3_K") else 0.1) * np.abs(x).max()


def test_k_types_beat_legacy_on_outliers():
    """A K type's per-sub-block scales keep the bulk of a block accurate next to an outlier."""
    x = gaussian(8, 256, seed=4)
    x[:, 5] *= 30
    e = {t: np.linalg.norm(decode(quantize(x, t)) - x) for t in ("Q4_0", "Q4_K", "Q6_K")}
    assert e["Q4_K"] < e["Q4_0"] and e["Q6_K"] < 0.5 * e["Q4_K"], e


def test_refuses_bad_input():
    with pytest.raises(MinillamaError, match="whole number of blocks"):
        quantize(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(MinillamaError, match="not supported"):
        quantize(np.zeros((2, 256), np.float32), "Q1_X")
    with pytest.raises(MinillamaError, match="finite"):
        quantize(np.full((1, 32), np.nan, np.float32), "Q8_0")
    with pytest.raises(MinillamaError, match="float16 range"):
        quantize(np.full((1, 32), 7e4, np.float32), "Q8_0")


def _llama_quantize() -> Path | None:
    found = shutil.which("llama-quantize")
    if found:
        return Path(found)
    hits = sorted(glob.glob("/tmp/llamacpp/*/vendor/llama.cpp/build/bin/llama-quantize"))
    return Path(hits[-1]) if hits else None


@pytest.mark.parametrize("qtype", OTHERS)
def test_error_no_worse_than_llama_quantize(qtype, tmp_path):
    """llama-quantize --pure on the same F32 file; our error is at most LLAMA_FACTOR times its
    error on every matrix it wrote as ``qtype``."""
    tool = _llama_quantize()
    if tool is None:
        pytest.skip("llama-quantize is not built")
    from minillama.core.config import ModelConfig
    from minillama.io.gguf import save_gguf
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512,
                      hidden_dim=512, max_seq_len=64, tie_embeddings=False)
    params = init_params(cfg, seed=5)
    params["layers.0.feed_forward.w2.weight"] = gaussian(256, 512, seed=6)  # heavier tails
    save_gguf(tmp_path / "f32.gguf", cfg, params)
    out = tmp_path / "q.gguf"
    run = subprocess.run([str(tool), "--pure", str(tmp_path / "f32.gguf"), str(out), qtype],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    src = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    compared = 0
    for t in gguf.GGUFReader(str(out)).tensors:
        if t.tensor_type.name != qtype:
            continue
        x = src[t.name]
        theirs = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        ours = decode(quantize(x, qtype))
        ratio = np.linalg.norm(ours - x) / np.linalg.norm(theirs - x)
        assert ratio <= LLAMA_FACTOR, (t.name, ratio)
        compared += 1
    assert compared >= 7


# ---------------------------------------------------------------------------------------------
# properties of the block equations
# ---------------------------------------------------------------------------------------------
def blocks_with_anchor(per_block: int = 32):
    """Rows of 256 values, multiples of 1/16 in [-62.5, 62.5], each block of ``per_block``
    holding one value of magnitude 62.5 (so every float16 scale and minimum the file stores is
    a normal number, also after scaling by 2^k, |k| <= 3)."""
    vals = st.lists(st.integers(-1000, 1000), min_size=256, max_size=256)
    signs = st.lists(st.sampled_from([-1, 1]), min_size=256 // per_block,
                     max_size=256 // per_block)

    def build(v, s):
        x = np.array(v, np.float32).reshape(1, 256)
        x[0, ::per_block] = 1000 * np.array(s, np.float32)
        return x / 16

    return st.builds(build, vals, signs)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["Q8_0", "Q4_0"]), blocks_with_anchor())
def test_half_step(qtype, x):
    r"""|x - x^| <= d/2 per element, d the block's step, up to the float16 rounding of d
    (|q| 2^-11 d); Q4_0 clips q to 15 on the side opposite its largest value, so elements
    beyond 7.5 d there are within one step."""
    y = decode(quantize(x, qtype))
    blocks, yb = x.reshape(-1, 32), y.reshape(-1, 32)
    m = np.take_along_axis(blocks, np.abs(blocks).argmax(1)[:, None], 1)
    d = np.abs(m) / (127 if qtype == "Q8_0" else 8)
    qmax = 127 if qtype == "Q8_0" else 8
    slack = d * (qmax * 2.0 ** -11 + 1e-5)
    bound = np.where(blocks * np.sign(-m) > 7.5 * d, d, d / 2) if qtype == "Q4_0" else d / 2
    assert (np.abs(yb - blocks) <= bound + slack).all()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(LEGACY + ("Q6_K", "IQ4_NL")), blocks_with_anchor())
def test_idempotent(qtype, x):
    """quantize(dequantize(q)) == q: the values a file holds are fixed points of the quantizer,
    byte for byte for the legacy types, value for value for Q6_K and IQ4_NL (a block may have
    several encodings of the same values). Q2_K, Q3_K, Q4_K and Q5_K do not have the property:
    the searches of :func:`~minillama.core.quantize.fit_scale_min` / ``fit_scale`` do not always
    refit a sub-block to exactly its own step (and offset), and the 4- or 6-bit rounding of the
    new ones can move values by a step."""
    m = quantize(x, qtype)
    again = quantize(decode(m), qtype)
    if qtype in LEGACY:
        np.testing.assert_array_equal(again.data, m.data)
    else:
        np.testing.assert_array_equal(decode(again), decode(m))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(QUANTIZERS)), blocks_with_anchor(), st.integers(-3, 3))
def test_power_of_two_scaling(qtype, x, k):
    """Quantizing 2^k x decodes to exactly 2^k times the decoding of x (every rounding decision
    is scale free; the stored float16 numbers stay normal)."""
    s = np.float32(2.0 ** k)
    np.testing.assert_array_equal(decode(quantize(x * s, qtype)), decode(quantize(x, qtype)) * s)
