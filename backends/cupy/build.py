"""Build and launch the CUDA kernels of the CuPy backend.

The kernels live as ``.cu`` files in ``kernels/`` beside this loader. Each file
names its templated kernels on a ``// KERNELS: name1 name2 ...`` line; every kernel is
instantiated for ``float`` and ``double`` through NVRTC name expressions.

* :func:`load_source` expands ``#include "other.cu"`` of a sibling file in place with ``#line``
  markers, so NVRTC messages name the real file and line (and CuPy's on-disk cache key covers the
  included text too).
* :func:`nvrtc_check` compiles one file with NVRTC for a given ``sm_XX`` without a GPU or a driver
  (the ``nvidia-cuda-nvrtc-cu12`` wheel, or ``nvidia-cuda-nvrtc`` 13.x, is enough); a failure raises
  :class:`KernelCompileError` whose message starts with ``path:line:``.
* :func:`get_kernel` compiles a file once per device with ``cupy.RawModule`` (cached here and by
  CuPy on disk) and returns the kernel function for a dtype.
* The launch configuration of every kernel is computed here (the ``*_launch`` functions) and
  nowhere else; the tile sizes in :data:`ATTN_TILES` mirror ``AttnCfg`` in ``attention.cu`` (a CI
  test checks that they agree).
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import re
import threading
import uuid
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

#: NVRTC options shared by the CI check and the runtime build (NVRTC 12 defaults to C++17; no
#: -std flag, so it cannot clash with options CuPy adds itself)
COMPILE_OPTIONS: tuple[str, ...] = ()

#: CUDA major versions the kernels are built and checked with (the ``gpu`` extra is CUDA 12's
#: cupy-cuda12x, ``gpu-cuda13`` is cupy-cuda13x)
SUPPORTED_CUDA_MAJORS = (12, 13)

#: architectures the CI compile check covers (A100 and H100)
CHECK_ARCHS = (80, 90)

#: numpy dtype -> C++ type of the template instantiation
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_KERNELS_RE = re.compile(r"^\s*//\s*KERNELS:\s*(.+?)\s*$", re.MULTILINE)
_LOG_LINE_RE = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\):\s*(?P<kind>(?:catastrophic )?error)"
                          r"\s*:?\s*(?P<msg>.*)$", re.MULTILINE)


class KernelCompileError(MinillamaError):
    """A ``.cu`` file failed to compile. The message is one line ``path:line: error: text``;
    ``.log`` holds NVRTC's full log, ``.file`` and ``.line`` the first error's location."""

    def __init__(self, message: str, log: str = "", file: str | None = None,
                 line: int | None = None):
        super().__init__(message)
        self.log = log
        self.file = file
        self.line = line


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------
def kernel_files() -> list[Path]:
    """Every ``.cu`` file shipped with the package, sorted by name."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def _resolve(name: str | Path) -> Path:
    path = Path(name)
    if not path.suffix:
        path = path.with_suffix(".cu")
    if not path.is_absolute():
        path = KERNEL_DIR / path
    if not path.is_file():
        raise MinillamaError(f"CUDA source not found: {path}")
    return path


def load_source(path: str | Path) -> str:
    """The text of ``path`` with ``#include "x.cu"`` of files beside it pasted in place.

    ``#line`` markers keep compiler messages pointing at the original file and line. Each file
    is pasted once (the same rule as ``#pragma once``). Includes in angle brackets are left alone.
    """
    path = _resolve(path)
    seen: set[Path] = set()

    def expand(p: Path) -> list[str]:
        seen.add(p)
        out = [f'#line 1 "{p.as_posix()}"']
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            m = _INCLUDE_RE.match(line)
            inc = (p.parent / m.group(1)) if m else None
            if inc is not None and inc.is_file():
                inc = inc.resolve()
                if inc not in seen:
                    out.extend(expand(inc))
                out.append(f'#line {lineno + 1} "{p.as_posix()}"')
            elif line.strip() == "#pragma once":
                out.append("")  # already handled by `seen`; keeps line numbers
            else:
                out.append(line)
        return out

    return "\n".join(expand(path)) + "\n"


def kernel_names(path: str | Path) -> list[str]:
    """The kernel template names listed on the ``// KERNELS:`` line of ``path`` (may be empty)."""
    text = _resolve(path).read_text(encoding="utf-8")
    names: list[str] = []
    for m in _KERNELS_RE.finditer(text):
        names.extend(m.group(1).split())
    return names


def name_expressions(path: str | Path, dtypes=(np.float32, np.float64)) -> list[str]:
    """``name<ctype>`` for every kernel of ``path`` and every dtype; a name written with its
    template arguments on the ``// KERNELS:`` line (``flash_fwd<64,true>``) is taken as is."""
    out: list[str] = []
    for n in kernel_names(path):
        if "<" in n:
            out.append(n)
        else:
            out.extend(f"{n}<{CTYPES[np.dtype(dt)]}>" for dt in dtypes)
    return out


def _compile_error(log: str, fallback: str) -> KernelCompileError:
    m = _LOG_LINE_RE.search(log)
    if m:
        file, line = m.group("file"), int(m.group("line"))
        msg = f"{file}:{line}: {m.group('kind')}: {m.group('msg').strip()}"
        return KernelCompileError(msg, log=log, file=file, line=line)
    first = next((ln.strip() for ln in log.splitlines() if ln.strip()), fallback)
    return KernelCompileError(f"{fallback}: {first}", log=log)


# ---------------------------------------------------------------------------------------------
# NVRTC without a GPU (CI check)
# ---------------------------------------------------------------------------------------------
_nvrtc_state: dict[str, object] = {}


def _preload_nvrtc_wheel() -> str | None:
    """Load ``libnvrtc.so.<major>`` from an NVRTC wheel into the process (global symbols), so
    CuPy's own NVRTC binding finds it without CUDA_PATH or a system toolkit. CUDA 12's wheel
    (``nvidia-cuda-nvrtc-cu12``) installs ``nvidia/cuda_nvrtc/lib``, CUDA 13's
    (``nvidia-cuda-nvrtc`` 13.x) ``nvidia/cu13/lib``; the major that CuPy was built for wins."""
    major = _cupy_cuda_major()
    found = []
    for mod in ("nvidia.cuda_nvrtc", "nvidia.cu13", "nvidia.cu12"):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        for base in spec.submodule_search_locations:
            found.extend(c for c in sorted((Path(base) / "lib").glob("libnvrtc.so*"))
                         if ".alt." not in c.name and "builtins" not in c.name)
    if major is not None:  # a library of another major would not be the one CuPy asks for
        found.sort(key=lambda c: not c.name.startswith(f"libnvrtc.so.{major}"))
    for cand in found:
        try:
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return str(cand)
    return None


def _cupy_cuda_major() -> int | None:
    """12 for cupy-cuda12x, 13 for cupy-cuda13x (whichever wheel is installed), else None."""
    from importlib.metadata import PackageNotFoundError, version

    for major in SUPPORTED_CUDA_MAJORS[::-1]:
        try:
            version(f"cupy-cuda{major}x")
        except PackageNotFoundError:
            continue
        return major
    return None


def load_nvrtc():
    """CuPy's NVRTC binding, ready to use; works without a GPU or a driver.

    Raises :class:`MinillamaError` saying why when CuPy or the NVRTC library is missing.
    """
    if "module" in _nvrtc_state:
        return _nvrtc_state["module"]
    preloaded = _preload_nvrtc_wheel()
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise MinillamaError(f"CuPy is not installed ({e}); install the GPU extra: "
                             f'pip install -e ".[gpu]"') from None
    try:
        nvrtc.getVersion()
    except Exception as e:  # CuPy raises several types when the .so is missing
        where = (f" (preloaded {preloaded})" if preloaded
                 else " (no NVRTC wheel found: nvidia-cuda-nvrtc-cu12 for CUDA 12, "
                      "nvidia-cuda-nvrtc for 13)")
        raise MinillamaError(f"NVRTC could not be loaded{where}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    _nvrtc_state["module"] = nvrtc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    return tuple(load_nvrtc().getVersion())


def nvrtc_check(path: str | Path, arch: int = 80, dtypes=(np.float32, np.float64),
                extra_options=(), unique: bool = False) -> str:
    """Compile ``path`` with NVRTC for ``sm_<arch>`` (no GPU needed) and return the compile log
    (warnings; usually empty). Every kernel on its ``// KERNELS:`` line is instantiated for each
    dtype. A failure raises :class:`KernelCompileError` (``path:line: error: ...``).
    """
    nvrtc = load_nvrtc()
    path = _resolve(path)
    src = load_source(path)
    if unique:  # PTX no other compile has: NVRTC 13 reuses cached machine code otherwise
        src += f"__device__ int ml_unique_{uuid.uuid4().hex}[1];\n"
    prog = nvrtc.createProgram(src, str(path), [], [])
    try:
        for expr in name_expressions(path, dtypes):
            nvrtc.addNameExpression(prog, expr)
        opts = list(COMPILE_OPTIONS) + [f"--gpu-architecture=sm_{int(arch)}", *extra_options]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise _compile_error(log, f"{path.name} failed to compile for sm_{arch} ({e})") \
                from None
        log = nvrtc.getProgramLog(prog)
        for expr in name_expressions(path, dtypes):  # every instantiation really exists
            nvrtc.getLoweredName(prog, expr)
        return log.strip("\x00").strip()
    finally:
        nvrtc.destroyProgram(prog)


_PTXAS_ENTRY_RE = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_PTXAS_SPILL_RE = re.compile(r"(?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads")
_PTXAS_USED_RE = re.compile(r"Used (?P<regs>\d+) registers")
_PTXAS_SMEM_RE = re.compile(r"\b(?P<smem>\d+) bytes smem\b")


def ptxas_resources(path: str | Path, arch: int = 80) -> dict[str, dict[str, int]]:
    """Per kernel entry (mangled name): registers, static shared memory (bytes) and spill bytes,
    as reported by ptxas through NVRTC for ``sm_<arch>`` (no GPU needed)."""
    # unique PTX: NVRTC 13 takes machine code for PTX it has seen from the CUDA compute cache
    # (~/.nv/ComputeCache, across processes too; seen on an H100 with CUDA 13.0) and then runs
    # no ptxas, so the log has no report (CUDA_CACHE_DISABLE=1 has the same effect)
    return _parse_ptxas(nvrtc_check(path, arch, extra_options=("--ptxas-options=--verbose",),
                                    unique=True))


def _parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.replace("\x00", "").splitlines():
        m = _PTXAS_ENTRY_RE.search(line)
        if m:
            current = out.setdefault(m.group("name"), dict(registers=0, smem=0, spill=0))
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL_RE.search(line)
        if m:
            current["spill"] = int(m.group("st")) + int(m.group("ld"))
        m = _PTXAS_USED_RE.search(line)
        if m:
            current["registers"] = int(m.group("regs"))
            s = _PTXAS_SMEM_RE.search(line)
            current["smem"] = int(s.group("smem")) if s else 0
    return out


# ---------------------------------------------------------------------------------------------
# Runtime build (needs a GPU): one RawModule per (device, file), compiled once
# ---------------------------------------------------------------------------------------------
_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str, str], object] = {}
_lock = threading.Lock()


def get_module(name: str | Path):
    """The compiled ``cupy.RawModule`` of kernel file ``name`` on the current device (cached)."""
    import cupy

    path = _resolve(name)
    dev = cupy.cuda.Device().id
    key = (dev, str(path))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = cupy.RawModule(code=load_source(path), options=COMPILE_OPTIONS,
                                 name_expressions=name_expressions(path))
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                log = e.get_message() if hasattr(e, "get_message") else str(e)
                raise _compile_error(log, f"{path.name} failed to compile") from None
            _modules[key] = mod
    return mod


def get_kernel(name: str | Path, kernel: str, dtype):
    """The function ``kernel<ctype(dtype)>`` of kernel file ``name`` on the current device."""
    import cupy

    ctype = CTYPES.get(np.dtype(dtype))
    if ctype is None:
        raise MinillamaError(f"no CUDA kernel for dtype {np.dtype(dtype)} (float32/float64 only)")
    dev = cupy.cuda.Device().id
    key = (dev, str(name), f"{kernel}<{ctype}>")
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(name).get_function(key[2])
        _functions[key] = fn
    return fn


def get_kernel_expr(name: str | Path, expr: str, shared_mem: int = 0):
    """The kernel of file ``name`` whose name expression is ``expr`` (as written on its
    ``// KERNELS:`` line, e.g. ``flash_fwd<64,true>``), allowed ``shared_mem`` bytes of dynamic
    shared memory (above the default 48 KiB when asked)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, str(name), expr)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(name).get_function(expr)
        _functions[key] = fn
    if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
        fn.max_dynamic_shared_size_bytes = int(shared_mem)
    return fn


def launch_expr(name: str | Path, expr: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch :func:`get_kernel_expr` ``(name, expr)`` with ``shared_mem`` bytes of dynamic
    shared memory."""
    get_kernel_expr(name, expr, shared_mem)(grid, block, args, shared_mem=int(shared_mem))


def clear_cache() -> None:
    """Forget every compiled module (tests; CuPy's on-disk cache is kept)."""
    _modules.clear()
    _functions.clear()


# ---------------------------------------------------------------------------------------------
# Launch configurations (all of them, in one place)
# ---------------------------------------------------------------------------------------------
#: tile sizes of attention.cu (AttnCfg<T>) and its warps per block; keep in sync with the source
ATTN_WARPS = 4
DEC_WARPS = 8
ATTN_TILES = {
    np.dtype(np.float32): dict(BK=32, RPW=4, RPW_DQ=2, BQ=32, KPW=2, GMAX=8),
    np.dtype(np.float64): dict(BK=16, RPW=2, RPW_DQ=1, BQ=16, KPW=1, GMAX=4),
}
#: largest head dimension the attention kernels take (ML_MAXD in common.cu)
ATTN_MAX_HD = 128
#: rows per block of rmsnorm_bwd_dg (RMS_DG_ROWS in rmsnorm.cu)
RMS_DG_ROWS = 8

ELEMENTWISE_BLOCK = 256
MAX_GRID_X = 65535 * 32  # grid-stride kernels need no more blocks than this


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def row_launch(n_rows: int, width: int):
    """One block per row of ``width`` elements: threads = a power of two in [32, 1024], about
    two elements per thread. Returns (grid, block)."""
    threads = min(1024, max(32, _next_pow2((width + 1) // 2)))
    return (max(1, n_rows),), (threads,)


#: quant.cu: warps (output rows) per block of the matvec kernels (ML_QUANT_WARPS there), and the
#: most rows of x a product sends to the matvec kernels (more rows: dequantize once, then a GEMM)
QUANT_WARPS = 4
QUANT_MATVEC_ROWS = 8


def quant_matvec_launch(N: int, M: int):
    """quant.cu's *_matvec kernels: one warp per output row, one grid row per row of x."""
    return (math.ceil(N / QUANT_WARPS), M), (32 * QUANT_WARPS,)


def elementwise_launch(n: int):
    """Grid-stride kernels over ``n`` items: 256 threads, enough blocks to cover ``n`` (capped)."""
    blocks = max(1, min(math.ceil(n / ELEMENTWISE_BLOCK), MAX_GRID_X))
    return (blocks,), (ELEMENTWISE_BLOCK,)


def rms_dg_launch(n_rows: int, width: int):
    """rmsnorm_bwd_dg: 32 columns x RMS_DG_ROWS rows per block; the rows are split over P blocks
    so that each block sums about 256 rows. Returns (grid, block, P)."""
    parts = max(1, min(64, math.ceil(n_rows / (RMS_DG_ROWS * 32))))
    return (math.ceil(width / 32), parts), (32, RMS_DG_ROWS), parts


def attn_fwd_launch(B: int, T: int, KVH: int, G: int, dtype):
    """attn_fwd: ATTN_WARPS warps x RPW rows of the R = T G rows of each (b, kv head)."""
    rows = ATTN_WARPS * ATTN_TILES[np.dtype(dtype)]["RPW"]
    return (math.ceil(T * G / rows), B * KVH), (32 * ATTN_WARPS,)


def attn_dq_launch(B: int, T: int, KVH: int, G: int, dtype):
    """attn_bwd_dq: like the forward with RPW_DQ rows per warp."""
    rows = ATTN_WARPS * ATTN_TILES[np.dtype(dtype)]["RPW_DQ"]
    return (math.ceil(T * G / rows), B * KVH), (32 * ATTN_WARPS,)


def attn_dkdv_launch(B: int, S: int, KVH: int, dtype):
    """attn_bwd_dkdv: ATTN_WARPS warps x KPW keys per block."""
    keys = ATTN_WARPS * ATTN_TILES[np.dtype(dtype)]["KPW"]
    return (math.ceil(S / keys), B * KVH), (32 * ATTN_WARPS,)


def attn_dsum_launch(n_rows: int):
    """attn_bwd_dsum: one warp per (b, t, h) row."""
    return (math.ceil(n_rows / ATTN_WARPS),), (32 * ATTN_WARPS,)


#: flash_attention.cu (FA_* there): warps per block (16 rows each), keys per K/V tile, query rows
#: per tile of the dk/dv kernel, padding floats per shared-memory row, and the head dimensions
#: it is instantiated for
FLASH_WARPS = 4
FLASH_BK = 32
FLASH_BQ_DKDV = 16
FLASH_PAD = 4
FLASH_HEAD_DIMS = (64, 128)
#: dynamic shared memory per block that every CUDA GPU of compute capability 8.0+ grants (bytes)
FLASH_SMEM_LIMIT = 163 * 1024


def flash_smem(kernel: str, hd: int) -> int:
    """Dynamic shared memory (bytes) of a flash_attention.cu kernel ("fwd", "dq" or "dkdv")."""
    W, BK, BQd, P = FLASH_WARPS, FLASH_BK, FLASH_BQ_DKDV, FLASH_PAD
    if kernel == "fwd":
        floats = (16 * W + BK) * (hd + P) + BK * (hd + 2 * P) + W * 16 * (BK + P)
    elif kernel == "dq":
        floats = 2 * (16 * W + BK) * (hd + P) + W * 16 * (BK + P)
    elif kernel == "dkdv":
        floats = 2 * (16 * W + BQd) * (hd + P) + 2 * W * 16 * (BQd + P) + 2 * BQd
    else:
        raise ValueError(kernel)
    return 4 * floats


def flash_launch(kernel: str, B: int, T: int, S: int, KVH: int, G: int):
    """(grid, block) of flash_fwd / flash_bwd_dq (16 FLASH_WARPS of the R = T G rows of each
    (b, kv head) per block) or flash_bwd_dkdv (16 FLASH_WARPS keys per block)."""
    per = 16 * FLASH_WARPS
    n = S if kernel == "dkdv" else T * G
    return (math.ceil(n / per), B * KVH), (32 * FLASH_WARPS,)


#: blocks the dk/dv kernel should have at least (about two per multiprocessor of an H100)
FLASH_DKDV_MIN_BLOCKS = 264


def flash_dkdv_split(blocks: int, R: int):
    """(shares, rows per share) for flash_bwd_dkdv: when the (key block, b, kv head) grid has
    fewer than FLASH_DKDV_MIN_BLOCKS blocks (GQA/MQA, short or few sequences), the R query rows
    are split into shares summed afterwards, each a multiple of FLASH_BQ_DKDV and at least 8
    tiles long."""
    step = FLASH_BQ_DKDV
    tiles = max(1, math.ceil(R / step))
    shares = max(1, min(math.ceil(FLASH_DKDV_MIN_BLOCKS / max(blocks, 1)), tiles // 8))
    per = math.ceil(tiles / shares) * step
    return math.ceil(R / per), per


def attn_decode_launch(B: int, KVH: int, G: int, dtype):
    """attn_decode: one block per (b, kv head) and group of GMAX query heads."""
    gmax = ATTN_TILES[np.dtype(dtype)]["GMAX"]
    return (B * KVH, math.ceil(G / gmax)), (32 * DEC_WARPS,)
