"""The reference backend: NumPy arrays and the reference ops of :mod:`minillama.ops`."""

from __future__ import annotations

import os
import sys

import numpy as np

from .. import ops

_MALLOC_TUNED: bool | None = None


def tune_malloc() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc only).

    A training step allocates and frees the same few-MB activation buffers every time. With
    glibc's defaults those blocks are mmap'd or trimmed back to the OS on free, so every step
    pays page faults on first touch (a third of a small model's step time). Raising the trim
    threshold to 1 GiB and fixing the mmap threshold at its 32 MiB maximum lets malloc reuse them,
    at the price of a resident size that stays at its peak. Done once per process, on first use
    of a CPU backend; ``MINILLAMA_MALLOC_TUNE=0`` turns it off. Returns whether it was applied.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED is not None:
        return _MALLOC_TUNED
    _MALLOC_TUNED = False
    if os.environ.get("MINILLAMA_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes  # noqa: PLC0415
        import platform  # noqa: PLC0415

        if platform.libc_ver()[0] != "glibc":
            return False
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and ok
        _MALLOC_TUNED = bool(ok)
    except (OSError, AttributeError):  # pragma: no cover - not glibc after all
        pass
    return _MALLOC_TUNED


class NumpyBackend:
    """NumPy on the CPU; every op is the reference implementation. Other backends subclass this
    and override only the op pairs they accelerate."""

    name = "numpy"
    device = "cpu"

    def __init__(self) -> None:
        self.xp = np
        tune_malloc()

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
    # the notes' other pieces (model variants, cross/latent attention): reference code everywhere
    layernorm_forward = staticmethod(ops.layernorm_forward)
    layernorm_backward = staticmethod(ops.layernorm_backward)
    gelu_forward = staticmethod(ops.gelu_forward)
    gelu_backward = staticmethod(ops.gelu_backward)
    relu_forward = staticmethod(ops.relu_forward)
    relu_backward = staticmethod(ops.relu_backward)
    cross_attention_forward = staticmethod(ops.cross_attention_forward)
    cross_attention_backward = staticmethod(ops.cross_attention_backward)

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
