r"""Block-quantized matrices: a linear layer's weight kept in the GGML blocks of its file.

A :class:`QuantMatrix` is a weight W of shape (N, K) (out, in) stored as the raw bytes of its
GGML blocks, row by row: ``data`` is a uint8 array of shape (N, K / block_values * block_bytes),
so row n holds the blocks of W[n, :] in file order and rows can be sliced or permuted freely.
The model passes it to ``backend.linear_forward`` like a float matrix; the reference backend
dequantizes it (the exact math) and the fast backends compute from the blocks.

``BLOCKS`` names each supported GGML type with (type id, values per block, bytes per block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import MinillamaError

#: GGML type name -> (GGML type id, values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "IQ4_NL": (20, 32, 18),
    "IQ4_XS": (23, 256, 136),
}


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """W (N, K) as GGML blocks: ``data`` uint8 (N, row_bytes), ``qtype`` a key of ``BLOCKS``."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in BLOCKS:
            raise MinillamaError(f"GGML type {self.qtype} is not supported "
                                 f"(supported: {', '.join(BLOCKS)})")
        N, K = self.shape
        _, per, size = BLOCKS[self.qtype]
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
