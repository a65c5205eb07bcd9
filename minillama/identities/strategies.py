"""Hypothesis strategies of the identities, public for users' own property tests.

Each ``*_cases`` strategy draws a small dict of sizes and a ``seed``; the arrays are built from
the seed by the matching ``*_arrays`` function (standard normal entries), so a failing example
shrinks to small sizes and seed 0 and prints as one short line. ``*_inputs`` strategies give the
arrays themselves, for a user's ``@given`` test::

    from hypothesis import given
    from minillama.identities import strategies

    @given(strategies.attention_inputs())
    def test_my_attention_is_causal(args):
        q, k, v, start_pos = args      # q (B, T, H, hd); k, v (B, S, KVH, hd), S = start_pos + T
        ...

Sizes use the project's letters: B batch, T query positions, S key positions, H query heads,
KVH key/value heads, G = H / KVH, hd head dim, D model dim, V vocabulary, N rows.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core.quant import QUANT_TYPES

__all__ = ["seeds", "shifts", "attention_cases", "attention_arrays", "attention_inputs",
           "causal_cases", "head_permutation_cases", "rope_cases", "rope_arrays", "rope_inputs",
           "norm_cases", "norm_arrays", "norm_inputs", "quant_cases", "quant_arrays",
           "lora_cases", "permutation_of", "ROUND_TRIP_TYPES"]

#: the seed of an example's arrays
seeds = st.integers(0, 2**32 - 1)

#: the GGML block types with a plain round-to-nearest quantizer and a per-value error bound
ROUND_TRIP_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")


def attention_cases(max_batch: int = 2, max_t: int = 6, max_extra: int = 4, max_kv_heads: int = 3,
                    max_group: int = 3, head_dims=(2, 4, 8), min_batch: int = 1, min_t: int = 1):
    """Sizes of one attention call: ``B``, ``T`` queries, ``extra`` earlier key positions
    (S = T + extra, the first query at position ``extra``), ``KVH`` KV heads, ``G`` query heads
    per KV head (H = G KVH), ``hd``, and a ``seed``."""
    return st.fixed_dictionaries({
        "seed": seeds, "B": st.integers(min_batch, max_batch), "T": st.integers(min_t, max_t),
        "extra": st.integers(0, max_extra), "KVH": st.integers(1, max_kv_heads),
        "G": st.integers(1, max_group), "hd": st.sampled_from(tuple(head_dims))})


def attention_arrays(case: dict, dtype=np.float64):
    """(q (B, T, H, hd), k (B, S, KVH, hd), v (B, S, KVH, hd), start_pos) of an
    :func:`attention_cases` example."""
    rng = np.random.default_rng(case["seed"])
    B, T, KVH, G, hd = case["B"], case["T"], case["KVH"], case["G"], case["hd"]
    S = T + case["extra"]
    q = rng.standard_normal((B, T, KVH * G, hd)).astype(dtype)
    k = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    v = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    return q, k, v, case["extra"]


def attention_inputs(dtype=np.float64, **sizes):
    """Strategy of (q, k, v, start_pos) arrays (:func:`attention_cases` sizes, keyword
    arguments passed on to it)."""
    return attention_cases(**sizes).map(lambda c: attention_arrays(c, dtype))


@st.composite
def causal_cases(draw):
    """:func:`attention_cases` with T >= 2 and ``t0`` < T - 1: the keys after query t0's
    position get new values."""
    case = draw(attention_cases(min_t=2))
    return {**case, "t0": draw(st.integers(0, case["T"] - 2))}


def shifts(small: float = 10.0, large=(1e3, 3e3)):
    """A constant added to logits: half of the draws within +-``small``, half of magnitude in
    ``large``, where an exponential that is not max-shifted overflows (or underflows to 0)."""
    big = tuple(-v for v in large) + tuple(large)
    return st.one_of(st.floats(-small, small), st.sampled_from(big))


def permutation_of(n: int):
    """A permutation of range(n) as a tuple."""
    return st.permutations(range(n)).map(tuple)


@st.composite
def head_permutation_cases(draw, base=None):
    """``base`` (default :func:`attention_cases`) with ``pi``, a permutation of the KV heads,
    and ``sigma``, one permutation of the G query heads of each group."""
    case = draw(base if base is not None else attention_cases())
    pi = draw(permutation_of(case["KVH"]))
    sigma = tuple(draw(permutation_of(case["G"])) for _ in range(case["KVH"]))
    return {**case, "pi": pi, "sigma": sigma}


def rope_cases(max_half: int = 16, max_t: int = 6, max_start: int = 5000):
    """Sizes of one RoPE call: ``T`` positions from ``start``, head dim 2 ``half``, a seed."""
    return st.fixed_dictionaries({"seed": seeds, "half": st.integers(1, max_half),
                                  "T": st.integers(1, max_t), "start": st.integers(0, max_start)})


def rope_arrays(case: dict, dtype=np.float64, scale: float = 10.0):
    """(x (1, T, 1, hd), positions (T,)) of a :func:`rope_cases` example."""
    rng = np.random.default_rng(case["seed"])
    x = scale * rng.standard_normal((1, case["T"], 1, 2 * case["half"]))
    return x.astype(dtype), np.arange(case["start"], case["start"] + case["T"])


def rope_inputs(dtype=np.float64, **sizes):
    """Strategy of (x, positions) for a RoPE of x (B, T, nh, hd) at the positions (T,)."""
    return rope_cases(**sizes).map(lambda c: rope_arrays(c, dtype))


def norm_cases(max_rows: int = 4, max_dim: int = 64, min_dim: int = 1):
    """Sizes of one normalisation call: ``N`` rows of ``D`` values and a seed."""
    return st.fixed_dictionaries({"seed": seeds, "N": st.integers(1, max_rows),
                                  "D": st.integers(min_dim, max_dim)})


def norm_arrays(case: dict, dtype=np.float64, offset: float = 0.5):
    """(x (N, D), g (D,), b (D,)) of a :func:`norm_cases` example: rows N(offset, 1), gain and
    bias N(0, 1)."""
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((case["N"], case["D"])) + offset
    g, b = rng.standard_normal((2, case["D"]))
    return x.astype(dtype), g.astype(dtype), b.astype(dtype)


def norm_inputs(dtype=np.float64, **sizes):
    """Strategy of (x, g, b) arrays for a norm of x (N, D) with gain g and bias b (D,)."""
    return norm_cases(**sizes).map(lambda c: norm_arrays(c, dtype))


def quant_cases(types=ROUND_TRIP_TYPES, max_rows: int = 3, max_blocks: int = 3):
    """One matrix to quantize: ``qtype``, ``rows``, ``blocks`` per row, the values' ``scale``
    (a power of ten from 1e-4 to 1e3, so float16 scales from subnormal to large), ``zero_block``
    (the first block all zeros) and a seed."""
    return st.fixed_dictionaries({
        "seed": seeds, "qtype": st.sampled_from(tuple(types)), "rows": st.integers(1, max_rows),
        "blocks": st.integers(1, max_blocks), "scale": st.sampled_from((1e-4, 1e-2, 1.0, 1e3)),
        "zero_block": st.booleans()})


def quant_arrays(case: dict) -> np.ndarray:
    """The float32 matrix (rows, blocks * values per block) of a :func:`quant_cases` example."""
    rng = np.random.default_rng(case["seed"])
    K = case["blocks"] * QUANT_TYPES[case["qtype"]].block_elems
    w = (case["scale"] * rng.standard_normal((case["rows"], K))).astype(np.float32)
    if case["zero_block"]:
        w[:, :QUANT_TYPES[case["qtype"]].block_elems] = 0
    return w


def lora_cases(max_rows: int = 5, max_dim: int = 16, max_rank: int = 4):
    """Sizes of one LoRA linear: ``N`` rows, ``din`` -> ``dout``, rank ``r``, ``alpha``."""
    return st.fixed_dictionaries({
        "seed": seeds, "N": st.integers(1, max_rows), "din": st.integers(1, max_dim),
        "dout": st.integers(1, max_dim), "r": st.integers(1, max_rank),
        "alpha": st.sampled_from((1.0, 8.0, 16.0, 32.0))})
