"""The reference backend: NumPy arrays and the reference ops of :mod:`minillama.ops`."""

from __future__ import annotations

import numpy as np

from .. import ops


class NumpyBackend:
    """NumPy on the CPU; every op is the reference implementation. Other backends subclass this
    and override only the op pairs they accelerate."""

    name = "numpy"
    device = "cpu"

    def __init__(self) -> None:
        self.xp = np

    # the named ops (forward and backward side by side, as in minillama.ops)
    embedding_forward = staticmethod(ops.embedding_forward)
    embedding_backward = staticmethod(ops.embedding_backward)
    linear_forward = staticmethod(ops.linear_forward)
    linear_backward = staticmethod(ops.linear_backward)
    rmsnorm_forward = staticmethod(ops.rmsnorm_forward)
    rmsnorm_backward = staticmethod(ops.rmsnorm_backward)
    rope_forward = staticmethod(ops.rope_forward)
    rope_backward = staticmethod(ops.rope_backward)
    attention_forward = staticmethod(ops.attention_forward)
    attention_backward = staticmethod(ops.attention_backward)
    swiglu_forward = staticmethod(ops.swiglu_forward)
    swiglu_backward = staticmethod(ops.swiglu_backward)
    cross_entropy_forward = staticmethod(ops.cross_entropy_forward)
    cross_entropy_backward = staticmethod(ops.cross_entropy_backward)

    # helpers
    def asarray(self, a, dtype=None):
        """Move/convert ``a`` to this backend's array type."""
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """A NumPy copy/view of ``a`` on the host."""
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def __repr__(self) -> str:
        return f"<minillama backend {self.name}>"
