r"""Block-quantized matrices: a linear layer's weight kept in the GGML blocks of its file.

A :class:`QuantMatrix` is a weight W of shape (N, K) (out, in) stored as the raw bytes of its
GGML blocks, row by row: ``data`` is a uint8 array of shape (N, K / block_values * block_bytes),
so row n holds the blocks of W[n, :] in file order and rows can be sliced or permuted freely.
The model passes it to ``backend.linear_forward`` like a float matrix; the reference backend
dequantizes it (the exact math) and the fast backends compute from the blocks.

:data:`QUANT_TYPES` is the one table of the supported GGML block types: a :class:`QuantType` per
type (GGML type id, values and bytes per block, where its float16 scales sit, its dequantizer).
The backends, the GGUF reader and the quantizers read a type's facts from it, and the numba
kernels derive their constants from it; :data:`IQ4_GRID` is the value table of the IQ4 types.
:func:`dequantize` / :func:`dequantize_rows` turn blocks back into float32 values; each type has
one function ``dequantize_<type>(b)`` mapping blocks ``b`` uint8 (nb, bytes per block) to float32
(nb, values per block), written as the block's equation (docs/MATH.md, "Block quantization").
Scales are float16 (little-endian) widened to float32; every product is in float32, in the order
written, so the result is the exact value llama.cpp's reference dequantizer computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minillama.core.errors import MinillamaError


@dataclass(frozen=True)
class QuantType:
    """The facts of one GGML block type (a row of :data:`QUANT_TYPES`)."""

    #: GGML's name of the type ("Q4_K"), the key of :data:`QUANT_TYPES`
    name: str
    #: GGML type id (ggml's ``enum ggml_type``, as GGUF tensor infos store it)
    type_id: int
    #: values per block
    block_elems: int
    #: bytes per block
    block_bytes: int
    #: byte offsets of the block's float16 scale fields (d, and m or dmin)
    scale_fields: tuple[int, ...]
    #: blocks uint8 (nb, block_bytes) -> float32 values (nb, block_elems)
    dequantize: Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """W (N, K) as GGML blocks: ``data`` uint8 (N, row_bytes), ``qtype`` a key of
    :data:`QUANT_TYPES`."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in QUANT_TYPES:
            raise MinillamaError(f"GGML type {self.qtype} is not supported "
                                 f"(supported: {', '.join(QUANT_TYPES)})")
        N, K = self.shape
        t = QUANT_TYPES[self.qtype]
        per, size = t.block_elems, t.block_bytes
        if K % per:
            raise MinillamaError(f"a {self.qtype} row of {K} values is not a whole number of "
                                 f"blocks of {per}")
        if self.data.dtype != np.uint8 or self.data.shape != (N, K // per * size):
            raise MinillamaError(f"{self.qtype} matrix {N}x{K} needs uint8 data of shape "
                                 f"{(N, K // per * size)}, got {self.data.dtype} "
                                 f"{self.data.shape}")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def ndim(self) -> int:
        return 2


# ---------------------------------------------------------------------------------------------
# unpacking helpers: fields of a block as arrays
# ---------------------------------------------------------------------------------------------
def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, widened: (nb, 1) float32."""
    return b[:, at:at + 2].view("<f2").astype(np.float32)


def _fields(b: np.ndarray, width: int) -> np.ndarray:
    """Bytes (..., m) cut into fields of ``width`` bits, all the lowest fields first:
    (..., 8 / width * m), entry k m + i = (b_i >> k width) & (2^width - 1). With width 4 these are
    the low nibbles then the high nibbles; with width 1, bit k of every byte in turn."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    f = (b[..., None, :] >> shifts) & np.uint8((1 << width) - 1)
    return f.reshape(*b.shape[:-1], -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes s: for
    j < 4, sc_j = s_j & 63 and m_j = s_{j+4} & 63; for j >= 4 the low 4 bits come from s_{j+4}
    (low nibble: sc, high: m) and the top 2 bits from the top of s_{j-4} (sc) and s_j (m)."""
    a, c, e = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (e & 15) | (a >> 6) << 4], axis=1)
    m = np.concatenate([c & 63, (e >> 4) | (c >> 6) << 4], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


#: IQ4_NL / IQ4_XS: the 16 non-uniform levels a 4-bit index selects (denser near zero; ggml's
#: ``kvalues_iq4nl``), the one copy: the quantizer and the numba kernels read it from here
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                    dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# one function per type: blocks (nb, bytes) -> values (nb, per block)
# ---------------------------------------------------------------------------------------------
def dequantize_q8_0(b):
    r"""Q8_0 (34 bytes): d (f16), q_j int8 for j < 32: x_j = d\,q_j."""
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def dequantize_q4_0(b):
    r"""Q4_0 (18 bytes): d, 16 bytes of nibbles (low: q_0..q_15, high: q_16..q_31):
    x_j = d\,(q_j - 8)."""
    return _f16(b, 0) * (_fields(b[:, 2:], 4).astype(np.float32) - 8)


def dequantize_q4_1(b):
    r"""Q4_1 (20 bytes): d, m, nibbles as Q4_0: x_j = d\,q_j + m."""
    return _f16(b, 0) * _fields(b[:, 4:], 4).astype(np.float32) + _f16(b, 2)


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit q_j: the nibble of qs (as Q4_0) and bit j of the little-endian 32-bit qh as bit 4."""
    high = np.unpackbits(qh, axis=1, bitorder="little")
    return (_fields(qs, 4) | high << 4).astype(np.float32)


def dequantize_q5_0(b):
    r"""Q5_0 (22 bytes): d, qh (4 bytes), nibbles: q_j = nibble_j + 16 bit_j(qh),
    x_j = d\,(q_j - 16)."""
    return _f16(b, 0) * (_q5(b[:, 2:6], b[:, 6:]) - 16)


def dequantize_q5_1(b):
    r"""Q5_1 (24 bytes): d, m, qh, nibbles; q_j as Q5_0: x_j = d\,q_j + m."""
    return _f16(b, 0) * _q5(b[:, 4:8], b[:, 8:]) + _f16(b, 2)


def dequantize_q2_k(b):
    r"""Q2_K (84 bytes, 256 values): 16 bytes of (sc_s low nibble, m_s high nibble) for 16
    sub-blocks of 16, 64 bytes of 2-bit q, d, dmin. Value i = 128 h + 32 k + l has
    q_i = (qs_{32 h + l} >> 2k) & 3 and sub-block s = i / 16: x_i = d\,sc_s\,q_i - dmin\,m_s."""
    nb = len(b)
    s = b[:, :16]
    q = _fields(b[:, 16:80].reshape(nb, 2, 32), 2).astype(np.float32).reshape(nb, 16, 16)
    dl = _f16(b, 80) * (s & 15).astype(np.float32)
    ml = _f16(b, 82) * (s >> 4).astype(np.float32)
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(nb, 256)


def dequantize_q3_k(b):
    r"""Q3_K (110 bytes): hmask (32), 2-bit q (64, laid out as Q2_K), 12 bytes of 6-bit scales,
    d. Value i = 32 k + l has high bit hb_i = (hmask_l >> k) & 1 and
    q_i = lo_i - 4 (1 - hb_i) in -4..3; scale sc_s (s = i / 16) has its low 4 bits in nibble
    s / 8 of byte s mod 8 and its top 2 bits at bit 2 (s / 4) of byte 8 + s mod 4:
    x_i = d\,(sc_s - 32)\,q_i."""
    nb = len(b)
    lo = _fields(b[:, 32:96].reshape(nb, 2, 32), 2).reshape(nb, 256).astype(np.int8)
    hb = _fields(b[:, :32], 1).astype(np.int8)
    q = (lo - 4 * (1 - hb)).astype(np.float32).reshape(nb, 16, 16)
    sc = _fields(b[:, 96:104], 4) | _fields(b[:, 104:108], 2) << 4
    dl = _f16(b, 108) * (sc.astype(np.float32) - 32)
    return (dl[:, :, None] * q).reshape(nb, 256)


def dequantize_q4_k(b):
    r"""Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit (sc_j, m_j) for 8 sub-blocks of 32
    (:func:`_k_scales`), 128 bytes of nibbles: 32 bytes per 64 values, low nibbles sub-block 2c,
    high 2c + 1: x_i = d\,sc_j\,q_i - dmin\,m_j."""
    nb = len(b)
    sc, m = _k_scales(b[:, 4:16])
    q = _fields(b[:, 16:].reshape(nb, 4, 32), 4).astype(np.float32).reshape(nb, 8, 32)
    dl, ml = _f16(b, 0) * sc, _f16(b, 2) * m
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(nb, 256)


def dequantize_q5_k(b):
    r"""Q5_K (176 bytes): as Q4_K with 32 bytes qh before the nibbles: value l of sub-block j
    adds 16 ((qh_l >> j) & 1): x_i = d\,sc_j\,q_i - dmin\,m_j."""
    nb = len(b)
    sc, m = _k_scales(b[:, 4:16])
    lo = _fields(b[:, 48:].reshape(nb, 4, 32), 4).reshape(nb, 256)
    q = (lo | _fields(b[:, 16:48], 1) << 4).astype(np.float32).reshape(nb, 8, 32)
    dl, ml = _f16(b, 0) * sc, _f16(b, 2) * m
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(nb, 256)


def dequantize_q6_k(b):
    r"""Q6_K (210 bytes): 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d. In
    half h, value v < 128 has low 4 bits nibble v / 64 of ql_{64 h + v mod 64} and top 2 bits
    (qh_{32 h + v mod 32} >> 2 (v / 32)) & 3; s = i / 16: x_i = d\,sc_s\,(q_i - 32)."""
    nb = len(b)
    lo = _fields(b[:, :128].reshape(nb, 2, 64), 4)
    hi = _fields(b[:, 128:192].reshape(nb, 2, 32), 2)
    q = ((lo | hi << 4).astype(np.float32) - 32).reshape(nb, 16, 16)
    dl = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (dl[:, :, None] * q).reshape(nb, 256)


def dequantize_iq4_nl(b):
    r"""IQ4_NL (18 bytes): d and nibbles as Q4_0, each an index into the non-linear grid
    :data:`IQ4_GRID`: x_j = d\,g_{q_j}."""
    return _f16(b, 0) * IQ4_GRID[_fields(b[:, 2:], 4)]


def dequantize_iq4_xs(b):
    r"""IQ4_XS (136 bytes): d, 16-bit sh, 4 bytes sl, 128 bytes of nibbles (16 bytes per
    sub-block of 32, as Q4_0). Sub-block j has sc_j = nibble j mod 2 of sl_{j/2} +
    16 ((sh >> 2j) & 3): x_i = d\,(sc_j - 32)\,g_{q_i}."""
    nb = len(b)
    sl, sh = b[:, 4:8], b[:, 2:4]
    low = np.stack([sl & 15, sl >> 4], axis=2).reshape(nb, 8)
    high = np.stack([(sh >> k) & 3 for k in (0, 2, 4, 6)], axis=2).reshape(nb, 8)
    dl = _f16(b, 0) * ((low | high << 4).astype(np.float32) - 32)
    g = IQ4_GRID[_fields(b[:, 8:].reshape(nb, 8, 16), 4)]
    return (dl[:, :, None] * g).reshape(nb, 256)


#: GGML type name -> its :class:`QuantType`: every block type minillama reads, in GGML id order
QUANT_TYPES: dict[str, QuantType] = {t.name: t for t in (
    #         name      type_id elems bytes  scale_fields  dequantize
    QuantType("Q4_0",   2,      32,   18,    (0,),         dequantize_q4_0),
    QuantType("Q4_1",   3,      32,   20,    (0, 2),       dequantize_q4_1),
    QuantType("Q5_0",   6,      32,   22,    (0,),         dequantize_q5_0),
    QuantType("Q5_1",   7,      32,   24,    (0, 2),       dequantize_q5_1),
    QuantType("Q8_0",   8,      32,   34,    (0,),         dequantize_q8_0),
    QuantType("Q2_K",   10,     256,  84,    (80, 82),     dequantize_q2_k),
    QuantType("Q3_K",   11,     256,  110,   (108,),       dequantize_q3_k),
    QuantType("Q4_K",   12,     256,  144,   (0, 2),       dequantize_q4_k),
    QuantType("Q5_K",   13,     256,  176,   (0, 2),       dequantize_q5_k),
    QuantType("Q6_K",   14,     256,  210,   (208,),       dequantize_q6_k),
    QuantType("IQ4_NL", 20,     32,   18,    (0,),         dequantize_iq4_nl),
    QuantType("IQ4_XS", 23,     256,  136,   (0,),         dequantize_iq4_xs),
)}


def dequantize_rows(qtype: str, data: np.ndarray, K: int, out: np.ndarray | None = None
                    ) -> np.ndarray:
    """Rows of GGML blocks ``data`` uint8 (n, row_bytes) of type ``qtype`` -> float32 (n, K),
    or written into ``out`` (n, K) (any float dtype) and returned."""
    t = QUANT_TYPES[qtype]
    n = data.shape[0]
    x = t.dequantize(np.ascontiguousarray(data).reshape(-1, t.block_bytes)).reshape(n, K)
    if out is None:
        return x
    out[...] = x
    return out


def dequantize(w: QuantMatrix) -> np.ndarray:
    """The float32 matrix (N, K) that a :class:`QuantMatrix` stands for."""
    return dequantize_rows(w.qtype, w.data, w.shape[1])


def nonfinite_scales(w: QuantMatrix) -> int:
    """How many float16 scale fields of ``w`` are NaN or infinite (a corrupt file: every value
    of such a block would be NaN/inf). Reads only the scale bytes."""
    t = QUANT_TYPES[w.qtype]
    blocks = w.data.reshape(-1, t.block_bytes)
    return sum(int(np.count_nonzero(~np.isfinite(
        np.ascontiguousarray(blocks[:, at:at + 2]).view("<f2")))) for at in t.scale_fields)


def dequantize_params(params: dict) -> dict:
    """``params`` with every :class:`QuantMatrix` replaced by its float32 matrix (for writers and
    converters, which work on float weights)."""
    return {k: dequantize(v) if isinstance(v, QuantMatrix) else v for k, v in params.items()}
