"""What the files of the CuPy backend share: ``cp``, the cupy module once bound (nothing here
imports CuPy until :func:`_import_cupy` runs, when the backend is constructed), the checks and
conversions of kernel arguments, and the kernel launch of :mod:`.build`."""

from __future__ import annotations

import numpy as np

from minillama.core.errors import MinillamaError

from . import build as cb

#: block types kept in their blocks on the device, with their (matvec, dequantize) kernels in
#: quant.cu; other quantized types are widened once when the model moves to the device
QUANT_KERNELS = {"Q8_0": ("q8_0_matvec", "q8_0_dequant"), "Q4_K": ("q4_k_matvec", "q4_k_dequant"),
                 "Q6_K": ("q6_k_matvec", "q6_k_dequant")}

INSTALL_HINT = ('install the GPU extra: pip install "minillama[gpu]" (CUDA 12; '
                '"minillama[gpu-cuda13]" for CUDA 13, as nvidia-smi shows)')



class _BoundCupy:
    """Stands for the ``cupy`` module in this backend's files: attribute reads go to ``module``,
    which :func:`_import_cupy` binds once a GPU is confirmed (None until then). Each attribute is
    kept after its first read, so ``cp.empty`` costs what a module attribute does; binding another
    module drops them."""

    def __init__(self) -> None:
        self._module = None

    @property
    def module(self):
        return self._module

    @module.setter
    def module(self, value) -> None:
        self.__dict__.clear()  # the attributes kept from the module bound before
        self._module = value

    def __getattr__(self, name):
        if name == "_module":  # not yet set (during __init__)
            raise AttributeError(name)
        if self._module is None:
            raise MinillamaError("the cupy backend is not set up (construct CupyBackend first)")
        value = getattr(self._module, name)
        self.__dict__[name] = value
        return value


cp = _BoundCupy()  # the cupy module, bound by CupyBackend() once a GPU is confirmed


def _import_cupy():
    """``cupy`` or a one-line :class:`MinillamaError` saying what is missing."""
    if cp.module is not None:
        return cp.module
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken install raising anything
        detail = "" if isinstance(e, ModuleNotFoundError) else f" ({_first_line(e)})"
        raise MinillamaError(f"CuPy is not installed{detail}; {INSTALL_HINT}") from None
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError without a driver, etc.
        raise MinillamaError(f"no CUDA GPU found ({_first_line(e)})") from None
    if n < 1:
        raise MinillamaError("no CUDA GPU found (the CUDA runtime sees 0 devices)")
    cp.module = cupy
    return cupy


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _KCtx(tuple):
    """A ctx built by a kernel forward of this backend (a plain tuple otherwise)."""


def _supported(*arrays) -> bool:
    """True when every array is a CuPy array of one dtype the kernels are built for."""
    if cp.module is None:
        return False
    dt = None
    for a in arrays:
        if not isinstance(a, cp.ndarray):
            return False
        if dt is None:
            dt = a.dtype
        elif a.dtype != dt:
            return False
    return dt in cb.CTYPES


def _c(a):
    return cp.ascontiguousarray(a)


def _scalar(dtype, value):
    return np.dtype(dtype).type(value)


def _i32(v) -> np.int32:
    v = int(v)
    if v >= 2 ** 31:
        raise MinillamaError(f"size {v} is too large for the CUDA kernels (int32 sizes)")
    return np.int32(v)


def _aligned16(*arrays) -> bool:
    """True when every array's data starts on a 16-byte boundary (float4 loads)."""
    for a in arrays:
        ptr = a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data
        if ptr % 16:
            return False
    return True


def _launch(file: str, kernel: str, dtype, grid, block, args) -> None:
    cb.get_kernel(file, kernel, dtype)(grid, block, args)
