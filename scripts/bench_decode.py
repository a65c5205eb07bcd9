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

    python -m scripts.bench_decode --backend numpy --threads 2

With ``--llama2c PATH`` (a ``run`` binary built by the user from karpathy/llama2.c's ``run.c``,
e.g. ``gcc -Ofast -march=native -fopenmp run.c -lm -o run``; no llama2.c code lives in this
repository) the script instead writes each shape as a random-weight llama2.c version-0
checkpoint plus a synthetic ``tokenizer.bin`` (one distinct piece per id, so the greedy tokens of
both programs can be compared), and runs, interleaved repetition by repetition, ``run`` (greedy,
``-n STEPS`` from an empty prompt, ``OMP_NUM_THREADS`` = threads) and minillama's ``generate``
on the same file loaded through :func:`minillama.io.load.load_model` (batch 1 from BOS, then the
batch-B aggregate). It prints both decode rates, best and median, their ratios (> 1: minillama
is faster), how many greedy tokens agree, and the load average:

    python -m scripts.bench_decode --backend numba --llama2c /tmp/llama2c/run \
        --shapes s15,s15gqa,s110 --reps 5

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

from scripts._measure import best, copy_bandwidth, model_shape, pin_threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", help="minillama backend (default numpy)")
    ap.add_argument("--shapes", default="s15,s110",
                    help="comma list of: s15, s15gqa (s15 with 2 KV heads), s110")
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
    ap.add_argument("--llama2c", default=None, metavar="PATH",
                    help="llama2.c 'run' binary: compare against it instead of the roofline/HF")
    ap.add_argument("--steps", type=int, default=200,
                    help="with --llama2c: positions run by each program (run.c's -n)")
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.infer.generate import GenerationStats, generate  # noqa: E402
from minillama.model.transformer import init_params  # noqa: E402

SHAPES = {name: model_shape(name) for name in ("s15", "s110")}
SHAPES["s15gqa"] = model_shape("s15", n_kv_heads=2)
PROMPT = 16


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
    t = best(prefill, max(1, ARGS.reps - 1))
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

        t = best(step, max(5, ARGS.reps))  # cheap: more repetitions against noise
        with_cache.append(t)

        def full():
            model.forward(seq[None, :p + 1], last_only=True)
            be.synchronize()

        t = best(full, ARGS.reps)
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
    from minillama.io.load import save_hf

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


def write_piece_tokenizer(path, vocab_size: int) -> None:
    """A llama2.c ``tokenizer.bin`` whose piece for id i >= 3 is ``~i`` (ids 0-2 as llama2.c:
    ``<unk>``, BOS, EOS), so the ids can be read back from ``run``'s printed text."""
    import struct

    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"~{i}".encode() for i in range(3, vocab_size)]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for p in pieces)))
        for i, p in enumerate(pieces):
            f.write(struct.pack("<fi", -float(i), len(p)) + p)


def run_llama2c(binary, model_path, tok_path, steps):
    """One greedy run of llama2.c: (tok/s it reports, generated ids)."""
    import re
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(ARGS.threads))
    r = subprocess.run([binary, model_path, "-z", tok_path, "-t", "0", "-n", str(steps)],
                       capture_output=True, text=True, env=env, check=False)
    m = re.search(r"achieved tok/s: ([0-9.]+)", r.stderr)
    if r.returncode != 0 or m is None:
        sys.exit(f"bench_decode: {binary} failed (status {r.returncode}): {r.stderr.strip()[:300]}")
    ids = [2 if t == "</s>" else int(t[1:]) for t in re.findall(r"~\d+|</s>", r.stdout)]
    return float(m.group(1)), ids


def llama2c_main():
    """Decode speed against llama2.c's run.c on the same random checkpoints, interleaved."""
    from minillama.io.llama2c import save_llama2c
    from minillama.io.load import load_model

    binary = os.path.abspath(ARGS.llama2c)
    if not os.access(binary, os.X_OK):
        sys.exit(f"bench_decode: {binary} is not an executable llama2.c run binary")
    cpu = platform.processor() or platform.machine()
    print(f"# bench_decode vs llama2.c: backend={ARGS.backend}, threads={ARGS.threads}, {cpu}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, steps {ARGS.steps}, "
          f"reps {ARGS.reps}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in ARGS.shapes.split(","):
            name = name.strip()
            cfg = ModelConfig(**SHAPES[name], tie_embeddings=True)
            params = init_params(cfg, seed=0, dtype=np.float32)
            mpath = os.path.join(d, f"{name}.bin")
            tpath = os.path.join(d, "tokenizer.bin")
            save_llama2c(mpath, cfg, params, version=0)
            write_piece_tokenizer(tpath, cfg.vocab_size)
            del params
            model, _ = load_model(mpath, backend=ARGS.backend)
            steps = min(ARGS.steps, cfg.max_seq_len)
            n_new = steps - 1
            generate(model, [1], max_new_tokens=4)  # warm-up (JIT backends compile here)
            run_llama2c(binary, mpath, tpath, 8)
            load0 = os.getloadavg()[0]
            ours, theirs, batch = [], [], []
            for _ in range(ARGS.reps):
                tps, c_ids = run_llama2c(binary, mpath, tpath, steps)
                theirs.append(tps)
                st = GenerationStats()
                m_ids = generate(model, [1], max_new_tokens=n_new, stats=st)
                ours.append(st.decode_tokens_per_s)
                st = GenerationStats()
                generate(model, [[1]] * ARGS.batch, max_new_tokens=n_new, stats=st)
                batch.append(st.decode_tokens_per_s)
            agree = 0
            for a, b in zip(c_ids, m_ids):
                if a != b:
                    break
                agree += 1
            load1 = os.getloadavg()[0]
            # bytes streamed per batch-1 token: every weight once (the tied classifier is the
            # embedding); the cache rows read are under 1% of it at these lengths
            wbytes = 4 * cfg.n_params()
            row = dict(name=name, c=theirs, m=ours, batch=batch, agree=agree,
                       n=min(len(c_ids), len(m_ids)), load=(load0 + load1) / 2,
                       gbs_c=max(theirs) * wbytes / 1e9, gbs_m=max(ours) * wbytes / 1e9,
                       copy=copy_bandwidth(wbytes) / 1e9)
            rows.append(row)
            print(f"{name}: run.c {max(theirs):.0f} tok/s best, {np.median(theirs):.0f} median; "
                  f"minillama {max(ours):.0f} best, {np.median(ours):.0f} median; ratio "
                  f"{max(ours) / max(theirs):.2f}x best, "
                  f"{np.median(ours) / np.median(theirs):.2f}x "
                  f"median; batch {ARGS.batch} {max(batch):.0f} tok/s = "
                  f"{max(batch) / max(theirs):.2f}x run.c batch 1; greedy agree "
                  f"{agree}/{row['n']}; load {row['load']:.2f}; weights streamed at "
                  f"{row['gbs_c']:.1f} GB/s by run.c, {row['gbs_m']:.1f} by minillama (NumPy copy "
                  f"{row['copy']:.1f} GB/s)", flush=True)
            del model
    print()
    print(f"| shape | run.c tok/s best (median) | minillama {ARGS.backend} tok/s best (median) | "
          f"ratio best (median) | batch-{ARGS.batch} tok/s best | / run.c batch 1 | greedy agree "
          f"| load avg | weight GB/s run.c / minillama / copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, m, bt = r["c"], r["m"], r["batch"]
        print(f"| {r['name']} | {max(c):.0f} ({np.median(c):.0f}) | {max(m):.0f} "
              f"({np.median(m):.0f}) | {max(m) / max(c):.2f}x ({np.median(m) / np.median(c):.2f}x) "
              f"| {max(bt):.0f} | {max(bt) / max(c):.2f}x | {r['agree']}/{r['n']} | "
              f"{r['load']:.2f} | {r['gbs_c']:.1f} / {r['gbs_m']:.1f} / {r['copy']:.1f} |")


def main():
    if ARGS.llama2c:
        return llama2c_main()
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
    for name, _, wbytes, bw, roof_ms, ours, ms, hf in rows:
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
