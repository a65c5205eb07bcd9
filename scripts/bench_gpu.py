#!/usr/bin/env python
"""GPU benchmark: minillama on the CuPy backend against PyTorch CUDA eager, same GPU, same weights.

Prints two markdown tables with the peer side by side (ratio > 1: minillama is faster):

* training step tokens/s (forward + backward + AdamW update) for the s15 and s110 shapes;
* KV-cached greedy decode tokens/s at batch 1 and batch 8 (prefill not counted): minillama eager
  and with the whole step captured as one CUDA graph (``minillama.backends.cupy.graph``), against
  PyTorch eager and PyTorch with a static KV cache and one CUDA graph per step;
* next to the float32 training step, PyTorch's ``torch.autocast`` bf16 step (the mixed-precision
  peer);
* with ``--precisions`` (default fp32,tf32,bf16): the training step of ``minillama train
  --precision P`` (backends/cupy/mixed_precision.py) against its PyTorch peer at the same precision:
  fp32 against eager with TF32 off, tf32 against eager with ``allow_tf32`` on (matmuls and
  cuDNN), bf16 against ``torch.autocast(bfloat16)``; the first loss is compared with the fp32 one;
* with ``--attention`` (instead of the above): causal attention forward + backward, minillama's
  CUDA kernels against PyTorch SDPA, over a sweep of shapes (below).

Both sides run float32 without TF32 (CuPy's cuBLAS default; ``torch.backends.cuda.matmul
.allow_tf32 = False``). The PyTorch peer is a plain eager LLaMA (``F.scaled_dot_product_attention``
for attention, ``torch.optim.AdamW``: ``TorchLlama`` of tests/support/torch_llama.py); it starts
from the same weights, and the script checks that the first loss and the greedy tokens agree before
timing.

    python -m scripts.bench_gpu                       # s15 and s110, decode at batch 1 and 8
    python -m scripts.bench_gpu --shapes s15 --steps 3 --decode-tokens 64
    python -m scripts.bench_gpu --attention --reps 5 --no-simt   # the attention sweep
    python -m scripts.bench_gpu --attention --quick              # two small shapes

The attention sweep first checks each result (‖x − ref‖ / ‖ref‖ for o, dq, dk, dv, the reference
being PyTorch's float64 attention on the same inputs), then times forward + backward (CUDA events,
median of ``--reps`` after warm-up) of minillama ``fp32`` (flash_attention.cu with 3xTF32
operands, about float32 accuracy, the default), ``tf32`` (one TF32 product,
MINILLAMA_CUDA_ATTENTION=tf32) and ``simt`` (the float32 SIMT kernels of attention.cu, where
cheap), against ``F.scaled_dot_product_attention(is_causal=True)`` on float32 (TF32 off and on)
and bf16; its ratio columns are PyTorch time / minillama time.

Without a CUDA GPU (or without CuPy) it prints one line saying so and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.model.transformer import Transformer, init_params
from scripts._measure import median, model_shape

#: name -> (config, training batch B, training length T)
SHAPES = {"s15": (model_shape("s15"), 16, 256),
          "s110": (model_shape("s110"), 8, 1024)}
ADAM = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="s15,s110", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per sequence")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch CUDA peer")
    ap.add_argument("--no-train", action="store_true", help="skip the training-step table")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode table")
    ap.add_argument("--precisions", default="fp32,tf32,bf16",
                    help="training precisions of the mixed-precision table (empty: skip it)")
    ap.add_argument("--attention", action="store_true",
                    help="only the attention sweep: our kernels against PyTorch SDPA")
    ap.add_argument("--quick", action="store_true", help="--attention on two small shapes")
    ap.add_argument("--reps", type=int, default=10, help="--attention: timed repetitions (median)")
    ap.add_argument("--no-simt", action="store_true", help="--attention: skip the old SIMT kernels")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# minillama on CuPy
# ------------------------------------------------------------------------------------------------
def ml_train_step(model, opt_state, tok, tgt):
    """One step: loss_and_grads, then the fused AdamW kernel on every parameter."""
    from minillama.backends.cupy.backend import adamw_update

    loss, grads = model.loss_and_grads(tok, tgt)
    opt_state["t"] += 1
    for name, p in model.params.items():
        m, v = opt_state["m"][name], opt_state["v"][name]
        wd = 0.0 if name.endswith("norm.weight") else ADAM["wd"]
        adamw_update(p, grads[name], m, v, ADAM["lr"], ADAM["beta1"], ADAM["beta2"], ADAM["eps"],
                     wd, opt_state["t"])
    return loss


def ml_decode(model, prompt: np.ndarray, n_new: int):
    """Greedy decode with the KV cache; returns (token ids (B, n_new), seconds for the decode
    loop after the prefill). Only the sampled ids cross to the host."""
    be = model.backend
    B, P = prompt.shape
    cache = model.new_cache(B, P + n_new)
    logits = model.forward(prompt, 0, cache, last_only=True)
    nxt = be.sample_tokens(logits, 0.0)
    out = [nxt]
    be.synchronize()
    t0 = time.perf_counter()
    for i in range(n_new - 1):
        logits = model.forward(nxt[:, None], P + i, cache, last_only=True)
        nxt = be.sample_tokens(logits, 0.0)
        out.append(nxt)
    be.synchronize()
    return np.stack(out, axis=1), time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
def bench_train(name, args, torch_ok):
    cfg_d, B, T = SHAPES[name]
    cfg = ModelConfig(**cfg_d)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, (B, T))
    tgt = rng.integers(0, cfg.vocab_size, (B, T))

    ml_s, first_loss = _time_ml(cfg, params, tok, tgt, args, "fp32")
    torch_s, bf16_s, check = None, None, "n/a"
    if torch_ok:
        torch_s, peer_first = _time_torch(cfg, params, tok, tgt, args, "fp32")
        rel = abs(peer_first - first_loss) / abs(peer_first)
        check = (f"first loss {first_loss:.5f} vs {peer_first:.5f} "
                 f"({'ok' if rel < 1e-4 else 'DIFFERS'})")
        bf16_s, _ = _time_torch(cfg, params, tok, tgt, args, "bf16")  # bf16 matmuls, fp32 weights
    return dict(shape=name, B=B, T=T, ml=B * T / ml_s, ml_ms=1e3 * ml_s,
                torch=None if torch_s is None else B * T / torch_s,
                torch_ms=None if torch_s is None else 1e3 * torch_s,
                bf16_ms=None if bf16_s is None else 1e3 * bf16_s, check=check)


def _time_ml(cfg, params, tok, tgt, args, precision: str):
    """(median seconds per step, first loss) of minillama's training step in ``precision``."""
    import cupy as cp

    from minillama.backends import get_backend
    from minillama.backends.cupy.mixed_precision import with_precision

    be = with_precision(get_backend("cupy"), precision)
    model = Transformer(cfg, params, backend=be, dtype=np.float32)
    state = {"t": 0, "m": {k: cp.zeros_like(v) for k, v in model.params.items()},
             "v": {k: cp.zeros_like(v) for k, v in model.params.items()}}
    first = ml_train_step(model, state, tok, tgt)
    for _ in range(max(args.warmup - 1, 0)):
        ml_train_step(model, state, tok, tgt)
    times = []
    for _ in range(args.steps):
        be.synchronize()
        t0 = time.perf_counter()
        ml_train_step(model, state, tok, tgt)
        be.synchronize()
        times.append(time.perf_counter() - t0)
    del model, state
    cp.get_default_memory_pool().free_all_blocks()
    return median(times), first


def _time_torch(cfg, params, tok, tgt, args, precision: str):
    """(median seconds per step, first loss) of the PyTorch peer at ``precision``."""
    import torch

    from tests.support.torch_llama import TorchLlama

    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        peer = TorchLlama(cfg, params, "cuda")
        opt = peer.make_optimizer(**ADAM)
        tt, tg = torch.tensor(tok, device="cuda"), torch.tensor(tgt, device="cuda")
        auto = precision == "bf16"
        first = peer.train_step(opt, tt, tg, autocast=auto).item()
        for _ in range(max(args.warmup - 1, 0)):
            peer.train_step(opt, tt, tg, autocast=auto)
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            peer.train_step(opt, tt, tg, autocast=auto).item()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        del peer, opt
        torch.cuda.empty_cache()
        return median(times), first
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


TORCH_PEER = {"fp32": "eager fp32", "tf32": "eager TF32", "bf16": "autocast bf16"}


def bench_precisions(name, precisions, args, torch_ok):
    """Rows of the mixed-precision table for one shape."""
    cfg_d, B, T = SHAPES[name]
    cfg = ModelConfig(**cfg_d)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, (B, T))
    tgt = rng.integers(0, cfg.vocab_size, (B, T))
    rows, first32 = [], None
    for prec in precisions:
        ml_s, first = _time_ml(cfg, params, tok, tgt, args, prec)
        if prec == "fp32":
            first32 = first
        t_s, t_first = _time_torch(cfg, params, tok, tgt, args, prec) if torch_ok else (None, None)
        rows.append(dict(shape=name, B=B, T=T, prec=prec, ml_ms=1e3 * ml_s, tok_s=B * T / ml_s,
                         peer=TORCH_PEER[prec], peer_ms=None if t_s is None else 1e3 * t_s,
                         ratio=None if t_s is None else t_s / ml_s, first=first,
                         rel=None if first32 is None else abs(first - first32) / abs(first32),
                         t_first=t_first))
    return rows


def bench_decode(name, batch, args, torch_ok):
    cfg_d, _, _ = SHAPES[name]
    cfg = ModelConfig(**cfg_d)
    params = init_params(cfg, seed=0)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, args.prompt))
    n = min(args.decode_tokens, cfg.max_seq_len - args.prompt)
    model = Transformer(cfg, params, backend="cupy", dtype=np.float32)
    ml_decode(model, prompt, min(8, n))  # warm-up: compiles the decode kernels
    ml_ids, ml_s = ml_decode(model, prompt, n)
    from minillama.backends.cupy.graph import GraphDecoder

    GraphDecoder(model, batch, args.prompt + n).generate(prompt, min(8, n))  # warm-up
    dec = GraphDecoder(model, batch, args.prompt + n)
    dec.prefill(prompt)
    model.backend.synchronize()
    t0 = time.perf_counter()
    g_ids = dec.decode(n)
    g_s = time.perf_counter() - t0
    dec2 = GraphDecoder(model, batch, args.prompt + n)  # captured already: replays only
    dec2.prefill(prompt)
    dec2._capture()
    dec2.prefill(prompt)
    model.backend.synchronize()
    t0 = time.perf_counter()
    g_ids2 = dec2.decode(n)
    g_s = min(g_s, time.perf_counter() - t0)
    del model, dec, dec2
    check = f"graph ids = eager: {100 * float(np.mean(g_ids == ml_ids)):.0f}%"
    if not np.array_equal(g_ids, g_ids2):
        check += " (graph runs DIFFER)"
    torch_s, tg_s = None, None
    if torch_ok:
        from tests.support.torch_llama import TorchLlama

        peer = TorchLlama(cfg, params, "cuda")
        peer.decode(prompt, min(8, n))
        t_ids, torch_s = peer.decode(prompt, n)
        peer.graph_decode(prompt, min(8, n))
        tg_ids, tg_s = peer.graph_decode(prompt, n)
        check += (f"; torch eager ids = ours: {100 * float(np.mean(t_ids == ml_ids)):.0f}%, "
                  f"torch graph = ours: {100 * float(np.mean(tg_ids == ml_ids)):.0f}%")
        del peer
    toks = batch * (n - 1)
    return dict(shape=name, B=batch, n=n, ml=toks / ml_s, ml_graph=toks / g_s,
                torch=None if torch_s is None else toks / torch_s,
                torch_graph=None if tg_s is None else toks / tg_s, check=check)


# ------------------------------------------------------------------------------------------------
# --attention: causal attention forward + backward against PyTorch SDPA
# ------------------------------------------------------------------------------------------------
#: (B, T, H, KVH, hd)
ATTENTION_SHAPES = [
    (32, 256, 12, 12, 64), (8, 1024, 12, 12, 64), (2, 4096, 12, 12, 64), (1, 8192, 12, 12, 64),
    (8, 1024, 12, 4, 64), (8, 1024, 12, 1, 64),
    (16, 512, 8, 8, 128), (4, 2048, 16, 16, 128), (4, 2048, 16, 4, 128), (4, 2048, 16, 1, 128),
    (1, 8192, 16, 4, 128),
]
ATTENTION_QUICK = [(2, 256, 4, 2, 64), (1, 512, 4, 1, 128)]


def rel(got, ref) -> float:
    g = got.double()
    return float((g - ref).norm() / ref.norm())


def bench_attention(args, argv=None) -> int:
    """The attention sweep: check each shape against float64, then time ours and SDPA."""
    try:
        import cupy as cp
        import torch
        import torch.nn.functional as F

        from minillama.backends import get_backend
        be = get_backend("cupy")
    except (ImportError, MinillamaError) as e:
        print(f"bench_gpu: needs CuPy, PyTorch and a CUDA GPU ({e})")
        return 2
    if not be.flash:
        print("bench_gpu: the flash kernels need compute capability 8.0 or newer")
        return 2
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, {datetime.date.today()}, CuPy {cp.__version__}, torch {torch.__version__}, "
          f"CUDA {cp.cuda.runtime.runtimeGetVersion()}, {platform.python_version()}")
    print("# command: python -m scripts.bench_gpu " + " ".join(argv or sys.argv[1:]))

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
    for (B, T, H, KVH, hd) in (ATTENTION_QUICK if args.quick else ATTENTION_SHAPES):
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
                errs = [rel(torch.from_dlpack(x), ref[n])
                        for x, n in zip(got, ("o", "dq", "dk", "dv"))]
                row[f"err_{mode}"] = max(errs)
                bad = not all(np.isfinite(errs))
                print(f"  {row['shape']} {mode}: rel err o {errs[0]:.2e} dq {errs[1]:.2e} "
                      f"dk {errs[2]:.2e} dv {errs[3]:.2e}" + ("  NON-FINITE" if bad else ""))
            row[mode] = t_cupy(fwd_bwd)
        be.flash, be.attention_precision = True, "fp32"

        def sdpa(dtype, tf32):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            qq, kk, vv = (x.to(dtype).transpose(1, 2).detach().requires_grad_()
                          for x in (tq, tk, tv))
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

    print("\n| shape | ours fp32 (3xTF32) ms | SDPA fp32 ms | ratio | "
          "ours tf32 ms | SDPA tf32 ms | "
          "ratio | SDPA bf16 ms | old SIMT ms | max rel err fp32 / tf32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        simt = f"{r['simt']:.2f}" if "simt" in r else "-"
        err = (f"{r['err_fp32']:.1e} / {r['err_tf32']:.1e}" if "err_fp32" in r else "-")
        print(f"| {r['shape']} | {r['fp32']:.2f} | {r['sdpa_fp32']:.2f} | "
              f"{r['sdpa_fp32'] / r['fp32']:.2f}x | {r['tf32']:.2f} | {r['sdpa_tf32']:.2f} | "
              f"{r['sdpa_tf32'] / r['tf32']:.2f}x | {r['sdpa_bf16']:.2f} | {simt} | {err} |")
    return 0



def fmt(x, spec=".0f"):
    return "n/a" if x is None else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.attention:
        return bench_attention(args, argv)
    try:
        from minillama.backends import get_backend

        be = get_backend("cupy")
    except MinillamaError as e:
        print(f"bench_gpu: nothing to time: {e}")
        return 2
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            print(f"bench_gpu: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
            return 2
    torch_ok = False
    torch_ver = "not installed"
    if not args.no_torch:
        try:
            import torch

            torch_ver = torch.__version__
            torch_ok = torch.cuda.is_available()
            if torch_ok:
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            else:
                torch_ver += " (no CUDA)"
        except ImportError:
            pass
    import cupy as cp

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench_gpu: {be.device}, {now}, cupy {cp.__version__}, torch {torch_ver}, "
          f"python {platform.python_version()}")
    print(f"# command: python -m scripts.bench_gpu "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")

    if not args.no_train:
        print("\n## Training step (forward + backward + AdamW), float32, tokens/s\n")
        print("| shape | B x T | minillama cupy | ms/step | PyTorch eager | ms/step | "
              "ratio (torch time / minillama time) | PyTorch autocast bf16 ms/step | "
              "ratio vs bf16 | check |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in shapes:
            r = bench_train(s, args, torch_ok)
            ratio = None if r["torch"] is None else r["ml"] / r["torch"]
            r16 = None if r["bf16_ms"] is None else r["bf16_ms"] / r["ml_ms"]
            print(f"| {s} | {r['B']} x {r['T']} | {fmt(r['ml'])} | {fmt(r['ml_ms'], '.1f')} | "
                  f"{fmt(r['torch'])} | {fmt(r['torch_ms'], '.1f')} | {fmt(ratio, '.2f')} | "
                  f"{fmt(r['bf16_ms'], '.1f')} | {fmt(r16, '.2f')} | {r['check']} |", flush=True)

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not args.no_train and precisions:
        from minillama.backends.cupy.mixed_precision import PRECISIONS

        bad = [p for p in precisions if p not in PRECISIONS]
        if bad:
            print(f"bench_gpu: unknown precision {bad[0]!r}; choose from {', '.join(PRECISIONS)}")
            return 2
        print("\n## Training step by precision (minillama train --precision P vs the PyTorch "
              "peer at that precision)\n")
        print("| shape | B x T | precision | minillama ms/step | tokens/s | PyTorch peer | "
              "peer ms/step | ratio (peer time / ours) | first loss (rel. to our fp32) | "
              "peer first loss |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in shapes:
            for r in bench_precisions(s, precisions, args, torch_ok):
                print(f"| {s} | {r['B']} x {r['T']} | {r['prec']} | {fmt(r['ml_ms'], '.1f')} | "
                      f"{fmt(r['tok_s'])} | {r['peer']} | {fmt(r['peer_ms'], '.1f')} | "
                      f"{fmt(r['ratio'], '.2f')} | {r['first']:.5f} ({fmt(r['rel'], '.1e')}) | "
                      f"{fmt(r['t_first'], '.5f')} |", flush=True)

    if not args.no_decode:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        print(f"\n## Greedy decode with KV cache (prompt {args.prompt}, "
              f"{args.decode_tokens} new tokens), tokens/s\n")
        print("| shape | batch | minillama eager | minillama CUDA graph | PyTorch eager | "
              "PyTorch static cache + CUDA graph | ratio graph/graph | check |")
        print("|---|---|---|---|---|---|---|---|")
        for s in shapes:
            for b in batches:
                r = bench_decode(s, b, args, torch_ok)
                ratio = None if r["torch_graph"] is None else r["ml_graph"] / r["torch_graph"]
                print(f"| {s} | {b} | {fmt(r['ml'])} | {fmt(r['ml_graph'])} | {fmt(r['torch'])} "
                      f"| {fmt(r['torch_graph'])} | {fmt(ratio, '.2f')} | {r['check']} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
