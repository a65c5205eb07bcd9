r"""Identities of the weights' other forms: GGML block quantization (the round trip of the
quantizers, a backend's product with blocks and its embedding rows from blocks) and LoRA (the
adapter equals its merge).

The blocks hold float16 scales and float32 values: u_{32} = 2^{-24} is the roundoff of their
arithmetic whatever the dtype of the activations.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core.quant import QUANT_TYPES, dequantize
from minillama.core.quantize import QUANTIZERS, quantize
from minillama.identities import strategies as ids
from minillama.identities.base import Identity, Subject, dot_terms, ratio

U32 = 2.0**-24
#: round-trip types -> (the largest |q| of the symmetric ones or the q range of the affine ones)
_SYMMETRIC = {"Q8_0": 127, "Q4_0": 8, "Q5_0": 16}
_AFFINE = {"Q4_1": 15, "Q5_1": 31}


def _f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, (nb, 1) float64."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float64)


def round_trip_bound(qtype: str, w: np.ndarray, data: np.ndarray) -> np.ndarray:
    r"""Per value of ``w`` (N, K) float32, the bound on |w - deq(quant(w))| of a round-to-nearest
    type, from the block's float32 scale d (as the quantizer computes it) and the float16 d_{16}
    (and m_{16}) the block stores (``data``, the blocks' bytes): half a step d/2, a step for the
    value that clips at the top (Q4_0, Q5_0), the float16 rounding of the scale times the largest
    |q|, of the minimum (Q4_1, Q5_1), and float32 rounding."""
    t = QUANT_TYPES[qtype]
    x = w.reshape(-1, t.block_elems)
    blocks = data.reshape(-1, t.block_bytes)
    d16 = _f16_field(blocks, 0)
    x64 = x.astype(np.float64)
    if qtype in _SYMMETRIC:
        top = _SYMMETRIC[qtype]
        if qtype == "Q8_0":
            d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
            clipped = np.zeros(x.shape, dtype=bool)
        else:  # d = -m / top, m the signed value of largest |x|
            m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
            d = m / np.float32(-top)
            with np.errstate(divide="ignore", invalid="ignore"):
                clipped = np.where(d != 0, x64 / d, 0) >= top - 0.5 - 1e-6
        d = np.abs(d.astype(np.float64))
        bound = d * (0.5 + 0.5 * clipped + 4 * (top + 1) * U32) + top * np.abs(d - np.abs(d16))
        return bound + 2 * U32 * (np.abs(x64) + d * top)
    qmax = _AFFINE[qtype]
    lo = x.min(axis=1, keepdims=True)
    d = ((x.max(axis=1, keepdims=True) - lo) / np.float32(qmax)).astype(np.float64)
    m16 = _f16_field(blocks, 2)
    bound = (d * (0.5 + 4 * (qmax + 1) * U32) + qmax * np.abs(d - d16)
             + np.abs(lo.astype(np.float64) - m16))
    return bound + 2 * U32 * (np.abs(d16) * qmax + np.abs(m16) + np.abs(x64))


def _round_trip(s: Subject, ex: dict) -> float:
    w = ids.quant_arrays(ex)
    qm = quantize(w, ex["qtype"])
    back = dequantize(qm).astype(np.float64)
    bound = round_trip_bound(ex["qtype"], w, qm.data).reshape(w.shape)
    return ratio(back - w.astype(np.float64), bound)


def _quant_linear(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    K = ex["blocks"] * QUANT_TYPES[ex["qtype"]].block_elems
    qm = quantize(rng.standard_normal((ex["out"], K)).astype(np.float32), ex["qtype"])
    deq = dequantize(qm).astype(np.float64)
    x = rng.standard_normal((ex["N"], K)).astype(s.dtype)
    x64 = x.astype(np.float64)
    y = s.linear(x, qm)
    return ratio(y - x64 @ deq.T, 4 * (K + 2) * max(s.u, U32) * dot_terms(x64, deq))


def _quant_embedding(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    V, K = ex["out"], ex["blocks"] * QUANT_TYPES[ex["qtype"]].block_elems
    qm = quantize(rng.standard_normal((V, K)).astype(np.float32), ex["qtype"])
    tokens = rng.integers(0, V, (ex["N"], 3))
    w, t = s.backend.asarray(qm, s.dtype), s.backend.asarray(tokens)
    h = s.get(s.backend.embedding_forward(w, t)[0])
    deq = dequantize(qm).astype(np.float64)[tokens]
    return ratio(h - deq, 4 * U32 * np.abs(deq))


def _lora_merge(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    N, din, dout, r = ex["N"], ex["din"], ex["dout"], ex["r"]
    scale = ex["alpha"] / r
    x = rng.standard_normal((N, din)).astype(s.dtype)
    W = rng.standard_normal((dout, din))
    A = rng.standard_normal((r, din)) / np.sqrt(din)
    B = rng.standard_normal((dout, r))
    y = s.lora(x, W, A, B, scale)
    merged = s.linear(x, W + scale * (B @ A))
    made = dot_terms(x.astype(np.float64), np.abs(W) + scale * (np.abs(B) @ np.abs(A)))
    return ratio(y - merged, 4 * (din + r + 4) * s.u * made)


IDENTITIES = [
    Identity(
        name="quant_round_trip", topic="quant",
        statement="Quantizing to a round-to-nearest GGML block type and dequantizing moves each "
                  "value by at most half a step d/2 of its block (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1), "
                  "a whole step for the one value of Q4_0/Q5_0 that clips, plus the float16 "
                  "rounding of the stored scale and minimum.",
        equation=r"|x_i - \mathrm{deq}(\mathrm{quant}(x))_i| \le d/2 + q_{max} |d - d_{16}| "
                 r"(+ |m - m_{16}|)",
        strategy=ids.quant_cases(),
        tolerance="the bound itself, computed per value from the block's d, d16 (and m16), plus "
                  "float32 rounding of x / d and of d q + m",
        ops=(), fn=_round_trip),
    Identity(
        name="quantized_linear_matches_dequantized", topic="quant",
        statement="A linear layer whose weight stays in GGML blocks computes x deq(W)^T, the "
                  "product with the dequantized matrix (in the backend's exact products).",
        equation=r"\mathrm{linear}(x, W_q) = x\, \mathrm{deq}(W_q)^T",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "qtype": st.sampled_from(tuple(QUANTIZERS)),
            "N": st.integers(1, 6), "out": st.integers(1, 5), "blocks": st.integers(1, 2)}),
        tolerance="4 (K + 2) max(u, u32) sum_k |x_k| |deq(W)_nk|: a K-term sum, in float32 where "
                  "a backend dequantizes into float32 tiles",
        ops=("linear_forward",), fn=_quant_linear),
    Identity(
        name="quantized_embedding_matches_dequantized", topic="quant",
        statement="An embedding table kept in GGML blocks returns the dequantized rows of the "
                  "tokens read (and only those rows are dequantized).",
        equation=r"\mathrm{emb}(W_q, x)_{bt} = \mathrm{deq}(W_q)_{x_{bt}}",
        strategy=st.fixed_dictionaries({
            "seed": ids.seeds, "qtype": st.sampled_from(tuple(QUANTIZERS)),
            "N": st.integers(1, 3), "out": st.integers(1, 6), "blocks": st.integers(1, 2)}),
        tolerance="4 u32 |deq(W)|: the same float32 dequantization, row by row",
        ops=("embedding_forward",), fn=_quant_embedding),
    Identity(
        name="lora_merge_equivalence", topic="lora",
        statement="A linear layer with a LoRA adapter equals the plain linear layer with the "
                  "adapter merged into its weight.",
        equation=r"x W^T + s (x A^T) B^T = x (W + s B A)^T",
        strategy=ids.lora_cases(),
        tolerance="4 (in + r + 4) u sum |x| (|W| + s |B| |A|)^T: the terms of both sides' sums",
        ops=("lora_forward", "linear_forward"), fn=_lora_merge),
]
