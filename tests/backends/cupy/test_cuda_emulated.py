"""The CUDA kernels' logic checked on the CPU: the .cu sources are compiled as C++ with a small
emulation of the CUDA features they use (one OS thread per CUDA thread, blocks one after another,
``__syncthreads`` as a barrier, warp shuffles through a per-warp exchange buffer), and the
CuPy backend's own Python code drives them with NumPy arrays standing in for CuPy arrays.

This is what CI can run without a GPU: it checks indexing, tiling, masking, the online softmax
and the reductions against the reference ops. It says nothing about speed or about real-GPU
memory ordering (tests/backends/cupy/test_backend.py checks the real kernels on a GPU). Skips
when no C++20 compiler is found.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import types

import numpy as np
import pytest

from minillama.backends.cupy import backend as cbk
from minillama.backends.cupy import build as cb
from minillama.core import ops
from tests.support.helpers import max_rel_err

EMU_HEADER = r"""// Minimal CPU emulation of the CUDA features the minillama kernels use: one OS
// thread per CUDA thread, blocks run one after another (so function-static "__shared__" arrays are
// per block), __syncthreads as a block barrier, warp shuffles through a per-warp exchange buffer.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <mutex>
#define ML_EMULATED 1
using std::min; using std::max;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
inline std::unique_ptr<std::barrier<>> g_block_bar;
struct WarpX { std::unique_ptr<std::barrier<>> bar; alignas(8) unsigned char buf[32][8]; };
inline std::vector<WarpX> g_warps;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int emu_tid() { return threadIdx.x + blockDim.x * threadIdx.y; }
template <typename T> T emu_exchange(T v, int src) {
    int t = emu_tid(); WarpX& w = g_warps[t / 32]; int l = t % 32;
    w.bar->arrive_and_wait();
    std::memcpy(w.buf[l], &v, sizeof(T));
    w.bar->arrive_and_wait();
    T r; std::memcpy(&r, w.buf[src & 31], sizeof(T));
    return r;
}
template <typename T> T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int m) {
    return emu_exchange(v, (emu_tid() % 32) ^ m);
}
inline void __syncwarp() { g_warps[emu_tid() / 32].bar->arrive_and_wait(); }
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
// dynamic shared memory: one buffer, sized by the launcher (blocks run one after another)
inline std::vector<float> g_dyn_smem;
#define ML_DYN_SMEM(name) float* name = g_dyn_smem.data()
// cvt.rna.tf32.f32: keep 10 mantissa bits, rounding to nearest with ties away from zero
inline unsigned ml_tf32(float x) {
    unsigned u; std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
    return u & 0xffffe000u;
}
// mma.sync m16n8k8 tf32 for one warp, from each lane's fragments (layout of the PTX ISA)
struct MmaX { float a[32][4]; float b[32][2]; };
inline std::vector<MmaX> g_mma;
inline void ml_mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    int t = emu_tid(); WarpX& w = g_warps[t / 32]; MmaX& m = g_mma[t / 32]; int l = t % 32;
    w.bar->arrive_and_wait();
    for (int i = 0; i < 4; ++i) m.a[l][i] = __uint_as_float(a[i]);
    for (int i = 0; i < 2; ++i) m.b[l][i] = __uint_as_float(b[i]);
    w.bar->arrive_and_wait();
    auto A = [&](int r, int k) { return m.a[(r % 8) * 4 + k % 4][(r >= 8) + 2 * (k >= 4)]; };
    auto B = [&](int k, int n) { return m.b[n * 4 + k % 4][k >= 4]; };
    int g = l / 4, tg = l % 4;
    for (int e = 0; e < 4; ++e) {
        int r = g + 8 * (e / 2), n = 2 * tg + (e % 2);
        float acc = 0.f;
        for (int k = 0; k < 8; ++k) acc += A(r, k) * B(k, n);
        c[e] += acc;
    }
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(unsigned long long i) {
    double f; std::memcpy(&f, &i, 8); return f;
}
inline std::mutex g_atomic_mu;
template <typename T> T atomicAdd(T* p, T v) {
    std::lock_guard<std::mutex> g(g_atomic_mu); T o = *p; *p = o + v; return o;
}
using std::exp; using std::log; using std::sqrt; using std::fabs; using std::fmax;
#include <math.h>
template <typename... P, typename... A>
void emu_launch(void (*k)(P...), dim3 g, dim3 b, A... args) {
    gridDim = g; blockDim = b;
    int nt = b.x * b.y * b.z;
    g_block_bar = std::make_unique<std::barrier<>>(nt);
    g_warps = std::vector<WarpX>((nt + 31) / 32);
    g_mma = std::vector<MmaX>((nt + 31) / 32);
    for (auto& w : g_warps) w.bar = std::make_unique<std::barrier<>>(32);
    std::unique_ptr<std::barrier<>> end_bar = std::make_unique<std::barrier<>>(nt);
    std::vector<std::thread> th;
    for (int t = 0; t < nt; ++t)
        th.emplace_back([&, t] {
            threadIdx = dim3{unsigned(t % b.x), unsigned(t / b.x), 1};
            for (unsigned bz = 0; bz < g.z; ++bz)
                for (unsigned by = 0; by < g.y; ++by)
                    for (unsigned bx = 0; bx < g.x; ++bx) {
                        blockIdx = dim3{bx, by, bz};
                        k(args...);
                        end_bar->arrive_and_wait();
                    }
        });
    for (auto& x : th) x.join();
}
"""

_SIG = re.compile(r"template <typename T>\s*__global__ void\s*(?:__launch_bounds__\([^)]*\)\s*)?"
                  r"(\w+)\s*\(([^)]*)\)\s*\{", re.S)


_SIG_NT = re.compile(r"template <int HD, bool SPLIT>\s*__global__ void\s*"
                     r"(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)\s*\{", re.S)


def _translation_unit() -> str:
    """Every kernel file in its own namespace, plus an extern "C" launcher per kernel and dtype."""
    parts, wrappers = ['#include "emu.h"'], []
    for f in cb.kernel_files():
        src = cb.load_source(f)
        if cb.kernel_names(f):
            parts.append(f"namespace ns_{f.stem} {{\n{src}\n}}")
        for m in _SIG.finditer(src):
            name, params = m.group(1), [p.strip() for p in m.group(2).split(",")]
            args = ", ".join(re.findall(r"\w+", p)[-1] for p in params)
            for ct in ("float", "double"):
                ps = ", ".join(re.sub(r"\bT\b", ct, p) for p in params)
                wrappers.append(
                    f'extern "C" void L_{name}_{ct}(unsigned gx, unsigned gy, unsigned bx, '
                    f"unsigned by, {ps}) {{ emu_launch(ns_{f.stem}::{name}<{ct}>, "
                    f"dim3{{gx, gy, 1}}, dim3{{bx, by, 1}}, {args}); }}")
        # kernels with their template arguments on the KERNELS line (flash_attention.cu)
        for m in _SIG_NT.finditer(src):
            name, params = m.group(1), [p.strip() for p in m.group(2).split(",")]
            args = ", ".join(re.findall(r"\w+", p)[-1] for p in params)
            ps = ", ".join(params)
            for expr in cb.kernel_names(f):
                if not expr.startswith(name + "<"):
                    continue
                tag = re.sub(r"\W", "_", expr)
                wrappers.append(
                    f'extern "C" void L_{tag}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                    f"unsigned by, unsigned smem, {ps}) {{ g_dyn_smem.assign(smem / 4, -1e30f); "
                    f"emu_launch(ns_{f.stem}::{expr}, dim3{{gx, gy, gz}}, dim3{{bx, by, 1}}, "
                    f"{args}); }}")
    return "\n".join(parts + wrappers) + "\n"


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/clang++) to build the CPU emulation of the kernels")
    d = tmp_path_factory.mktemp("cudaemu")
    (d / "emu.h").write_text(EMU_HEADER)
    (d / "kern.cpp").write_text(_translation_unit())
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-pthread",
                        "-o", str(d / "libkern.so"), str(d / "kern.cpp")],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        if "barrier" in r.stderr and "No such file" in r.stderr:
            pytest.skip(f"{cxx} lacks C++20 <barrier>")
        pytest.fail(f"the kernels did not compile as emulated C++:\n{r.stderr[:4000]}")
    return ctypes.CDLL(str(d / "libkern.so"))


def _arg(a):
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.ctypes.data)
    for t, c in ((np.int32, ctypes.c_int), (np.int64, ctypes.c_longlong),
                 (np.float32, ctypes.c_float), (np.float64, ctypes.c_double)):
        if isinstance(a, t):
            return c(a.item())
    raise TypeError(f"unexpected kernel argument {type(a)}")


class _NumpyAsCupy(types.ModuleType):
    """``cupy`` as seen by cupy_backend, backed by NumPy."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture
def be(emu_lib, monkeypatch):
    fake = _NumpyAsCupy("cupy_on_numpy")
    fake.asnumpy = np.asarray
    fake.cuda = types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0),
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None))

    def get_kernel(file, kernel, dtype):
        fn = getattr(emu_lib, f"L_{kernel}_{cb.CTYPES[np.dtype(dtype)]}")

        def launch(grid, block, args):
            g = tuple(grid) + (1,) * (2 - len(grid))
            b = tuple(block) + (1,) * (2 - len(block))
            fn(*(ctypes.c_uint(x) for x in g + b), *(_arg(a) for a in args))
        return launch

    def launch_expr(file, expr, grid, block, args, shared_mem=0):
        fn = getattr(emu_lib, "L_" + re.sub(r"\W", "_", expr))
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (2 - len(block))
        fn(*(ctypes.c_uint(x) for x in g + b), ctypes.c_uint(shared_mem),
           *(_arg(a) for a in args))

    monkeypatch.setattr(cbk.cp, "module", fake)  # the cupy module of every backend file
    monkeypatch.setattr(cb, "get_kernel", get_kernel)
    monkeypatch.setattr(cb, "launch_expr", launch_expr)
    backend = object.__new__(cbk.CupyBackend)
    backend.xp, backend.device, backend._dummy_start = np, "cpu-emulation", {}
    backend._start_cache = None
    backend.flash = False  # the SIMT kernels of attention.cu; test_flash_attention sets True
    return backend


def close(got, ref, tol, floor=1e-2):
    err = max_rel_err(got, ref, floor)
    assert err <= tol, err


TOL = {np.float32: 1e-5, np.float64: 1e-12}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pointwise_and_row_kernels(be, dtype):
    rng = np.random.default_rng(0)
    tol = TOL[dtype]
    x = rng.standard_normal((300, 37)).astype(dtype)  # several dg partial rows, D not 32k
    g = rng.standard_normal(37).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    (y, c), (yr, cr) = be.rmsnorm_forward(x, g, 1e-5), ops.rmsnorm_forward(x, g, 1e-5)
    close(y, yr, tol)
    for a, r in zip(be.rmsnorm_backward(dy, c), ops.rmsnorm_backward(dy, cr)):
        close(a, r, tol * 10)

    cos, sin = ops.rope_tables(6, 16, 10000.0, dtype)
    pos = np.array([[3, 4, 5], [0, 1, 2]])
    for cs, sn in ((cos[2:5], sin[2:5]), (cos[pos], sin[pos])):
        xr = rng.standard_normal((2, 3, 5, 6)).astype(dtype)
        (y, c), (yr, cr) = be.rope_forward(xr, cs, sn), ops.rope_forward(xr, cs, sn)
        close(y, yr, tol)
        d = rng.standard_normal(y.shape).astype(dtype)
        close(be.rope_backward(d, c), ops.rope_backward(d, cr), tol)

    a = (4 * rng.standard_normal((3, 41))).astype(dtype)
    b = rng.standard_normal((3, 41)).astype(dtype)
    (h, c), (hr, cr) = be.swiglu_forward(a, b), ops.swiglu_forward(a, b)
    close(h, hr, tol)
    d = rng.standard_normal(h.shape).astype(dtype)
    for u, r in zip(be.swiglu_backward(d, c), ops.swiglu_backward(d, cr)):
        close(u, r, tol)

    z = (3 * rng.standard_normal((9, 77))).astype(dtype)
    t = rng.integers(0, 77, 9)
    t[[2, 5]] = -1
    (L, c), (Lr, cr) = be.cross_entropy_forward(z, t, -1), ops.cross_entropy_forward(z, t, -1)
    close(L, Lr, tol)
    close(be.cross_entropy_backward(0.7, c), ops.cross_entropy_backward(0.7, cr), tol)

    W = rng.standard_normal((11, 13)).astype(dtype)
    tok = rng.integers(0, 4, (3, 7))  # many repeats: the scatter-add must accumulate
    (h, c), (hr, cr) = be.embedding_forward(W, tok), ops.embedding_forward(W, tok)
    close(h, hr, 0)
    d = rng.standard_normal(h.shape).astype(dtype)
    close(be.embedding_backward(d, c), ops.embedding_backward(d, cr), tol)


def test_adamw_matches_optim(be):
    from minillama.train.optim import AdamW

    rng = np.random.default_rng(1)
    p = rng.standard_normal((5, 7))
    ref = {"w": p.copy()}
    opt = AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for step in range(1, 4):
        g = rng.standard_normal(p.shape)
        opt.step({"w": g})
        be.adamw_update(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
    close(p, ref["w"], 1e-12)


# (B, T, H, KVH, hd, extra cached positions, per-sequence starts)
ATTN_CASES = [
    (2, 5, 4, 2, 8, 0, None),        # GQA
    (1, 37, 2, 2, 40, 0, None),      # MHA, rows not a multiple of the tile
    (1, 9, 2, 1, 128, 0, None),      # MQA, largest head dim
    (3, 1, 8, 2, 32, 6, [3, 0, 6]),  # decode kernel, per-sequence positions
    (2, 4, 4, 4, 24, 5, [1, 5]),     # prefill after a cache, per-sequence positions
    (2, 3, 12, 1, 8, 4, None),       # MQA with G = 12: one query tile spans 2 positions
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention(be, case, dtype):
    B, T, H, KVH, hd, extra, starts = case
    rng = np.random.default_rng(2)
    S = T + extra
    q = rng.standard_normal((B, T, H, hd)).astype(dtype)
    k = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    v = rng.standard_normal((B, S, KVH, hd)).astype(dtype)
    do = rng.standard_normal((B, T, H, hd)).astype(dtype)
    sp = np.array(starts) if starts is not None else extra
    (o, c), (o_ref, c_ref) = be.attention_forward(q, k, v, sp), ops.attention_forward(q, k, v, sp)
    close(o, o_ref, TOL[dtype] * 10)
    for a, r in zip(be.attention_backward(do, c), ops.attention_backward(do, c_ref)):
        close(a, r, TOL[dtype] * 10)


def test_decode_reads_a_strided_cache_view(be):
    """T = 1 against (B, :end) views of a longer cache, with more heads per group than one
    decode block takes (GMAX)."""
    rng = np.random.default_rng(3)
    kc = rng.standard_normal((2, 12, 2, 16)).astype(np.float32)
    vc = rng.standard_normal((2, 12, 2, 16)).astype(np.float32)
    q = rng.standard_normal((2, 1, 24, 16)).astype(np.float32)  # G = 12: two decode blocks
    sp = np.array([4, 7])
    o, _ = be.attention_forward(q, kc[:, :8], vc[:, :8], sp)
    close(o, ops.attention_forward(q, kc[:, :8], vc[:, :8], sp)[0], 1e-5)


def test_whole_model_matches_numpy(be):
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=48,
                      max_seq_len=32)
    ref = Transformer(cfg, backend="numpy", seed=3)
    emu = Transformer(cfg, params={k: v.copy() for k, v in ref.params.items()}, backend=be)
    rng = np.random.default_rng(0)
    tok, tgt = rng.integers(0, 50, (2, 9)), rng.integers(0, 50, (2, 9))
    tgt[0, :2] = -1
    (l1, g1), (l2, g2) = ref.loss_and_grads(tok, tgt), emu.loss_and_grads(tok, tgt)
    assert abs(l1 - l2) <= 1e-5 * abs(l1)
    for name in g1:
        close(g2[name], g1[name], 1e-4)
    cache = emu.new_cache(2)
    steps = [emu.forward(tok[:, :5], 0, cache)] + [emu.forward(tok[:, t:t + 1], t, cache)
                                                   for t in range(5, 9)]
    close(np.concatenate(steps, axis=1), ref.forward(tok), 1e-5)


def test_device_sampling_matches_host_sampling(be):
    from minillama.core.sampling import sample

    rng = np.random.default_rng(4)
    for trial in range(60):
        V = int(rng.integers(2, 60))
        z = rng.standard_normal(V) * 3
        t = [0.0, 0.5, 1.0, 1.7][trial % 4]
        k = [None, 1, 3, 100][(trial // 4) % 4]
        p = [None, 0.3, 0.9, 1.0][(trial // 16) % 4]
        got = be.sample_tokens(z[None], t, k, p, np.random.default_rng(trial))
        assert int(got[0]) == sample(z, np.random.default_rng(trial), t, k, p)
    # a batch with one uniform per row (each sequence's own generator) = row by row on the host
    Z = rng.standard_normal((5, 40)) * 2
    gens = [np.random.default_rng(100 + b) for b in range(5)]
    u = np.array([np.random.default_rng(100 + b).random() for b in range(5)])
    got = be.sample_tokens(Z, 0.8, 10, 0.9, uniforms=u)
    assert got.tolist() == [sample(Z[b], gens[b], 0.8, 10, 0.9) for b in range(5)]


# (B, T, H, KVH, hd, extra cached positions, per-sequence starts): the tensor-core kernels of
# flash_attention.cu with an emulated mma.sync (fragment layouts, tiling, masking, online softmax)
FLASH_CASES = [
    (1, 70, 2, 1, 64, 0, None),      # GQA G = 2: 140 rows over 3 query tiles, keys over 3 tiles
    (2, 9, 3, 3, 64, 4, [4, 0]),     # MHA after a cache, per-sequence positions
    (1, 20, 4, 1, 128, 0, None),     # MQA, head dim 128, a query tile spanning 4 heads
    (1, 40, 8, 1, 64, 0, None),      # MQA, 320 rows: dk/dv split into 2 row shares, then summed
]


@pytest.mark.parametrize("case,precision", [(c, "fp32") for c in FLASH_CASES]
                         + [(FLASH_CASES[1], "tf32")], ids=str)
def test_flash_attention(be, case, precision):
    B, T, H, KVH, hd, extra, starts = case
    be.flash, be.attention_precision = True, precision
    assert be._flash_expr(np.float32, hd, T) is not None
    rng = np.random.default_rng(5)
    S = T + extra
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k = rng.standard_normal((B, S, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((B, S, KVH, hd)).astype(np.float32)
    do = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    sp = np.array(starts) if starts is not None else extra
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
    (o, c), (o_ref, c_ref) = be.attention_forward(q, k, v, sp), \
        ops.attention_forward(q64, k64, v64, sp)
    # 3xTF32 keeps float32 accuracy; one TF32 product is about 1e-3 relative
    tol = 2e-5 if precision == "fp32" else 5e-3
    close(o, o_ref, tol)
    for a, r in zip(be.attention_backward(do, c), ops.attention_backward(do64, c_ref)):
        close(a, r, tol * 5)


def _colmajor_gemm(plan, A, B, C, dtype_code, compute):
    """cublasGemmEx in NumPy: A, B, C are flat buffers read as column-major matrices with the
    plan's leading dimensions; C = op(A) op(B) (bf16 operands as their bit patterns)."""
    from minillama.backends.cupy import mixed_precision as mp

    def mat(buf, rows, cols, ld):
        v = buf.reshape(-1)
        if v.dtype == np.uint16:
            v = mp.bf16_to_f32(v)
        return v[:ld * cols].reshape(cols, ld)[:, :rows].T.astype(np.float64)

    m, n, k = plan["m"], plan["n"], plan["k"]
    ta, tb = plan["transa"] == mp.CUBLAS_OP_T, plan["transb"] == mp.CUBLAS_OP_T
    a = mat(A, *((k, m) if ta else (m, k)), plan["lda"])
    b = mat(B, *((n, k) if tb else (k, n)), plan["ldb"])
    c = (a.T if ta else a) @ (b.T if tb else b)  # (m, n) column-major = C^T row-major
    assert compute == (mp.CUBLAS_COMPUTE_32F if dtype_code == mp.CUDA_R_16BF
                       else mp.CUBLAS_COMPUTE_32F_FAST_TF32)
    if dtype_code == mp.CUDA_R_32F:  # TF32: the operands as cvt.rna.tf32 rounds them
        c = (mp.round_tf32(a.astype(np.float32)).astype(np.float64).T if ta
             else mp.round_tf32(a.astype(np.float32)).astype(np.float64)) @ \
            (mp.round_tf32(b.astype(np.float32)).astype(np.float64).T if tb
             else mp.round_tf32(b.astype(np.float32)).astype(np.float64))
    C.reshape(-1)[:] = c.T.reshape(-1).astype(np.float32)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_mixed_precision_cupy_path(be, monkeypatch, precision):
    """MixedPrecisionBackend's CuPy path (the to_bf16 kernel under emulation, the cuBLAS call
    plans of gemm_plan run by a column-major NumPy GEMM) gives the NumPy emulation's products:
    the kernel's bf16 bits equal mixed_precision.bf16_bits bit for bit (ties, NaN, infinities,
    overflow, denormals), and y, dx, dW agree to float32 rounding."""
    from minillama.backends.cupy import mixed_precision as mp

    monkeypatch.setattr(mp, "_cublas_gemm", _colmajor_gemm)
    be.name = "cupy"
    fast = mp.MixedPrecisionBackend(be, precision)
    emu = mp.MixedPrecisionBackend(be, precision, emulate=True)
    assert not fast.emulate and fast.attention_precision == "tf32"
    rng = np.random.default_rng(3)
    special = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001, 0x7F800000, 0xFF800000,
                        0x7FC00001, 0x80000000], np.uint32).view(np.float32)
    if precision == "bf16":
        x = np.concatenate([special, rng.standard_normal(1000).astype(np.float32)])
        bits = fast._operand(x.reshape(1, -1)).reshape(-1)
        np.testing.assert_array_equal(bits, mp.bf16_bits(x))
    for M, N, K in ((7, 5, 12), (1, 9, 4), (33, 17, 40)):
        x = rng.standard_normal((M, K)).astype(np.float32).reshape(1, M, K)
        w = rng.standard_normal((N, K)).astype(np.float32)
        dy = rng.standard_normal((1, M, N)).astype(np.float32)
        y, c = fast.linear_forward(x, w)
        ye, ce = emu.linear_forward(x, w)
        close(y, ye, 1e-6)
        for got, ref in zip(fast.linear_backward(dy, c), emu.linear_backward(dy, ce)):
            assert got.shape == ref.shape and got.dtype == np.float32
            close(got, ref, 1e-6)


def test_mixed_precision_whole_model(be, monkeypatch):
    """A bf16 training step of a whole model through the CuPy path (emulated kernels, the cuBLAS
    calls replayed in NumPy) gives the loss and gradients of the NumPy bf16 emulation."""
    from minillama.backends import get_backend
    from minillama.backends.cupy import mixed_precision as mp
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    monkeypatch.setattr(mp, "_cublas_gemm", _colmajor_gemm)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=48,
                      max_seq_len=32)
    ref = Transformer(cfg, backend=mp.MixedPrecisionBackend(get_backend("numpy"), "bf16",
                                                            emulate=True), seed=3)
    gpu = Transformer(cfg, params={k: v.copy() for k, v in ref.params.items()},
                      backend=mp.MixedPrecisionBackend(be, "bf16"))
    rng = np.random.default_rng(0)
    tok, tgt = rng.integers(0, 50, (2, 9)), rng.integers(0, 50, (2, 9))
    (l1, g1), (l2, g2) = ref.loss_and_grads(tok, tgt), gpu.loss_and_grads(tok, tgt)
    assert abs(l1 - l2) <= 1e-5 * abs(l1)
    for name in g1:
        close(g2[name], g1[name], 1e-4)
    fp32 = Transformer(cfg, params={k: v.copy() for k, v in ref.params.items()}, backend="numpy")
    assert abs(fp32.loss(tok, tgt) - l1) > 0  # bf16 really differs from float32


def _random_blocks(qtype, N, K, rng):
    """A QuantMatrix of random bytes whose fp16 fields are finite, modest scales."""
    from minillama.core.quant import QUANT_TYPES, QuantMatrix

    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    data = rng.integers(0, 256, size=(N, K // per, size), dtype=np.uint8)
    for at in QUANT_TYPES[qtype].scale_fields:  # Q8_0: d; Q4_K: d, dmin; Q6_K: d at 208
        d = (rng.uniform(0.002, 0.05, size=(N, K // per)) * rng.choice([-1, 1], (N, K // per)))
        data[:, :, at:at + 2] = d.astype("<f2").view(np.uint8).reshape(N, K // per, 2)
    return QuantMatrix(qtype, (N, K), data.reshape(N, -1))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quant_kernels_match_gguf(be, qtype, dtype):
    """quant.cu against the gguf package's dequantization: the matvec kernel (few rows of x), the
    dequantize-then-GEMM path (many rows) and dx = dy W of a frozen quantized weight."""
    gquants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(3)
    # N not a multiple of the warps per block; Q8_0 also with 5 blocks a row (4 per warp pass)
    for N, K in ((9, 512),) + (((5, 160),) if qtype == "Q8_0" else ()):
        _check_quant_kernels(be, qtype, dtype, N, K, rng, gquants.dequantize,
                             GGMLQuantizationType[qtype])


def _check_quant_kernels(be, qtype, dtype, N, K, rng, dequantize, gtype):
    w = _random_blocks(qtype, N, K, rng)
    W = dequantize(w.data, gtype).reshape(N, K).astype(np.float64)
    for rows in (1, 3, 11):  # 11 > QUANT_MATVEC_ROWS: the GEMM path
        x = rng.standard_normal((rows, K)).astype(dtype)
        y, ctx = be.linear_forward(x, w)
        close(y, x.astype(np.float64) @ W.T, TOL[dtype] * 10)
        dy = rng.standard_normal((rows, N)).astype(dtype)
        dx, dw = be.linear_backward(dy, ctx)
        assert dw is None
        close(dx, dy.astype(np.float64) @ W, TOL[dtype] * 10)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_quantized_embedding_gathers_rows_of_blocks_then_dequantizes(be, qtype):
    """A Q8_0 / Q4_K / Q6_K embedding table kept in its blocks on the device: the tokens' rows
    of blocks are gathered, then dequantized by quant.cu, equal to the host's dequantized rows."""
    from minillama.core.quant import dequantize

    w = _random_blocks(qtype, 7, 256, np.random.default_rng(4))
    tok = np.array([[3, 0, 6], [3, 1, 2]])
    out, _ = be.embedding_forward(w, tok)
    assert out.shape == (2, 3, 256) and out.dtype == np.float32
    close(out, dequantize(w)[tok], 1e-6)
