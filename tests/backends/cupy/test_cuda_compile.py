"""CUDA kernels without a GPU: every .cu source compiles with NVRTC for sm_80 and sm_90, a broken
kernel fails with its file and line, the launch tables agree with the sources, and choosing the
CuPy backend without CuPy or without a GPU gives one clear line.

NVRTC comes from the ``nvidia-cuda-nvrtc-cu12`` wheel through ``cupy_backends.cuda.libs.nvrtc``;
no driver is needed. These tests skip only when that library truly cannot be loaded.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.backends.cupy import build as cb
from minillama.core.errors import MinillamaError

REPO = Path(__file__).resolve().parents[3]
SOURCES = cb.kernel_files()


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return cb.load_nvrtc()
    except MinillamaError as e:
        pytest.skip(f"NVRTC cannot be loaded here: {e}")


def test_kernel_sources_are_shipped():
    names = {p.name for p in SOURCES}
    for expected in ("common.cu", "rmsnorm.cu", "rope.cu", "attention.cu", "swiglu.cu",
                     "cross_entropy.cu", "embedding.cu", "adamw.cu", "flash_attention.cu",
                     "quant.cu"):
        assert expected in names
    # each file of kernels names them, and each named kernel is defined as a template
    for path in SOURCES:
        text = path.read_text()
        for name in cb.kernel_names(path):
            base = name.split("<")[0]
            assert re.search(rf"\b{base}\s*\(", text), f"{name} listed but not defined in {path}"


_RESOURCES: dict = {}


def _resources(path, arch):
    """ptxas's report of ``path`` for ``sm_<arch>`` (one NVRTC compile per file and arch, shared
    by the compile and the resource tests)."""
    key = (str(path), arch)
    if key not in _RESOURCES:
        _RESOURCES[key] = cb.ptxas_resources(path, arch)
    return _RESOURCES[key]


@pytest.mark.parametrize("arch", cb.CHECK_ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_source_compiles(nvrtc, path, arch):
    res = _resources(path, arch)  # raises KernelCompileError on any error
    assert len(res) == len(cb.name_expressions(path)), (path.name, sorted(res))


def test_nvrtc_is_a_supported_cuda_library(nvrtc):
    """CUDA 12 (cupy-cuda12x, the ``gpu`` extra) or 13 (cupy-cuda13x, ``gpu-cuda13``)."""
    major, _minor = cb.nvrtc_version()
    assert major in cb.SUPPORTED_CUDA_MAJORS


@pytest.mark.parametrize("arch", cb.CHECK_ARCHS, ids=lambda a: f"sm_{a}")
def test_kernels_fit_without_spills(nvrtc, arch):
    """ptxas, for the A100 and the H100, through whichever NVRTC (12 or 13) is installed: every
    instantiation is reported with a positive register count (so an empty or unparsed report
    fails), static shared memory stays under the 48 KiB static limit, no register spills; the
    flash kernels' dynamic shared memory fits what every sm_80+ GPU grants a block."""
    for path in SOURCES:
        exprs = cb.name_expressions(path)
        if not exprs:
            continue
        res = _resources(path, arch)
        assert len(res) == len(exprs), (path.name, sorted(res))
        for entry, r in res.items():
            assert r["smem"] <= 48 * 1024, (path.name, entry, r)
            assert r["spill"] == 0, (path.name, entry, r)
            assert 0 < r["registers"] <= 255, (path.name, entry, r)
    for hd in cb.FLASH_HEAD_DIMS:
        for kernel in ("fwd", "dq", "dkdv"):
            assert cb.flash_smem(kernel, hd) <= cb.FLASH_SMEM_LIMIT, (kernel, hd)


BROKEN = """\
// a kernel with a deliberate type error on line 5
template <typename T>
__global__ void broken(T* x, int n) {
    int i = threadIdx.x;
    x[i] = undeclared_variable + n;
}
// KERNELS: broken
"""


@pytest.mark.parametrize("arch", cb.CHECK_ARCHS, ids=lambda a: f"sm_{a}")
def test_graph_decoder_step_kernels_compile(nvrtc, arch, tmp_path):
    """The CUDA-graph decoder's own kernels (inline in backends/cupy/graph.py: cache write, matvec
    products, the token/position advance) compile for the A100 and the H100 without spills."""
    from minillama.backends.cupy.graph import _STEP_SRC

    src = tmp_path / "graph_step.cu"
    src.write_text(_STEP_SRC)
    res = cb._parse_ptxas(cb.nvrtc_check(src, arch, extra_options=("--ptxas-options=--verbose",),
                                         unique=True))
    assert {"cache_write", "gemv1", "gemv8", "advance"} <= set(res), sorted(res)
    for name, r in res.items():
        assert r["registers"] > 0 and r["spill"] == 0, (name, r)


def test_broken_kernel_fails_with_file_and_line(nvrtc, tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text(BROKEN)
    with pytest.raises(cb.KernelCompileError) as err:
        cb.nvrtc_check(bad, 80)
    e = err.value
    assert isinstance(e, MinillamaError)
    assert str(e).startswith(f"{bad.as_posix()}:5: error")
    assert "undeclared_variable" in str(e)
    assert e.line == 5 and Path(e.file) == bad
    assert "\n" not in str(e)  # one line for the user; the full log is kept on the exception
    assert "undeclared_variable" in e.log


def test_error_in_included_file_names_that_file(nvrtc, tmp_path):
    """``#include "common.cu"`` is pasted with #line markers: an error inside the included file
    names the included file and its own line, and lines after the include keep their numbers."""
    common = (cb.KERNEL_DIR / "common.cu").read_text().splitlines()
    n_common = len(common)
    (tmp_path / "common.cu").write_text("\n".join(common + ["int broken_here = ;"]) + "\n")
    kern = tmp_path / "uses_common.cu"
    kern.write_text('#include "common.cu"\n'
                    "template <typename T> __global__ void k(T* x) { x[0] = warp_sum(x[0]); }\n"
                    "// KERNELS: k\n")
    with pytest.raises(cb.KernelCompileError) as err:
        cb.nvrtc_check(kern, 90)
    assert str(err.value).startswith(f"{(tmp_path / 'common.cu').as_posix()}:{n_common + 1}:")

    (tmp_path / "common.cu").write_text("\n".join(common) + "\n")
    kern.write_text('#include "common.cu"\n'
                    "template <typename T> __global__ void k(T* x) { x[0] = warp_sum(x[0]); }\n"
                    "template <typename T> __global__ void j(T* x) { x[0] = nope(x); }\n"
                    "// KERNELS: k j\n")
    with pytest.raises(cb.KernelCompileError) as err:
        cb.nvrtc_check(kern, 80)
    assert str(err.value).startswith(f"{kern.as_posix()}:3:")


def test_launch_tables_match_the_sources():
    """The tile sizes in backends/cupy/build.py mirror the constants in the .cu files."""
    att = (cb.KERNEL_DIR / "attention.cu").read_text()
    common = (cb.KERNEL_DIR / "common.cu").read_text()
    rms = (cb.KERNEL_DIR / "rmsnorm.cu").read_text()

    def define(text, name):
        return int(re.search(rf"#define {name} (\d+)", text).group(1))

    assert define(att, "ATT_WARPS") == cb.ATTN_WARPS
    assert define(att, "DEC_WARPS") == cb.DEC_WARPS
    assert define(common, "ML_MAXD") == cb.ATTN_MAX_HD
    assert define(rms, "RMS_DG_ROWS") == cb.RMS_DG_ROWS
    assert define((cb.KERNEL_DIR / "quant.cu").read_text(), "ML_QUANT_WARPS") == cb.QUANT_WARPS
    flash = (cb.KERNEL_DIR / "flash_attention.cu").read_text()
    assert define(flash, "FA_WARPS") == cb.FLASH_WARPS
    assert define(flash, "FA_BK") == cb.FLASH_BK
    assert define(flash, "FA_BQ_DKDV") == cb.FLASH_BQ_DKDV
    assert define(flash, "FA_PAD") == cb.FLASH_PAD
    assert sorted({int(m) for m in re.findall(r"flash_fwd<(\d+),", flash)}) == \
        sorted(cb.FLASH_HEAD_DIMS)
    for ctype, dtype in (("float", "float32"), ("double", "float64")):
        body = re.search(rf"struct AttnCfg<{ctype}> \{{(.*?)\}};", att, re.S).group(1)
        got = {m.group(1): int(m.group(2))
               for m in re.finditer(r"constexpr int (\w+) = (\d+);", body)}
        import numpy as np

        assert got == cb.ATTN_TILES[np.dtype(dtype)], (ctype, got)


def test_launch_configurations():
    grid, block = cb.row_launch(7, 288)
    assert grid == (7,) and block[0] % 32 == 0 and 32 <= block[0] <= 1024
    assert cb.row_launch(3, 32000)[1] == (1024,)
    assert cb.row_launch(3, 1)[1] == (32,)
    grid, block = cb.elementwise_launch(1000)
    assert grid[0] * block[0] >= 1000
    grid, block, parts = cb.rms_dg_launch(5000, 70)
    assert grid == (3, parts) and block == (32, cb.RMS_DG_ROWS) and parts >= 1
    import numpy as np

    for dt in (np.float32, np.float64):
        tiles = cb.ATTN_TILES[np.dtype(dt)]
        rows = cb.ATTN_WARPS * tiles["RPW"]
        grid, block = cb.attn_fwd_launch(2, 37, 3, 4, dt)
        assert grid == (-(-37 * 4 // rows), 6) and block == (32 * cb.ATTN_WARPS,)
        grid, _ = cb.attn_dkdv_launch(2, 37, 3, dt)
        assert grid[0] * cb.ATTN_WARPS * tiles["KPW"] >= 37
        grid, _ = cb.attn_decode_launch(2, 3, 9, dt)
        assert grid == (6, -(-9 // tiles["GMAX"]))


def test_loader_expands_includes_with_line_markers():
    src = cb.load_source("rmsnorm")
    path = (cb.KERNEL_DIR / "rmsnorm.cu").as_posix()
    assert src.startswith(f'#line 1 "{path}"')
    assert f'#line 1 "{(cb.KERNEL_DIR / "common.cu").as_posix()}"' in src
    assert not any(ln.startswith("#include") for ln in src.splitlines())
    assert cb.name_expressions("rmsnorm")[:2] == ["rmsnorm_fwd<float>", "rmsnorm_fwd<double>"]
    with pytest.raises(MinillamaError, match="CUDA source not found"):
        cb.load_source("no_such_kernel")


def test_block_sizes_come_from_the_quant_type_table():
    """quant.cu takes its block sizes from the generated quant_types.h (QUANT_TYPES), pasted in
    once with #line markers, and defines none of its own."""
    from minillama.core.quant import QUANT_TYPES

    text = (cb.KERNEL_DIR / "quant.cu").read_text()
    assert not re.search(r"#define ML_\w+_(BYTES|ELEMS)\b", text)
    src = cb.load_source("quant")
    assert src.count('#line 1 "quant_types.h"') == 1
    for name, t in QUANT_TYPES.items():
        assert f"#define ML_{name}_BYTES {t.block_bytes}\n" in src
        assert f"#define ML_{name}_ELEMS {t.block_elems}\n" in src
    assert not any(ln.startswith("#include") for ln in src.splitlines())


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=120)


def test_import_minillama_never_imports_cupy():
    r = _run("import sys, minillama, minillama.model.transformer, minillama.backends\n"
             "import minillama.backends.cupy.build\n"
             "print(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('cupy', 'cupy_backends')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_choosing_cupy_without_cupy_says_how_to_install():
    r = _run("import sys\nsys.modules['cupy'] = None\n"
             "from minillama.backends import get_backend\n"
             "from minillama.core.errors import MinillamaError\n"
             "try:\n    get_backend('cupy')\n"
             "except MinillamaError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ('CuPy is not installed; install the GPU extra: '
                                'pip install "minillama[gpu]" (CUDA 12; '
                                '"minillama[gpu-cuda13]" for CUDA 13, as nvidia-smi shows)')
    assert "Traceback" not in r.stderr


def test_choosing_cupy_without_a_gpu_is_one_line():
    pytest.importorskip("cupy", reason="CuPy not installed")
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this runs the same on GPU machines
    r = _run("from minillama.backends import get_backend\n"
             "from minillama.core.errors import MinillamaError\n"
             "try:\n    get_backend('cupy')\n"
             "except MinillamaError as e:\n    print(repr(str(e)))\n",
             env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    msg = eval(r.stdout.strip())  # our own repr
    assert msg.startswith("no CUDA GPU found (") and msg.endswith(")")
    assert "\n" not in msg
    assert "Traceback" not in r.stderr


def test_cli_reports_cupy_unavailable_in_one_line():
    pytest.importorskip("cupy", reason="CuPy not installed")
    r = subprocess.run([sys.executable, "-m", "minillama", "backends"], capture_output=True,
                       text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("cupy")]
    assert len(line) == 1 and "no CUDA GPU found" in line[0]
