#!/usr/bin/env python
"""Causal attention forward + backward on one GPU: minillama's CuPy kernels against PyTorch SDPA.

For each shape it first checks the result (‖x − ref‖ / ‖ref‖ for o, dq, dk, dv, the reference
being PyTorch's float64 attention on the same inputs), then times forward + backward (CUDA events,
median of --reps after warm-up) of:

* minillama ``fp32``: flash_attention.cu with 3xTF32 operands (about float32 accuracy, the default);
* minillama ``tf32``: the same kernels with one TF32 product (MINILLAMA_CUDA_ATTENTION=tf32);
* minillama ``simt``: the float32 SIMT kernels of attention.cu (the previous path), where cheap;
* PyTorch ``F.scaled_dot_product_attention(is_causal=True)`` on float32 (TF32 off and on) and bf16.

Prints a markdown table last; the ratio columns are PyTorch time / minillama time (> 1: minillama
is faster).

    python scripts/bench_attention_gpu.py            # the default shape list
    python scripts/bench_attention_gpu.py --quick    # two small shapes
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import _bench_common

import numpy as np

sys.path.insert(0, _bench_common.REPO)
from minillama.errors import MinillamaError  # noqa: E402

#: (B, T, H, KVH, hd)
SHAPES = [
    (32, 256, 12, 12, 64), (8, 1024, 12, 12, 64), (2, 4096, 12, 12, 64), (1, 8192, 12, 12, 64),
    (8, 1024, 12, 4, 64), (8, 1024, 12, 1, 64),
    (16, 512, 8, 8, 128), (4, 2048, 16, 16, 128), (4, 2048, 16, 4, 128), (4, 2048, 16, 1, 128),
    (1, 8192, 16, 4, 128),
]
QUICK = [(2, 256, 4, 2, 64), (1, 512, 4, 1, 128)]


def rel(got, ref) -> float:
    g = got.double()
    return float((g - ref).norm() / ref.norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-simt", action="store_true", help="skip the old SIMT kernels")
    args = ap.parse_args(argv)
    try:
        import cupy as cp
        import torch
        import torch.nn.functional as F
        from minillama.backends import get_backend
        be = get_backend("cupy")
    except (ImportError, MinillamaError) as e:
        print(f"bench_attention_gpu: needs CuPy, PyTorch and a CUDA GPU ({e})")
        return 2
    if not be.flash:
        print("bench_attention_gpu: the flash kernels need compute capability 8.0 or newer")
        return 2
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, {datetime.date.today()}, CuPy {cp.__version__}, torch {torch.__version__}, "
          f"CUDA {cp.cuda.runtime.runtimeGetVersion()}, {platform.python_version()}")
    print("# command: python scripts/bench_attention_gpu.py " + " ".join(argv or sys.argv[1:]))

    def t_cupy(fn):
        for _ in range(2):
            fn()
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(args.reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(times))

    def t_torch(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        return float(np.median(times))

    rows = []
    for (B, T, H, KVH, hd) in (QUICK if args.quick else SHAPES):
        rng = np.random.default_rng(B * T + H + hd)
        q = cp.asarray(rng.standard_normal((B, T, H, hd), dtype=np.float32))
        k = cp.asarray(rng.standard_normal((B, T, KVH, hd), dtype=np.float32))
        v = cp.asarray(rng.standard_normal((B, T, KVH, hd), dtype=np.float32))
        do = cp.asarray(rng.standard_normal((B, T, H, hd), dtype=np.float32))
        tq, tk, tv, tdo = (torch.from_dlpack(a) for a in (q, k, v, do))
        # float64 reference (PyTorch autograd on the GPU), (B, H, T, hd) layout
        ref = {}
        if B * H * T * T <= 2 ** 31:
            q64, k64, v64 = (x.double().transpose(1, 2).contiguous().requires_grad_()
                             for x in (tq, tk, tv))
            o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True,
                                                 enable_gqa=KVH != H)
            o64.backward(tdo.double().transpose(1, 2))
            ref = dict(o=o64.detach().transpose(1, 2), dq=q64.grad.transpose(1, 2),
                       dk=k64.grad.transpose(1, 2), dv=v64.grad.transpose(1, 2))
            del q64, k64, v64, o64
        row = dict(shape=f"B{B} T{T} H{H} KVH{KVH} hd{hd}")
        for mode in ("fp32", "tf32", "simt"):
            if mode == "simt" and (args.no_simt or T > 2048):
                continue
            be.flash = mode != "simt"
            be.attention_precision = "tf32" if mode == "tf32" else "fp32"

            def fwd_bwd():
                o, c = be.attention_forward(q, k, v, 0)
                return (o, *be.attention_backward(do, c))

            if ref:
                got = fwd_bwd()
                errs = [rel(torch.from_dlpack(x), ref[n]) for x, n in zip(got, ("o", "dq", "dk", "dv"))]
                row[f"err_{mode}"] = max(errs)
                bad = not all(np.isfinite(errs))
                print(f"  {row['shape']} {mode}: rel err o {errs[0]:.2e} dq {errs[1]:.2e} "
                      f"dk {errs[2]:.2e} dv {errs[3]:.2e}" + ("  NON-FINITE" if bad else ""))
            row[mode] = t_cupy(fwd_bwd)
        be.flash, be.attention_precision = True, "fp32"

        def sdpa(dtype, tf32):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            qq, kk, vv = (x.to(dtype).transpose(1, 2).detach().requires_grad_() for x in (tq, tk, tv))
            dd = tdo.to(dtype).transpose(1, 2)

            def fn():
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                   enable_gqa=KVH != H)
                o.backward(dd)
            return t_torch(fn)

        row["sdpa_fp32"] = sdpa(torch.float32, False)
        row["sdpa_tf32"] = sdpa(torch.float32, True)
        row["sdpa_bf16"] = sdpa(torch.bfloat16, False)
        torch.backends.cuda.matmul.allow_tf32 = False
        rows.append(row)
        print(f"  {row}", flush=True)

    print("\n| shape | ours fp32 (3xTF32) ms | SDPA fp32 ms | ratio | ours tf32 ms | SDPA tf32 ms | "
          "ratio | SDPA bf16 ms | old SIMT ms | max rel err fp32 / tf32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        simt = f"{r['simt']:.2f}" if "simt" in r else "-"
        err = (f"{r['err_fp32']:.1e} / {r['err_tf32']:.1e}" if "err_fp32" in r else "-")
        print(f"| {r['shape']} | {r['fp32']:.2f} | {r['sdpa_fp32']:.2f} | "
              f"{r['sdpa_fp32'] / r['fp32']:.2f}x | {r['tf32']:.2f} | {r['sdpa_tf32']:.2f} | "
              f"{r['sdpa_tf32'] / r['tf32']:.2f}x | {r['sdpa_bf16']:.2f} | {simt} | {err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
