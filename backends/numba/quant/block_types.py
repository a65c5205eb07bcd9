"""The GGML block types as the numba kernels see them, derived at import from
:data:`minillama.core.quant.QUANT_TYPES` (the one table of a type's facts).

Each kernel takes the type as its GGML type id ``qt`` and branches on it (``qt == Q4_K``); each
decoder steps through a row block by block (``b * Q4_K_BYTES``). Both are module-level ints here:
Numba compiles a global int in as a constant, so these cost what the literals did (no table is
read inside compiled code). Imported only by the numba backend's quantized kernels.
"""

from __future__ import annotations

from minillama.core.quant import QUANT_TYPES


def _id(name: str) -> int:
    return QUANT_TYPES[name].type_id


def _bytes(name: str) -> int:
    return QUANT_TYPES[name].block_bytes


#: GGML type ids, the ``qt`` argument of the kernels
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (_id(k) for k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (_id(k) for k in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
IQ4_NL, IQ4_XS = _id("IQ4_NL"), _id("IQ4_XS")

#: bytes per block of each type
Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES = (
    _bytes(k) for k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))
Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = (
    _bytes(k) for k in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
IQ4_NL_BYTES, IQ4_XS_BYTES = _bytes("IQ4_NL"), _bytes("IQ4_XS")

#: GGML type id -> its :class:`~minillama.core.quant.QuantType` (for the Python code that builds
#: the kernels: sizes and names by id)
BY_ID = {t.type_id: t for t in QUANT_TYPES.values()}
