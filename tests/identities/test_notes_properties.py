"""Property tests (hypothesis) of the notes' claims about the pieces LLaMA chose against.

The claims are the identities of topic ``notes`` in :mod:`minillama.identities`, each stated so
that it fails for the wrong op: e.g. the RMSNorm shift identity demands a change that LayerNorm
would not show, the BatchNorm contrast a change that a per-row norm never shows, the sinusoidal
one a dependence on absolute position that RoPE lacks. They run here on every backend that has
their ops (:func:`test_properties.check_identity`); the logit-scale statistics stay below.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.core import notes_ops, ops
from tests.identities.test_properties import check_identity, identity_cases

seeds = st.integers(0, 2**32 - 1)


@pytest.mark.parametrize(("identity", "backend_name"), identity_cases(("notes",)))
def test_notes_identity(identity, backend_name):
    check_identity(identity, backend_name, examples=10)


@settings(max_examples=5, deadline=None)
@given(seed=seeds)
def test_logit_std_grows_like_sqrt_width_and_the_scale_flattens_it(seed):
    """z = h W^T with unit-RMS h and W ~ N(0, sigma^2): std(z) = sqrt(D) sigma; s = 1/sqrt(D)
    makes it sigma at every width."""
    rng = np.random.default_rng(seed)
    sigma, stds, scaled = 0.02, [], []
    widths = [16, 64, 256, 1024]
    for D in widths:
        h, _ = ops.rmsnorm_forward(rng.standard_normal((64, D)), np.ones(D), 1e-6)
        z, _ = ops.linear_forward(h, rng.normal(0, sigma, (512, D)))
        stds.append(z.std())
        scaled.append(notes_ops.logit_scale_forward(z, 1 / np.sqrt(D))[0].std())
    ratio = np.array(stds) / (np.sqrt(widths) * sigma)
    assert np.all(np.abs(ratio - 1) < 0.1), ratio  # grows like sqrt(D) ...
    assert stds[-1] / stds[0] > 6  # ... 8x over a 64x wider model
    assert np.all(np.abs(np.array(scaled) / sigma - 1) < 0.1), scaled  # flat with the scale
