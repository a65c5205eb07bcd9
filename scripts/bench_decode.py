#!/usr/bin/env python
"""Decode and prefill speed of minillama's KV-cache generation, next to the memory roofline and
Hugging Face transformers' ``generate`` on the same weights.

For each shape (random weights, tied classifier as in llama2.c's TinyStories models):

* batch-1 decode tokens/s (greedy, after a 16-token prompt) and its time per token against the
  **roofline** = weight bytes / memory bandwidth (a decode step must stream every weight once;
  the bandwidth is measured in the same run by copying a large array: 2 x size bytes moved);
* prefill tokens/s for a 256-token prompt (one forward call);
* aggregate tokens/s at batch 8;
* per-token decode time against position with the KV cache and without it (recomputing the whole
  prefix every step), plotted to a PNG;
* when transformers + torch are installed, ``LlamaForCausalLM.generate`` (greedy, eager attention,
  its own KV cache) on the same weights: tokens/s and the ratio (> 1: minillama is faster), and
  how many greedy tokens agree. The two decode loops take turns, repetition by repetition, so
  both see the same background load; the best repetition of each counts.

    python scripts/bench_decode.py --backend numpy --threads 2

Thread counts are fixed through OMP/OPENBLAS/MKL_NUM_THREADS before NumPy is imported, and
``torch.set_num_threads`` for the peer.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import _bench_common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", help="minillama backend (default numpy)")
    ap.add_argument("--shapes", default="s15,s110", help="comma list of: s15, s110")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / torch threads (default 2)")
    ap.add_argument("--decode-tokens", type=int, default=48, help="timed decode steps (batch 1)")
    ap.add_argument("--prefill", type=int, default=256, help="prefill prompt length")
    ap.add_argument("--batch", type=int, default=8, help="batch size of the aggregate run")
    ap.add_argument("--positions", default="16,128,255,511,1023",
                    help="positions for the with/without-cache curve (capped at the context)")
    ap.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "..", "docs", "decode_vs_position.png"),
                    help="PNG of per-token time vs position ('' to skip)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (best is kept)")
    return ap.parse_args(argv)


ARGS = parse_args()
_bench_common.pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.generate import GenerationStats, generate  # noqa: E402
from minillama.model import init_params  # noqa: E402

SHAPES = {name: _bench_common.shape(name) for name in ("s15", "s110")}
PROMPT = 16


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a large float32 array copy (read + write = 2 x nbytes moved)."""
    n = max(nbytes // 4, 1 << 20)
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def best_of(fn, reps):
    best = float("inf")
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def prompt_ids(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, size=n).tolist()


def decode_alternating(model, cfg, hf_run):
    """Batch-1 greedy decode: minillama and (when given) HF take turns, so both see the same
    background load; the best repetition of each counts."""
    prompt = prompt_ids(cfg, PROMPT)
    n = ARGS.decode_tokens + 1
    generate(model, prompt, max_new_tokens=4)  # warm-up (JIT backends compile here)
    if hf_run is not None:
        hf_run(4)
    best = None
    t1 = tn = float("inf")
    hf_tokens = None
    for _ in range(ARGS.reps):
        st = GenerationStats()
        toks = generate(model, prompt, max_new_tokens=n, stats=st)
        if best is None or st.decode_s < best[0].decode_s:
            best = (st, toks)
        if hf_run is not None:
            t1 = min(t1, hf_run(1)[0])
            t, hf_tokens = hf_run(n)
            tn = min(tn, t)
    st, tokens = best
    res = {"decode_tps": st.decode_tokens_per_s, "cache_bytes_b1": st.cache_bytes}
    hf = None
    if hf_run is not None:
        agree = 0
        for a, b in zip(hf_tokens, tokens):
            if a != b:
                break
            agree += 1
        hf = {"decode_tps": (n - 1) / (tn - t1), "agree": agree, "n": n}
    return res, hf


def bench_ours(model, cfg, be):
    """Prefill of a long prompt and aggregate decode at batch ARGS.batch."""
    res = {}
    long = np.array([prompt_ids(cfg, min(ARGS.prefill, cfg.max_seq_len), seed=1)])

    def prefill():
        cache = model.new_cache(1, long.shape[1])
        out = model.forward(long, cache=cache, last_only=True)
        be.synchronize()
        return out

    prefill()
    t, _ = best_of(prefill, max(1, ARGS.reps - 1))
    res["prefill_tps"] = long.shape[1] / t
    prompts = [prompt_ids(cfg, PROMPT, seed=10 + b) for b in range(ARGS.batch)]
    generate(model, prompts, max_new_tokens=2)
    best_tps = 0.0
    for _ in range(max(1, ARGS.reps - 1)):
        st = GenerationStats()
        generate(model, prompts, max_new_tokens=ARGS.decode_tokens // 2 + 1, stats=st)
        best_tps = max(best_tps, st.decode_tokens_per_s)
    res["batch_tps"] = best_tps
    return res


def per_position(model, cfg, be, positions):
    """Seconds of one decode step at each position: with the cache (one new token against the
    cached prefix) and without (a full forward over the whole prefix, last logits only)."""
    rng = np.random.default_rng(3)
    seq = rng.integers(3, cfg.vocab_size, size=max(positions) + 1)
    with_cache, no_cache = [], []
    for p in positions:
        cache = model.new_cache(1, p + 1)
        model.forward(seq[None, :p], cache=cache, last_only=True)

        def step():
            model.forward(seq[None, p:p + 1], start_pos=p, cache=cache, last_only=True)
            be.synchronize()

        t, _ = best_of(step, max(5, ARGS.reps))  # cheap: more repetitions against noise
        with_cache.append(t)

        def full():
            model.forward(seq[None, :p + 1], last_only=True)
            be.synchronize()

        t, _ = best_of(full, ARGS.reps)
        no_cache.append(t)
    return with_cache, no_cache


def hf_peer(cfg, params):
    """``run(n) -> (seconds, new token ids)``: LlamaForCausalLM.generate (greedy, eager attention,
    exactly n new tokens) on the same weights; None without transformers/torch."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from minillama.formats import save_hf

    torch.set_num_threads(ARGS.threads)
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params)
        model = transformers.LlamaForCausalLM.from_pretrained(
            d, attn_implementation="eager", dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    prompt = torch.tensor([prompt_ids(cfg, PROMPT)])

    def run(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None)
        return time.perf_counter() - t0, out[0, PROMPT:].tolist()

    return run


def main():
    be_name = ARGS.backend
    rows = []
    curves = {}
    cpu = platform.processor() or platform.machine()
    print(f"# bench_decode: backend={be_name}, threads={ARGS.threads}, {cpu}, {os.cpu_count()} "
          f"CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    bw0 = copy_bandwidth(512 << 20, reps=7)
    print(f"# copy bandwidth at start: {bw0 / 1e9:.1f} GB/s (2 x bytes / time)", flush=True)
    for name in ARGS.shapes.split(","):
        name = name.strip()
        cfg = ModelConfig(**SHAPES[name], tie_embeddings=True)
        params = init_params(cfg, seed=0, dtype=np.float32)
        model = Transformer(cfg, params, backend=be_name, dtype=np.float32)
        be = model.backend
        wbytes = sum(int(v.nbytes) for v in params.values())
        # the best of several copies (here and at the start) estimates the attainable bandwidth
        bw = max(bw0, copy_bandwidth(max(wbytes, 256 << 20)))
        roof_ms = wbytes / bw * 1e3
        hf_run = None if ARGS.no_hf else hf_peer(cfg, params)
        ours, hf = decode_alternating(model, cfg, hf_run)
        del hf_run
        ours.update(bench_ours(model, cfg, be))
        positions = sorted({min(int(p), cfg.max_seq_len - 1) for p in ARGS.positions.split(",")})
        curves[name] = (positions, *per_position(model, cfg, be, positions))
        ms = 1e3 / ours["decode_tps"]
        rows.append((name, cfg, wbytes, bw, roof_ms, ours, ms, hf))
        print(f"{name}: decode {ours['decode_tps']:.1f} tok/s ({ms:.1f} ms/token, roofline "
              f"{roof_ms:.1f} ms at {bw / 1e9:.1f} GB/s = {ms / roof_ms:.2f}x); prefill "
              f"{ours['prefill_tps']:.0f} tok/s; batch {ARGS.batch} {ours['batch_tps']:.1f} tok/s"
              + ("" if hf is None else f"; HF {hf['decode_tps']:.1f} tok/s (ratio "
                 f"{ours['decode_tps'] / hf['decode_tps']:.2f}x, greedy agree "
                 f"{hf['agree']}/{hf['n']})"), flush=True)
        del model, params

    print()
    print("| shape | weights | KV cache (B=1) | roofline ms/tok | decode ms/tok | x roofline | "
          "decode tok/s | HF tok/s | ratio | prefill tok/s | batch-8 tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg, wbytes, bw, roof_ms, ours, ms, hf in rows:
        hf_s = f"{hf['decode_tps']:.1f}" if hf else "n/a"
        ratio = f"{ours['decode_tps'] / hf['decode_tps']:.2f}x" if hf else "n/a"
        print(f"| {name} | {wbytes / 1e6:.0f} MB | {ours['cache_bytes_b1'] / 1e6:.2f} MB | "
              f"{roof_ms:.1f} ({bw / 1e9:.1f} GB/s) | {ms:.1f} | {ms / roof_ms:.2f} | "
              f"{ours['decode_tps']:.1f} | {hf_s} | {ratio} | {ours['prefill_tps']:.0f} | "
              f"{ours['batch_tps']:.1f} |")
    print()
    print("| shape | position | with cache ms | without cache ms |")
    print("|---|---|---|---|")
    for name, (pos, wc, nc) in curves.items():
        for p, a, b in zip(pos, wc, nc):
            print(f"| {name} | {p} | {a * 1e3:.1f} | {b * 1e3:.1f} |")
    if ARGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
        for ax, (name, (pos, wc, nc)) in zip(axes[0], curves.items()):
            ax.plot(pos, np.array(wc) * 1e3, "o-", label="KV cache (one token)")
            ax.plot(pos, np.array(nc) * 1e3, "s--", label="no cache (recompute prefix)")
            ax.set_title(f"{name}, batch 1, {be_name}")
            ax.set_xlabel("position")
            ax.set_ylabel("ms per generated token")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.plot)), exist_ok=True)
        fig.savefig(ARGS.plot, dpi=110)
        print(f"\nplot: {os.path.relpath(ARGS.plot)}")


if __name__ == "__main__":
    main()
