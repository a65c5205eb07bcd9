"""Property tests (hypothesis) of the ops and the model: invariances the math guarantees.

The identities are the objects of :mod:`minillama.identities` (the catalog ``minillama check``
runs); each runs here on every backend that can run (an identity of core code, which calls no
backend op, on ``reference`` alone), in float64, with hypothesis' shrunk example in the failure
message. What is not an identity of the catalog stays below: the RoPE layout and the scaled
scores' variance. Model identities build small models (2 layers, D 16), so the file runs in
seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core import ops
from minillama.identities import Subject, run_identity, select
from minillama.identities.runner import NOT_GUARANTEED, format_failure
from tests.support.helpers import BACKEND_PARAMS, require_float64

#: hypothesis examples per identity and backend
EXAMPLES = 12
#: the catalog's topics held here (the notes' pieces: test_notes_properties.py)
TOPICS = ("rope", "norm", "softmax", "attention", "model", "invariance", "quant", "lora")


def identity_cases(topics) -> list:
    """(identity, backend name) for every identity of ``topics`` and every backend (the
    unavailable ones marked skip); an identity that calls no backend op on reference only."""
    cases = []
    for identity in select(topics=topics):
        for param in BACKEND_PARAMS:
            name = param.values[0]
            if identity.ops or name == "reference":
                cases.append(pytest.param(identity, name, id=f"{identity.name}-{name}",
                                          marks=param.marks))
    return cases


def check_identity(identity, backend_name: str, examples: int = EXAMPLES) -> None:
    """Run ``identity`` on the backend in float64; fail with the shrunk example."""
    backend = get_backend(backend_name)
    subject = Subject(backend, require_float64(backend))
    result = run_identity(identity, subject, examples)
    again = f"minillama check --backend {backend_name} --only {identity.name}"
    # a bitwise identity the backend does not promise runs all the same, and never fails
    want = "pass" if identity.promised(backend) else NOT_GUARANTEED
    assert result.status == want, format_failure(result, again)
    assert result.examples >= 1


@pytest.mark.parametrize(("identity", "backend_name"), identity_cases(TOPICS))
def test_identity(identity, backend_name):
    check_identity(identity, backend_name)


def rotate(x, positions, theta=10000.0):
    """x: (T, hd) at the given absolute positions (T,), via the model's tables and op."""
    hd = x.shape[-1]
    cos, sin = ops.rope_tables(hd, int(max(positions)) + 1, theta, np.float64)
    pos = np.asarray(positions)
    y, _ = ops.rope_forward(x[None, :, None, :], cos[pos], sin[pos])
    return y[0, :, 0, :]


def test_rope_rotates_interleaved_pairs_at_documented_frequencies():
    """Pair i of position m turns by m * base^(-2i/hd) (Meta/llama2.c layout, not half-split)."""
    hd, m = 8, 3
    x = np.zeros((1, hd))
    x[0, 0::2] = 1.0  # each pair starts at (1, 0)
    y = rotate(x, [m])
    angles = np.arctan2(y[0, 1::2], y[0, 0::2])
    expect = m * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(angles, expect, rtol=1e-12)


def test_scaled_scores_have_unit_variance():
    r"""For q, k with i.i.d. N(0,1) entries, s = q.k/\sqrt{hd} has mean 0 and variance exactly 1
    (a sum of hd products of variance 1, divided by sqrt(hd)).

    The score is read off the op's output: with two visible keys, k_0 = 0 (score 0) and k_1 = k,
    and values v_0 = 0, v_1 = e_0, the output's first entry is P_1 = sigmoid(s), so
    s = log(o / (1 - o)). n = B H = 16000 scores; the sample variance has std
    sqrt(Var(s^2)/n) = sqrt((2 + 6/hd)/n) ~ 0.011 (heads of one KV group share k, which adds a
    little correlation), so |var - 1| < 0.1 is a ~9 sigma bound. A missing or doubled 1/sqrt(hd)
    gives variance hd = 64 or 1/64; using 1/hd gives 1/64 too.
    """
    rng = np.random.default_rng(2024)
    B, H, KVH, hd = 2000, 8, 4, 64
    q = rng.standard_normal((B, 1, H, hd))
    k = np.zeros((B, 2, KVH, hd))
    k[:, 1] = rng.standard_normal((B, KVH, hd))
    v = np.zeros((B, 2, KVH, hd))
    v[:, 1, :, 0] = 1.0
    o, _ = ops.attention_forward(q, k, v, start_pos=1)
    p1 = o[:, 0, :, 0]
    s = np.log(p1 / (1.0 - p1))
    direct = np.einsum("bhd,bhd->bh", q[:, 0], np.repeat(k[:, 1], H // KVH, axis=1)) / np.sqrt(hd)
    np.testing.assert_allclose(s, direct, rtol=1e-8, atol=1e-8)  # the readout is exact
    assert abs(s.mean()) < 0.05  # std of the mean ~ 1/sqrt(16000) = 0.008
    assert abs(s.var() - 1.0) < 0.1, s.var()
