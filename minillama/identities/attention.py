r"""Identities of causal attention with grouped KV heads, one call of the op at a time.

Layouts as in :func:`minillama.core.ops.attention_forward`: q (B, T, H, hd), k and v
(B, S, KVH, hd), query head h reads KV head h // G (G = H / KVH), query t sits at absolute
position start_pos + t and reads keys 0..start_pos + t. Tolerances are
:func:`~minillama.identities.base.attention_bound`: the rounding of the scores, the softmax and
the convex mix of the values, per (sequence, head).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.identities import strategies as ids
from minillama.identities.base import (
    Identity,
    Subject,
    attention_bound,
    contrast_floor,
    differs,
    ratio,
)

_OPS = ("attention_forward",)


def _causal_mask(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    seen = start + ex["t0"] + 1  # keys 0..seen-1 are all that queries 0..t0 may read
    rng = np.random.default_rng([ex["seed"], 1])
    k2, v2 = k.copy(), v.copy()
    k2[:, seen:] = rng.standard_normal(k2[:, seen:].shape)
    v2[:, seen:] = rng.standard_normal(v2[:, seen:].shape)
    o1, o2 = s.attention(q, k, v, start), s.attention(q, k2, v2, start)
    tol = np.maximum(attention_bound(q, k, v, s.u), attention_bound(q, k2, v2, s.u))
    t0 = ex["t0"]
    same = ratio(o1[:, :t0 + 1] - o2[:, :t0 + 1], tol)
    scale = float(max(np.abs(v).max(), np.abs(v2).max()))
    return max(same, differs(o1[:, t0 + 1:] - o2[:, t0 + 1:], contrast_floor(tol.max(), scale)))


def _cached_rows(s: Subject, ex: dict) -> float:
    rng = np.random.default_rng(ex["seed"])
    B, T, KVH, G, hd = ex["B"], ex["T"], ex["KVH"], ex["G"], ex["hd"]
    S = T + ex["extra"]
    q = rng.standard_normal((B, S, KVH * G, hd)).astype(s.dtype)
    k, v = rng.standard_normal((2, B, S, KVH, hd)).astype(s.dtype)
    full = s.attention(q, k, v, 0)
    last = s.attention(q[:, S - T:], k, v, S - T)
    return ratio(last - full[:, S - T:], attention_bound(q, k, v, s.u))


def _gqa_repeated(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    G = ex["G"]
    o = s.attention(q, k, v, start)
    o_mha = s.attention(q, np.repeat(k, G, axis=2), np.repeat(v, G, axis=2), start)
    return ratio(o - o_mha, attention_bound(q, k, v, s.u))


def _key_shift(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    rng = np.random.default_rng([ex["seed"], 2])
    w = rng.standard_normal((k.shape[0], 1, k.shape[2], k.shape[3]))
    w *= ex["shift"] / np.linalg.norm(w, axis=-1, keepdims=True)  # |w| = |shift|, per (b, head)
    k2 = (k.astype(np.float64) + w).astype(s.dtype)
    o1, o2 = s.attention(q, k, v, start), s.attention(q, k2, v, start)
    return ratio(o2 - o1, attention_bound(q, k, v, s.u) + attention_bound(q, k2, v, s.u))


def _head_order(ex: dict) -> list[int]:
    """Query head j G + g of the relabelled attention is head pi_j G + sigma_j(g) of the
    original."""
    G = ex["G"]
    return [ex["pi"][j] * G + ex["sigma"][j][g] for j in range(ex["KVH"]) for g in range(G)]


def _head_permutation(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    order, pi = _head_order(ex), list(ex["pi"])
    o = s.attention(q, k, v, start)
    o2 = s.attention(q[:, :, order], k[:, :, pi], v[:, :, pi], start)
    tol = attention_bound(q, k, v, s.u)
    worst = ratio(o2 - o[:, :, order], tol[:, :, order])
    if pi != sorted(pi):  # moving the KV heads without their query heads changes the output
        o3 = s.attention(q, k[:, :, pi], v[:, :, pi], start)
        worst = max(worst, differs(o3 - o, contrast_floor(tol.max(), np.abs(v).max())))
    return worst


def _batch_independence(s: Subject, ex: dict) -> float:
    q, k, v, start = ids.attention_arrays(ex, s.dtype)
    o = s.attention(q, k, v, start)
    tol = attention_bound(q, k, v, s.u)
    return max(ratio(s.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], start) - o[b:b + 1],
                     tol[b:b + 1]) for b in range(q.shape[0]))


def _per_row_starts(s: Subject, ex: dict) -> float:
    """Rows whose queries start at their own positions p_b (a (B,) start_pos, rows of a batch at
    different depths of their caches) equal each row's own call with p_b."""
    q, k, v, _ = ids.attention_arrays(ex, s.dtype)
    starts = np.array(ex["starts"][:q.shape[0]], dtype=np.int64) % (ex["extra"] + 1)
    backend = s.backend
    sp = backend.asarray(starts)
    o = s.get(backend.attention_forward(s.put(q), s.put(k), s.put(v), sp)[0])
    tol = attention_bound(q, k, v, s.u)
    return max(ratio(s.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], int(p)) - o[b:b + 1],
                     tol[b:b + 1]) for b, p in enumerate(starts))


IDENTITIES = [
    Identity(
        name="attention_causal_mask", topic="attention",
        statement="Query t reads only keys up to its own position: new keys and values after "
                  "it leave its output unchanged (and do change the later queries' outputs).",
        equation=r"o_t(K, V) = o_t(K', V') \text{ when } k'_j = k_j, v'_j = v_j "
                 r"\text{ for all } j \le p + t",
        strategy=ids.causal_cases(),
        tolerance="attention_bound: 2 (4 (hd + 2) u max sum_d |q_d k_d| / sqrt(hd) + "
                  "(S + 4) u) max |v| per (b, h)",
        ops=_OPS, fn=_causal_mask),
    Identity(
        name="attention_cached_rows", topic="attention",
        statement="The last T queries of a causal attention over S positions, computed alone "
                  "with start_pos = S - T against all S keys (a KV cache), equal the last T rows "
                  "of the full attention.",
        equation=r"\mathrm{attn}(Q_{S-T:S}, K, V; p = S - T) = \mathrm{attn}(Q, K, V; 0)_{S-T:S}",
        strategy=ids.attention_cases(),
        tolerance="attention_bound of the full call",
        ops=_OPS, fn=_cached_rows),
    Identity(
        name="attention_gqa_equals_repeated_mha", topic="attention",
        statement="Grouped-query attention on shared K/V equals multi-head attention on K/V "
                  "repeated G times per group (query head h reads KV head h // G).",
        equation=r"\mathrm{attn}_{GQA}(Q, K, V) = \mathrm{attn}_{MHA}(Q, "
                 r"\mathrm{rep}_G(K), \mathrm{rep}_G(V))",
        strategy=ids.attention_cases(),
        tolerance="attention_bound",
        ops=_OPS, fn=_gqa_repeated),
    Identity(
        name="attention_key_shift_invariance", topic="attention",
        statement="Adding one vector w to every key shifts all the scores of a query by the "
                  "same q.w/sqrt(hd), which the softmax ignores, however large (|w| up to "
                  "1000).",
        equation=r"\mathrm{attn}(Q, K + \mathbf{1} w^T, V) = \mathrm{attn}(Q, K, V)",
        strategy=st.builds(lambda c, shift: {**c, "shift": shift}, ids.attention_cases(),
                           ids.shifts(large=(1e3,))),
        tolerance="attention_bound with and without the shift, added",
        ops=_OPS, fn=_key_shift),
    Identity(
        name="attention_head_permutation", topic="attention",
        statement="Relabelling the KV heads by pi, with their query heads moving along and "
                  "permuted within each group, permutes the output heads the same way; moving "
                  "the KV heads alone changes the output.",
        equation=r"\mathrm{attn}(Q_{:, \rho}, K_{:, \pi}, V_{:, \pi}) = "
                 r"\mathrm{attn}(Q, K, V)_{:, \rho}, \ \rho(jG + g) = \pi_j G + \sigma_j(g)",
        strategy=ids.head_permutation_cases(),
        tolerance="attention_bound",
        ops=_OPS, fn=_head_permutation),
    Identity(
        name="attention_batch_independence", topic="attention",
        statement="Each sequence of a batch attends only to itself: its output alone equals "
                  "its row of the batched output.",
        equation=r"\mathrm{attn}(Q, K, V)_b = \mathrm{attn}(Q_b, K_b, V_b)",
        strategy=ids.attention_cases(max_batch=3, min_batch=2),
        tolerance="attention_bound",
        ops=_OPS, fn=_batch_independence),
    Identity(
        name="attention_per_row_start_positions", topic="attention",
        statement="With one start position per sequence (a batch whose rows sit at different "
                  "depths of their caches), each row equals its own call with its start.",
        equation=r"\mathrm{attn}(Q, K, V; (p_b)_b)_b = \mathrm{attn}(Q_b, K_b, V_b; p_b)",
        strategy=st.builds(lambda c, p: {**c, "starts": p},
                           ids.attention_cases(max_batch=3, min_batch=2),
                           st.lists(st.integers(0, 4), min_size=3, max_size=3)),
        tolerance="attention_bound",
        ops=_OPS, fn=_per_row_starts, for_functions=False),  # a user's takes an int start
]
