"""Random valid GGML blocks for the quantization tests: random bytes everywhere, except that the
float16 scale fields (d, and m or dmin where the type has one) hold finite values."""

from __future__ import annotations

import numpy as np

from minillama.core.quant import QUANT_TYPES


def finite_f16(rng, n: int, scale: float | None = None) -> np.ndarray:
    """``n`` float16 values: any finite bit pattern (subnormals, zeros and +-65504 included), or
    normal values of about ``scale`` when given."""
    if scale is not None:
        return (rng.standard_normal(n) * scale).astype(np.float16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBBFF  # exponent all ones (inf/nan) -> finite
    return bits.view(np.float16)


def random_blocks(qtype: str, n_blocks: int, rng, scale: float | None = None) -> np.ndarray:
    """uint8 (n_blocks, bytes per block): random bytes, finite float16 scale fields."""
    size = QUANT_TYPES[qtype].block_bytes
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in QUANT_TYPES[qtype].scale_fields:
        b[:, at:at + 2] = finite_f16(rng, n_blocks, scale).view(np.uint8).reshape(-1, 2)
    return b


def random_quant_rows(qtype: str, N: int, K: int, rng, scale: float | None = None):
    """uint8 (N, row bytes) of random valid blocks for a matrix (N, K)."""
    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    return random_blocks(qtype, N * K // per, rng, scale).reshape(N, K // per * size)


def quantized_params(params: dict, qtype: str, rng, scale: float = 0.002):
    """(quantized, floats): ``params`` with every matrix replaced by a :class:`QuantMatrix` of
    random valid ``qtype`` blocks (float16 scales of about ``scale``), and the same dict with
    those matrices dequantized (the float model that must give the same results)."""
    from minillama.core.quant import QuantMatrix, dequantize

    quant, floats = {}, {}
    for k, v in params.items():
        if np.ndim(v) == 2:
            N, K = v.shape
            quant[k] = QuantMatrix(qtype, (N, K), random_quant_rows(qtype, N, K, rng, scale))
            floats[k] = dequantize(quant[k])
        else:
            quant[k] = floats[k] = np.asarray(v, dtype=np.float32)
    return quant, floats
