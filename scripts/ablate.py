#!/usr/bin/env python
r"""The notes' claims put to an experiment: one small model on Shakespeare, one variant changed at
a time, the same token budget and the same seeds for every run.

Claims tested (docs/ABLATIONS.md says which the runs support):

* pre-norm against post-norm: pre-LN keeps gradients well scaled and converges 1.3-1.5x faster;
  post-LN diverges at a learning rate pre-LN takes (both run again at ``--high-lr`` without
  warmup);
* RMSNorm against LayerNorm: about the same loss, RMSNorm cheaper per step;
* RoPE against sinusoidal absolute positions against none;
* SwiGLU against GELU and ReLU two-matrix FFNs at matched parameter count (F_2 = 3/2 F);
* MHA against GQA against MQA: loss, KV-cache bytes, cached-decode tokens/s;
* the logit scale s = 1/\sqrt{D} on and off.

Every run trains in this process with :class:`minillama.train.trainer.Trainer` and records its
training loss at every step, its validation loss every ``--eval-interval`` steps (the same fixed
validation batches for every run), and its training seconds. Results go to ``--json`` (default
docs/ablations.json) and a loss-curve figure to ``--plot`` (default docs/ablations.png); a
markdown summary table (mean +- spread over seeds) is printed.

    python -m scripts.ablate                      # the real runs (see docs/ABLATIONS.md)
    python -m scripts.ablate --smoke --out /tmp/a # two variants, one seed, a few steps (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from minillama.io.data import prepare_data
from minillama.train.trainer import TrainConfig, Trainer, TrainingDiverged

#: the model every run starts from (LLaMA's choices; GQA with 2 KV heads)
BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, context=64, batch_size=8, warmup=20,
            lr=4e-3, min_lr=4e-4, eval_iters=8, weight_decay=0.1)

#: (name, group, overrides of BASE)
VARIANTS = [
    ("llama (pre, rmsnorm, rope, swiglu, gqa)", "baseline", {}),
    ("post-norm", "norm position", {"norm_position": "post"}),
    ("layernorm", "norm type", {"norm": "layernorm"}),
    ("sinusoidal positions", "positions", {"pos_encoding": "sinusoidal"}),
    ("no positions", "positions", {"pos_encoding": "none"}),
    ("gelu ffn", "ffn", {"ffn": "gelu"}),
    ("relu ffn", "ffn", {"ffn": "relu"}),
    ("mha (4 kv heads)", "kv heads", {"n_kv_heads": 4}),
    ("mqa (1 kv head)", "kv heads", {"n_kv_heads": 1}),
    ("logit scale 1/sqrt(D)", "logit scale", {"logit_scale": 1 / math.sqrt(BASE["dim"])}),
    ("pre-norm, high lr, no warmup", "high lr", {"lr": "HIGH", "warmup": 0}),
    ("post-norm, high lr, no warmup", "high lr", {"norm_position": "post", "lr": "HIGH",
                                                  "warmup": 0}),
]


def decode_speed(model, n_tokens: int = 48, reps: int = 3) -> float:
    """Cached greedy decode tokens/s of batch 1 (best of ``reps``), after a one-token prompt."""
    best = 0.0
    for _ in range(reps):
        cache = model.new_cache(1)
        tok = np.zeros((1, 1), dtype=np.int64)
        t0 = time.perf_counter()
        for pos in range(n_tokens):
            logits = model.forward(tok, pos, cache, last_only=True)
            tok = np.asarray(model.backend.to_numpy(logits)).argmax(-1).reshape(1, 1)
        best = max(best, n_tokens / (time.perf_counter() - t0))
    return best


def run_one(name, overrides, seed, args, data_dir, out) -> dict:
    settings = {**BASE, "steps": args.steps, "eval_interval": args.eval_interval, "seed": seed,
                "ckpt_interval": args.steps, "out": str(out), "data": str(data_dir)}
    for k, v in overrides.items():
        settings[k] = args.high_lr if v == "HIGH" else v
    if settings["min_lr"] > settings["lr"]:
        settings["min_lr"] = settings["lr"] / 10
    if "plot" in TrainConfig.__dataclass_fields__:
        settings["plot"] = False
    if args.smoke:
        settings.update(dim=16, n_heads=2, n_kv_heads=min(settings["n_kv_heads"], 2), context=16,
                        batch_size=2, eval_iters=1, warmup=0)
        if "logit_scale" in overrides:
            settings["logit_scale"] = 0.25
    tc = TrainConfig.from_dict(settings)
    trainer = Trainer(tc, data_dir=data_dir, progress=False)
    cfg = trainer.cfg
    diverged = False
    t0 = time.perf_counter()
    try:
        trainer.train()
    except TrainingDiverged:
        diverged = True
    wall = time.perf_counter() - t0
    res = {"name": name, "seed": seed, "settings": settings, "diverged": diverged,
           "n_params": cfg.n_params(), "train": trainer.history["train"],
           "val": trainer.history["val"], "steps_done": trainer.step,
           "train_seconds": trainer.train_seconds, "wall_seconds": wall,
           "seconds_per_step": trainer.train_seconds / max(trainer.step, 1),
           "kv_cache_bytes_per_token": 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
           * np.dtype(tc.dtype).itemsize}
    res["final_val"] = trainer.history["val"][-1][1] if trainer.history["val"] and not diverged \
        else float("nan")
    if overrides.get("n_kv_heads") is not None or not overrides:
        res["decode_tokens_per_s"] = decode_speed(trainer.model, 8 if args.smoke else 48)
    return res


def norm_timing(reps: int = 30) -> str:
    """RMSNorm against LayerNorm as ops (the reference code of both, forward + backward, float32),
    interleaved and timed in process CPU seconds, best of ``reps``: a markdown table."""
    from minillama.core import notes_ops, ops

    lines = ["| rows x D | rmsnorm fwd+bwd us | layernorm fwd+bwd us | layernorm / rmsnorm |",
             "|---|---|---|---|"]
    for N, D in ((512, 64), (2048, 192), (4096, 768)):
        rng = np.random.default_rng(0)
        x, dy = rng.standard_normal((2, N, D)).astype(np.float32)
        g, b = np.ones(D, np.float32), np.zeros(D, np.float32)
        best = {"rms": math.inf, "ln": math.inf}
        for _ in range(reps):
            for k in best:
                t0 = time.process_time()
                if k == "rms":
                    ops.rmsnorm_backward(dy, ops.rmsnorm_forward(x, g, 1e-5)[1])
                else:
                    notes_ops.layernorm_backward(dy, notes_ops.layernorm_forward(x, g, b, 1e-5)[1])
                best[k] = min(best[k], time.process_time() - t0)
        lines.append(f"| {N} x {D} | {best['rms'] * 1e6:.0f} | {best['ln'] * 1e6:.0f} | "
                     f"{best['ln'] / best['rms']:.2f} |")
    return "\n".join(lines)


def steps_to(curve, target: float, smooth: int = 20) -> float:
    """First step where the running mean (over ``smooth`` steps) of the training loss <= target."""
    losses = np.array([v for _, v in curve])
    if losses.size < smooth:
        return float("nan")
    run = np.convolve(losses, np.ones(smooth) / smooth, mode="valid")
    hit = np.flatnonzero(run <= target)
    return float(hit[0] + smooth) if hit.size else float("nan")


def summarise(results: list[dict]) -> str:
    """A markdown table: mean and half-range over seeds of each variant's numbers."""
    names = list(dict.fromkeys(r["name"] for r in results))
    lines = ["| variant | params | final val loss (mean ± half-range) | per seed | s/step | "
             "diverged |", "|---|---|---|---|---|---|"]
    for n in names:
        rs = [r for r in results if r["name"] == n]
        v = np.array([r["final_val"] for r in rs])
        sps = np.array([r["seconds_per_step"] for r in rs])
        spread = (np.nanmax(v) - np.nanmin(v)) / 2 if np.isfinite(v).any() else float("nan")
        mean = np.nanmean(v) if np.isfinite(v).any() else float("nan")
        lines.append(f"| {n} | {rs[0]['n_params']:,} | {mean:.4f} ± "
                     f"{spread:.4f} | {', '.join(f'{x:.4f}' for x in v)} | {sps.mean():.3f} | "
                     f"{sum(r['diverged'] for r in rs)}/{len(rs)} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(g for _, g, _ in VARIANTS if g != "baseline"))
    fig, axes = plt.subplots(2, math.ceil(len(groups) / 2), figsize=(15, 8), sharey=True)
    for ax, group in zip(axes.ravel(), groups):
        names = ["llama (pre, rmsnorm, rope, swiglu, gqa)"] * (group != "high lr") + \
            [n for n, g, _ in VARIANTS if g == group]
        for i, n in enumerate(names):
            for r in (r for r in results if r["name"] == n):
                steps, vals = zip(*r["val"]) if r["val"] else ((), ())
                ax.plot(steps, vals, color=f"C{i}", alpha=0.8, marker=".",
                        label=n if r["seed"] == results[0]["seed"] else None)
        ax.set_title(group)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes.ravel()[0].set_ylabel("validation loss (nats/byte)")
    axes.ravel()[len(groups) // 2 if len(groups) % 2 == 0 else 0].set_ylabel(
        "validation loss (nats/byte)")
    for ax in axes.ravel()[len(groups):]:
        ax.axis("off")
    fig.suptitle("one variant changed at a time (all seeds drawn; same tokens and seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--high-lr", type=float, default=3e-2)
    ap.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    ap.add_argument("--out", default="runs/ablate", help="run folders and prepared data")
    ap.add_argument("--json", default=None, help="results file (default docs/ablations.json; "
                                                 "OUT/ablations.json with --smoke)")
    ap.add_argument("--plot", default=None, help="figure (default docs/ablations.png; "
                                                 "OUT/ablations.png with --smoke)")
    ap.add_argument("--append", action="store_true",
                    help="keep the results already in --json (other seeds/variants) and add these")
    ap.add_argument("--norm-timing", action="store_true",
                    help="only time the RMSNorm and LayerNorm ops (CPU seconds, interleaved)")
    ap.add_argument("--smoke", action="store_true",
                    help="two variants, one seed, 3 steps of a tiny model (for the tests)")
    args = ap.parse_args(argv)
    if args.norm_timing:
        print(norm_timing())
        return 0
    out = Path(args.out)
    variants = VARIANTS
    if args.smoke:
        args.steps, args.eval_interval, args.seeds = 3, 3, args.seeds[:1]
        variants = [VARIANTS[0], VARIANTS[1]]
    if args.only:
        variants = [v for v in VARIANTS if v[0] in args.only]
    json_path = Path(args.json or (out / "ablations.json" if args.smoke
                                   else "docs/ablations.json"))
    plot_path = Path(args.plot or (out / "ablations.png" if args.smoke
                                   else "docs/ablations.png"))
    if args.smoke:
        text = Path(tempfile.mkdtemp()) / "smoke.txt"
        text.write_text("To be, or not to be, that is the question.\n" * 200, encoding="utf-8")
        data_dir = prepare_data(str(text), out / "data")
    else:
        data_dir = prepare_data("shakespeare", out / "data")
    results = []
    if args.append and json_path.is_file():  # add seeds (or variants) to an earlier run's results
        old = json.loads(json_path.read_text())["results"]
        todo = {(n, s) for n, _, _ in variants for s in args.seeds}
        results = [r for r in old if (r["name"], r["seed"]) not in todo]
    # seeds outermost: the variants of one seed run back to back, so slow phases of the shared
    # machine spread over all variants instead of hitting one
    for seed in args.seeds:
        for i, (name, _, overrides) in enumerate(variants):
            r = run_one(name, overrides, seed, args, data_dir, out / f"run{i}_seed{seed}")
            results.append(r)
            print(f"{name} seed {seed}: final val {r['final_val']:.4f}, "
                  f"{r['seconds_per_step']:.3f} s/step{' DIVERGED' if r['diverged'] else ''}",
                  file=sys.stderr, flush=True)
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({"base": BASE, "steps": args.steps,
                                             "seeds": sorted({r["seed"] for r in results}),
                                             "results": results}))
    print(summarise(results))
    plot(results, plot_path)
    print(f"wrote {json_path} and {plot_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
