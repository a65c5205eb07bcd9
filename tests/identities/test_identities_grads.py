"""The gradient identities (topic ``grad`` of :mod:`minillama.identities`) and the FFN's
activations (topic ``ffn``) on every backend that can run here: each op's backward against the
float64 central difference of its own forward (:func:`test_properties.check_identity`,
hypothesis' shrunk example in the failure message); the core ops without a backend entry on
``reference`` alone. Also in float32, where the step and the tolerance follow the dtype's
roundoff."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends.reference import ReferenceBackend
from minillama.identities import CATALOG, Subject, run_identity, select
from minillama.identities.runner import format_failure
from tests.identities.test_properties import check_identity, identity_cases


@pytest.mark.parametrize(("identity", "backend_name"), identity_cases(("grad", "ffn")))
def test_gradient_identity(identity, backend_name):
    check_identity(identity, backend_name, examples=10)


@pytest.mark.parametrize("identity", select(topics=("grad",)), ids=lambda i: i.name)
def test_gradient_identity_in_float32(identity):
    result = run_identity(identity, Subject(ReferenceBackend(), np.float32), 15, seed=0)
    assert result.status == "pass", format_failure(result, identity.name)


def test_every_backward_of_the_reference_has_its_identity():
    """Each backward op of the reference backend (and each core op pair without one) is
    checked by a gradient identity."""
    checked = {op for i in CATALOG if i.topic == "grad" for op in i.ops}
    backwards = {name for name in dir(ReferenceBackend) if "_backward" in name
                 and callable(getattr(ReferenceBackend, name))}
    assert backwards <= checked, sorted(backwards - checked)
    core = {i.name.removesuffix("_gradient") for i in CATALOG if i.topic == "grad" and not i.ops}
    assert core == {"batchnorm", "mlp", "postnorm_residual", "latent_expand"}
