"""What the tests of every backend share: the backends to parametrise over, a small model config,
random weights away from the linear regime, and the float tolerance each backend is held to
against the reference.

Imported as ``from tests.support.helpers import ...`` (pytest puts the repository root on
``sys.path``); the ``backend`` fixture of ``conftest.py`` parametrises over
:data:`BACKEND_PARAMS`.
"""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import backend_names, get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.identities.model import lively_params as identity_params

#: the tolerance of an op-by-op parity test against ``get_backend("reference")`` on the same
#: inputs, by backend and dtype (max abs error over max abs value of the reference). numpy
#: reorders few sums; numba's kernels sum in other orders (and in tiles); cupy runs cuBLAS and
#: tensor cores (3xTF32 attention).
PARITY_TOL = {
    "numpy": {np.float32: 2e-6, np.float64: 1e-13},
    "numba": {np.float32: 1e-5, np.float64: 1e-12},
    "cupy": {np.float32: 1e-4, np.float64: 1e-10},
}


def max_rel_err(got, ref, floor: float = 0.0) -> float:
    """max |got - ref| / max(max |ref|, ``floor``), in float64 (the absolute error when both the
    reference and the floor are zero). The floor matters only where the exact result is (close
    to) zero; parity inputs are O(1)."""
    g, r = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert g.shape == r.shape, (g.shape, r.shape)
    diff = float(np.max(np.abs(g - r), initial=0.0))
    scale = max(float(np.max(np.abs(r), initial=0.0)), floor)
    return diff / scale if scale > 0 else diff


def backend_params() -> list:
    """One ``pytest.param`` per registered backend; those that cannot run here are marked skip
    with the reason (no GPU, no CuPy, no Numba)."""
    params = []
    for name in backend_names():
        try:
            get_backend(name)
        except MinillamaError as e:
            params.append(pytest.param(name, id=name, marks=pytest.mark.skip(
                reason=f"backend {name} unavailable: {e}")))
        else:
            params.append(pytest.param(name, id=name))
    return params


BACKEND_PARAMS = backend_params()


def require_float64(backend) -> type:
    """``np.float64``, or skip the test where the backend declares no float64 support."""
    if not backend.supports_float64:
        pytest.skip(f"backend {backend.name} declares no float64 support")
    return np.float64


def small_config(tie: bool = False, **kw) -> ModelConfig:
    """A two-layer GQA model small enough for float64 finite differences (D 16, H 4, KVH 2,
    F 24, V 11, T 16); keyword arguments override any field."""
    base = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, hidden_dim=24,
                max_seq_len=16, tie_embeddings=tie)
    return ModelConfig(**{**base, **kw})


def lively_params(cfg: ModelConfig, seed: int, scale: float = 0.3,
                  gain: float = 0.2) -> dict[str, np.ndarray]:
    """float64 weights well away from the linear regime (``init_params``' 0.02 would make
    attention nearly uniform, hiding position and masking errors): the identities' own
    :func:`minillama.identities.model.lively_params`, with larger matrices."""
    return identity_params(cfg, seed, scale, gain)
