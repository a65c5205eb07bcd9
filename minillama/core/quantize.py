r"""Quantizers: a float matrix W (N, K) to the GGML blocks of a
:class:`~minillama.core.quant.QuantMatrix`, and the choice of each tensor's type in a quantized
GGUF file (the ``minillama quantize`` command is :mod:`minillama.cli.convert`).

Every row is cut into blocks of B consecutive values (B = 32, or a super-block of 256 for the
``_K`` types); each block is stored as small integers q and one or two float16 numbers. One
function per type, each with its block equation; they work on all blocks of the matrix at once
(``x`` has shape (nblocks, B), the result (nblocks, bytes per block)).

Legacy types (round to nearest, one float16 scale d, or d and a minimum m, per 32 values):

* Q8_0: x = d q, q in [-127, 127];  Q4_0 / Q5_0: x = d (q - 8) / d (q - 16), q 4 / 5 bits;
* Q4_1 / Q5_1: x = d q + m, q in [0, 15] / [0, 31].

They are bit for bit the reference quantizers of ggml (and of the ``gguf`` Python package).

K types (super-blocks of 256 values cut into sub-blocks j; float16 d and dmin per super-block,
small integer scales per sub-block):

* Q4_K / Q5_K: x = d s_j q - dmin m_j, 8 sub-blocks of 32, s_j, m_j in [0, 63] (6 bits),
  q in [0, 15] / [0, 31];
* Q6_K: x = d s_j (q - 32), 16 sub-blocks of 16, s_j in [-127, 127] (int8), q in [0, 63];
* Q3_K: x = d s_j q, 16 sub-blocks of 16, s_j in [-32, 31] (6 bits), q in [-4, 3];
* Q2_K: x = d s_j q - dmin m_j, 16 sub-blocks of 16, s_j, m_j in [0, 15], q in [0, 3];
* IQ4_NL: blocks of 32, x = d v[q], v the 16 non-uniform levels of
  :data:`~minillama.core.quant.IQ4_GRID`.

The K-type scales are searched the simple way: for each sub-block a few trial step sizes around
(max - min) / qmax, each followed by the least-squares (scale, offset) for the integers it
gives, keeping the one of least squared error; then the sub-block scales are themselves
quantized to 4, 6 or 8 bits against the super-block's d, and q is recomputed with the scales the
file will hold. The search is unweighted (ggml weights by |x|; the files are read the same way).
"""

from __future__ import annotations

import numpy as np

from minillama.core import quant
from minillama.core.errors import MinillamaError
from minillama.core.quant import IQ4_GRID, QUANT_TYPES, QuantMatrix

#: K type -> the 32-block type llama.cpp falls back to when a row is not whole super-blocks
K_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1",
              "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _f16(a: np.ndarray) -> np.ndarray:
    """float32 values as their float16 bytes, (n,) -> (n, 2) uint8."""
    return np.asarray(a, dtype=np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _f16_round(a: np.ndarray) -> np.ndarray:
    """The float32 value the file will hold for ``a`` stored as float16."""
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d = 0 (an all-zero block quantizes to q = 0)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _round_away(v: np.ndarray) -> np.ndarray:
    """round half away from zero (C's roundf), which ggml uses."""
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values in [0, 15] -> (n, 16) bytes: low nibble q[:, i], high nibble q[:, 16 + i]."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _high_bits32(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit values -> (n, 4) bytes: bit 4 of q[:, i] is bit i of a little-endian uint32."""
    return np.packbits((q.astype(np.uint8) >> 4) & 1, axis=1, bitorder="little")


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value of largest magnitude with its sign (the first one on ties), (n, 1)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


# ---------------------------------------------------------------------------------------------
# legacy 32-value blocks: bit for bit ggml's reference quantizers
# ---------------------------------------------------------------------------------------------
def q8_0(x: np.ndarray) -> np.ndarray:
    r"""Q8_0: x_i = d q_i, d = max|x| / 127, q_i = round(x_i / d) in [-127, 127].

    Block (34 bytes): d float16, then q_0..q_31 int8."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_away(x * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16(d), q.view(np.uint8)], axis=1)


def q4_0(x: np.ndarray) -> np.ndarray:
    r"""Q4_0: x_i = d (q_i - 8), d = -m / 8 with m the signed value of largest |x|,
    q_i = clip(floor(x_i / d + 8.5), 0, 15) (so m itself is q = 0, exactly -8 d).

    Block (18 bytes): d float16, then 16 bytes: low nibbles q_0..q_15, high nibbles q_16..q_31."""
    d = _signed_absmax(x) / np.float32(-8)
    q = np.clip(np.floor(x * _inverse(d) + np.float32(8.5)), 0, 15)
    return np.concatenate([_f16(d), _nibbles(q)], axis=1)


def q5_0(x: np.ndarray) -> np.ndarray:
    r"""Q5_0: x_i = d (q_i - 16), d = -m / 16 (m the signed value of largest |x|),
    q_i = clip(floor(x_i / d + 16.5), 0, 31).

    Block (22 bytes): d float16, the 32 fifth bits as a uint32 (bit i of q_i), then the low
    nibbles as in Q4_0."""
    d = _signed_absmax(x) / np.float32(-16)
    q = np.clip(np.floor(x * _inverse(d) + np.float32(16.5)), 0, 31)
    return np.concatenate([_f16(d), _high_bits32(q), _nibbles(q.astype(np.uint8) & 15)], axis=1)


def q4_1(x: np.ndarray) -> np.ndarray:
    r"""Q4_1: x_i = d q_i + m, m = min x, d = (max x - min x) / 15,
    q_i = clip(floor((x_i - m) / d + 0.5), 0, 15).

    Block (20 bytes): d float16, m float16, then the nibbles as in Q4_0."""
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.clip(np.floor((x - lo) * _inverse(d) + np.float32(0.5)), 0, 15)
    return np.concatenate([_f16(d), _f16(lo), _nibbles(q)], axis=1)


def q5_1(x: np.ndarray) -> np.ndarray:
    r"""Q5_1: x_i = d q_i + m, m = min x, d = (max x - min x) / 31,
    q_i = clip(floor((x_i - m) / d + 0.5), 0, 31).

    Block (24 bytes): d float16, m float16, the fifth bits (uint32), then the low nibbles."""
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.clip(np.floor((x - lo) * _inverse(d) + np.float32(0.5)), 0, 31)
    return np.concatenate([_f16(d), _f16(lo), _high_bits32(q), _nibbles(q.astype(np.uint8) & 15)],
                          axis=1)


# ---------------------------------------------------------------------------------------------
# scale searches of the K types
# ---------------------------------------------------------------------------------------------
def fit_scale_min(x: np.ndarray, qmax: int, trials: int = 21) -> tuple[np.ndarray, np.ndarray]:
    r"""Per row of ``x`` (M, n): s >= 0 and m >= 0 making x_i ~ s q_i - m with integers
    q_i in [0, qmax], by least squared error.

    Trial t takes the step (max - min) / (qmax - 1 + t / 10), min = min(x, 0), rounds
    q = clip(round((x - min) / step), 0, qmax), then solves the 2x2 least-squares problem
    min_{s,b} sum (s q_i + b - x_i)^2 (b = -m, held at 0 when it comes out positive)."""
    x = x.astype(np.float64)
    lo = np.minimum(x.min(axis=1), 0.0)
    span = x.max(axis=1) - lo
    n = x.shape[1]
    best_s, best_m = span / qmax, -lo
    best_err = ((np.clip(np.rint((x + best_m[:, None]) / np.where(span > 0, best_s, 1)[:, None]),
                         0, qmax) * best_s[:, None] - best_m[:, None] - x) ** 2).sum(axis=1)
    for t in range(trials):
        step = span / (qmax - 1 + t / 10)
        q = np.clip(np.rint((x - lo[:, None]) / np.where(span > 0, step, 1)[:, None]), 0, qmax)
        sq, sx, sqq, sqx = q.sum(1), x.sum(1), (q * q).sum(1), (q * x).sum(1)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = np.where(ok, det, 1)
        s = np.where(ok, (n * sqx - sq * sx) / safe, 0.0)
        b = np.where(ok, (sqq * sx - sq * sqx) / safe, 0.0)
        pos = b > 0  # the offset may only lower the range: refit the scale alone
        s = np.where(pos, sqx / np.where(sqq > 0, sqq, 1), s)
        b = np.where(pos, 0.0, b)
        s = np.maximum(s, 0.0)
        err = ((s[:, None] * q + b[:, None] - x) ** 2).sum(axis=1)
        better = err < best_err
        best_s, best_m, best_err = (np.where(better, s, best_s), np.where(better, -b, best_m),
                                    np.where(better, err, best_err))
    return best_s, best_m


def fit_scale(x: np.ndarray, qmin: int, qmax: int, trials: int = 19) -> np.ndarray:
    r"""Per row of ``x`` (M, n): a signed s making x_i ~ s q_i with integers q_i in
    [qmin, qmax], by least squared error: trial t maps the signed value m of largest |x| to
    q = qmin (1 + (t - 9) / 100 of it), rounds q = clip(round(x / step)), and takes the
    least-squares s = sum q x / sum q^2 for those integers."""
    x = x.astype(np.float64)
    m = _signed_absmax(x)[:, 0]
    best_s = m / qmin
    safe = np.where(best_s != 0, best_s, 1)[:, None]
    best_err = ((np.clip(np.rint(x / safe), qmin, qmax) * best_s[:, None] - x) ** 2).sum(axis=1)
    for t in range(trials):
        step = m / (qmin * (1 + (t - trials // 2) / 100))
        q = np.clip(np.rint(x / np.where(step != 0, step, 1)[:, None]), qmin, qmax)
        sqq = (q * q).sum(1)
        s = np.where(sqq > 0, (q * x).sum(1) / np.where(sqq > 0, sqq, 1), 0.0)
        err = ((s[:, None] * q - x) ** 2).sum(axis=1)
        better = err < best_err
        best_s, best_err = np.where(better, s, best_s), np.where(better, err, best_err)
    return best_s


def _k_scales(x: np.ndarray, qmax: int, sub: int, smax: int = 63):
    """Shared by Q2_K, Q4_K and Q5_K: (d, dmin as stored, scales s and mins m in [0, smax]
    (n, 256 / sub), q (n, 256)) for x ~ d s_j q - dmin m_j."""
    n, nsub = x.shape[0], 256 // sub
    xs = x.reshape(n * nsub, sub)
    s, m = fit_scale_min(xs, qmax)
    s, m = s.reshape(n, nsub), m.reshape(n, nsub)
    d = _f16_round(s.max(axis=1) / smax)
    dmin = _f16_round(m.max(axis=1) / smax)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), 0, smax)
    mn = np.clip(np.rint(m / np.where(dmin > 0, dmin, 1)[:, None]), 0, smax)
    step = (d[:, None] * sc).astype(np.float32)  # what the file's reader multiplies by
    off = (dmin[:, None] * mn).astype(np.float32)
    q = np.rint((xs.reshape(n, nsub, sub) + off[..., None]) /
                np.where(step > 0, step, 1)[..., None])
    q = np.where(step[..., None] > 0, np.clip(q, 0, qmax), 0)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.reshape(n, 256).astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> 12 bytes: bytes 0-3 hold s_0..s_3 and the top 2
    bits of s_4..s_7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of s_4..s_7
    (low nibble) and of m_4..m_7 (high nibble)."""
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                           mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)


def _k_low_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 256) -> (n, 128): in each 64 values, byte l holds q_l (low nibble) and q_{32+l}."""
    q = q.reshape(-1, 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


# ---------------------------------------------------------------------------------------------
# K types: super-blocks of 256
# ---------------------------------------------------------------------------------------------
def q4_k(x: np.ndarray) -> np.ndarray:
    r"""Q4_K: x_i = d s_j q_i - dmin m_j for i in sub-block j (8 sub-blocks of 32),
    q_i in [0, 15], s_j, m_j in [0, 63]; (s, m) per sub-block from :func:`fit_scale_min`,
    d = max s / 63, dmin = max m / 63.

    Block (144 bytes): d, dmin float16, 12 bytes of packed scales/mins, 128 bytes of nibbles."""
    d, dmin, sc, mn, q = _k_scales(x, 15, 32)
    return np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn), _k_low_nibbles(q)],
                          axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    r"""Q5_K: x_i = d s_j q_i - dmin m_j as Q4_K with q_i in [0, 31].

    Block (176 bytes): d, dmin, 12 bytes of scales/mins, 32 bytes of fifth bits (bit j of byte
    l is bit 4 of value l of sub-block j), 128 bytes of low nibbles as in Q4_K."""
    d, dmin, sc, mn, q = _k_scales(x, 31, 32)
    high = ((q.reshape(-1, 8, 32) >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    return np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn),
                           np.bitwise_or.reduce(high, axis=1).astype(np.uint8),
                           _k_low_nibbles(q)], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    r"""Q6_K: x_i = d s_j (q_i - 32) for i in sub-block j (16 sub-blocks of 16), q_i in
    [0, 63], s_j int8 in [-127, 127]; s per sub-block from :func:`fit_scale`, d = max|s| / 127.

    Block (210 bytes): 128 bytes of low nibbles (in each half of 128 values byte l holds
    values l and 64 + l), 64 bytes of top 2 bits (byte l of a half holds values l, 32 + l,
    64 + l, 96 + l at bits 0, 2, 4, 6), 16 int8 scales, d float16."""
    n = x.shape[0]
    s = fit_scale(x.reshape(n * 16, 16), -32, 31).reshape(n, 16)
    d = _f16_round(np.abs(s).max(axis=1) / 127)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -127, 127)
    step = (d[:, None] * sc).astype(np.float32)
    q = np.rint(x.reshape(n, 16, 16) / np.where(step != 0, step, 1)[..., None])
    q = (np.where(step[..., None] != 0, np.clip(q, -32, 31), 0) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # half, quarter, position
    low = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # (n, 2, 2, 32): values l, 64 + l
    top = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None],
                               axis=2).astype(np.uint8)
    return np.concatenate([low.reshape(n, 128), top.reshape(n, 64),
                           sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """(n, 256) values in [0, 3] -> (n, 64): in each half of 128 values byte l holds values
    l, 32 + l, 64 + l, 96 + l at bits 0, 2, 4, 6."""
    q = q.reshape(-1, 2, 4, 32) & 3
    shifts = np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    return np.bitwise_or.reduce(q << shifts, axis=2).astype(np.uint8).reshape(-1, 64)


def q2_k(x: np.ndarray) -> np.ndarray:
    r"""Q2_K: x_i = d s_j q_i - dmin m_j for i in sub-block j (16 sub-blocks of 16), q_i in
    [0, 3], s_j, m_j in [0, 15] (4 bits); (s, m) per sub-block from :func:`fit_scale_min`.

    Block (84 bytes): 16 bytes s_j | m_j << 4, 64 bytes of 2-bit q (as :func:`_two_bit_planes`),
    d, dmin float16."""
    d, dmin, sc, mn, q = _k_scales(x, 3, 16, smax=15)
    return np.concatenate([sc | (mn << 4), _two_bit_planes(q), _f16(d), _f16(dmin)], axis=1)


def q3_k(x: np.ndarray) -> np.ndarray:
    r"""Q3_K: x_i = d s_j q_i for i in sub-block j (16 sub-blocks of 16), q_i in [-4, 3],
    s_j in [-32, 31] (6 bits, stored s_j + 32); s per sub-block from :func:`fit_scale`,
    d = max|s| / 31.

    Block (110 bytes): 32 bytes of high bits (bit j of byte l is set when value 32 j + l has
    q >= 0), 64 bytes of the low 2 bits of q + 4 (as :func:`_two_bit_planes`), 12 bytes of
    scales (bytes 0-7: low nibbles of u_0..u_7 and, high, of u_8..u_15; bytes 8-11: the top 2
    bits of u_{4k+b} at bits 2k of byte 8 + b, u = s + 32), d float16."""
    n = x.shape[0]
    s = fit_scale(x.reshape(n * 16, 16), -4, 3).reshape(n, 16)
    d = _f16_round(np.abs(s).max(axis=1) / 31)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -32, 31)
    step = (d[:, None] * sc).astype(np.float32)
    q = np.rint(x.reshape(n, 16, 16) / np.where(step != 0, step, 1)[..., None])
    u = (np.where(step[..., None] != 0, np.clip(q, -4, 3), 0) + 4).astype(np.uint8)
    u = u.reshape(n, 256)
    high = ((u.reshape(n, 8, 32) >> 2) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    us = (sc + 32).astype(np.uint8)
    low = (us[:, :8] & 15) | ((us[:, 8:] & 15) << 4)
    top = np.bitwise_or.reduce(((us.reshape(n, 4, 4) >> 4) & 3)
                               << np.array([0, 2, 4, 6], np.uint8)[None, :, None], axis=1)
    return np.concatenate([np.bitwise_or.reduce(high, axis=1).astype(np.uint8),
                           _two_bit_planes(u), low, top.astype(np.uint8), _f16(d)], axis=1)


def iq4_nl(x: np.ndarray) -> np.ndarray:
    r"""IQ4_NL: x_i = d v[q_i], v = :data:`~minillama.core.quant.IQ4_GRID`, q_i in [0, 15]: for
    a few trial d around m / v_0 (m the signed value of largest |x|), q_i = the level nearest
    x_i / d, then the least-squares d = sum v[q] x / sum v[q]^2; the trial of least squared error
    is kept.

    Block (18 bytes): d float16, then the nibbles as in Q4_0."""
    x64 = x.astype(np.float64)
    v = IQ4_GRID.astype(np.float64)
    mids = (v[1:] + v[:-1]) / 2
    m = _signed_absmax(x64)[:, 0]
    best_d, best_err = np.zeros(len(x)), (x64 ** 2).sum(1)
    for t in range(-7, 8):
        d0 = m / (v[0] + t)
        q = np.searchsorted(mids, x64 / np.where(d0 != 0, d0, 1)[:, None])
        vq = v[q]
        den = (vq * vq).sum(1)
        d = np.where(d0 != 0, (vq * x64).sum(1) / den, 0.0)
        err = ((d[:, None] * vq - x64) ** 2).sum(1)
        better = err < best_err
        best_d, best_err = np.where(better, d, best_d), np.where(better, err, best_err)
    d = _f16_round(best_d)
    q = np.searchsorted(mids, x64 / np.where(d != 0, d, 1)[:, None])
    return np.concatenate([_f16(d), _nibbles(q)], axis=1)


#: GGML type -> block quantizer (nblocks, B) float32 -> (nblocks, bytes) uint8
QUANTIZERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q5_0": q5_0, "Q4_1": q4_1, "Q5_1": q5_1,
              "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
              "IQ4_NL": iq4_nl}


# ---------------------------------------------------------------------------------------------
# which type each tensor gets
# ---------------------------------------------------------------------------------------------
FLOAT_TYPES = ("F32", "F16")
F16_MAX = 65504.0
#: llama.cpp's mixture presets: base type of the matrices (see :func:`plan_types`)
PRESETS = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}


def supported_type(qtype: str, presets: bool = False) -> str:
    """``qtype`` when it is a type a matrix can be written as (or a preset, if allowed)."""
    ok = [*FLOAT_TYPES, *QUANTIZERS] + (list(PRESETS) if presets else [])
    if qtype not in ok:
        raise MinillamaError(f"unknown tensor type {str(qtype)[:20]!r} (supported: "
                             f"{', '.join(ok)})")
    return qtype


def resolve_type(qtype: str, K: int, values=None) -> tuple[str, str | None]:
    """The type a matrix with rows of ``K`` values is written as when ``qtype`` is asked for,
    and a note when it differs: a K type whose rows are not whole super-blocks of 256 falls
    back to llama.cpp's 32-block type (:data:`K_FALLBACK`), a row that is not whole blocks of
    32 either stays F16; ``values`` beyond the float16 range (whose scales float16 cannot
    hold) stay F32."""
    if qtype == "F32":
        return qtype, None
    if values is not None and np.abs(np.asarray(values)).max() > F16_MAX:
        return "F32", f"values beyond the float16 range: F32 instead of {qtype}"
    if qtype == "F16":
        return qtype, None
    want = qtype
    if K % QUANT_TYPES[qtype].block_elems and qtype in K_FALLBACK:
        qtype = K_FALLBACK[qtype]
    if K % QUANT_TYPES[qtype].block_elems:
        qtype = "F16"
    note = None if qtype == want else f"rows of {K} are not whole {want} blocks: {qtype}"
    return qtype, note


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M presets:
    the first and last eighth, and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def plan_types(cfg, params, qtype: str, output_type: str | None = None,
               embedding_type: str | None = None) -> dict[str, str]:
    """The type asked for each matrix of ``params`` (before :func:`resolve_type`):

    * the output head (``output.weight``, or the token embeddings when tied): ``output_type``,
      else Q6_K for every quantized type below 6 bits (Q8_0 and Q6_K keep their own, floats
      their own), as llama.cpp's presets do;
    * the token embeddings (untied): ``embedding_type``, else the base type;
    * Q4_K_M / Q5_K_M: Q4_K / Q5_K, except attention.wv and feed_forward.w2 of the layers
      :func:`_more_bits` picks, which take Q6_K;
    * every other matrix: ``qtype``."""
    supported_type(qtype, presets=True)
    for t in (output_type, embedding_type):
        if t is not None:
            supported_type(t)
    base = PRESETS.get(qtype, qtype)
    head = "output.weight" if "output.weight" in params else "tok_embeddings.weight"
    plan = {}
    for name, a in params.items():
        if len(getattr(a, "shape", ())) != 2:
            continue
        kind = base
        if qtype in PRESETS and name.startswith("layers."):
            layer = int(name.split(".")[1])
            if name.endswith(("attention.wv.weight", "feed_forward.w2.weight")) \
                    and _more_bits(layer, cfg.n_layers):
                kind = "Q6_K"
        if name == "tok_embeddings.weight" and embedding_type:
            kind = embedding_type
        if name == head:
            kind = output_type or (base if base in (*FLOAT_TYPES, "Q8_0", "Q6_K") else "Q6_K")
        plan[name] = kind
    return plan


def quantize(w, qtype: str) -> QuantMatrix:
    """The float matrix ``w`` (N, K) as a :class:`QuantMatrix` of GGML type ``qtype``; K must be
    a whole number of blocks."""
    if qtype not in QUANTIZERS:
        raise MinillamaError(f"quantizing to {qtype} is not supported "
                             f"(supported: {', '.join(QUANTIZERS)})")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise MinillamaError(f"quantize needs a matrix, got shape {list(w.shape)}")
    if not np.isfinite(w).all() or (w.size and np.abs(w).max() > F16_MAX):
        raise MinillamaError("quantize needs finite values within the float16 range")
    N, K = w.shape
    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    if K % per:
        raise MinillamaError(f"a {qtype} row of {K} values is not a whole number of blocks "
                             f"of {per}")
    data = QUANTIZERS[qtype](w.reshape(-1, per))
    return QuantMatrix(qtype, (N, K), np.ascontiguousarray(data, dtype=np.uint8)
                       .reshape(N, K // per * size))


def quantize_params(cfg, params, qtype: str, output_type: str | None = None,
                    embedding_type: str | None = None):
    """``(params, types, notes)``: the matrices of ``params`` quantized by
    :func:`plan_types` and :func:`resolve_type` (QuantMatrix values), ``types`` the type of every
    matrix left as floats (F16/F32) for :func:`~minillama.io.gguf.save_gguf`, and one note
    per kind of fallback. A matrix that already is a QuantMatrix of its planned type is kept as
    it is; one of another type is dequantized first (requantizing loses more than quantizing
    the float original)."""
    plan = plan_types(cfg, params, qtype, output_type, embedding_type)
    out, types, notes = dict(params), {}, {}
    for name, kind in plan.items():
        a = params[name]
        if isinstance(a, QuantMatrix):
            if a.qtype == kind:
                continue
            deq = getattr(quant, "dequantize", None)
            if deq is None:
                raise MinillamaError(f"{name} is {a.qtype}; requantizing it to {kind} needs "
                                     f"a float checkpoint")
            a = np.asarray(deq(a), dtype=np.float32)
        a = np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a,
                       dtype=np.float32)
        kind, note = resolve_type(kind, a.shape[1], a)
        if note:
            notes.setdefault(note, []).append(name)
        if kind in FLOAT_TYPES:
            types[name] = kind
            out[name] = a
        else:
            out[name] = quantize(a, kind)
    lines = [f"{note} for {len(names)} matri{'x' if len(names) == 1 else 'ces'} "
             f"({names[0]}{', ...' if len(names) > 1 else ''})" for note, names in notes.items()]
    return out, types, lines

