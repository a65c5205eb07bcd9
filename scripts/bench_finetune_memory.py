#!/usr/bin/env python
"""The memory plan of a fine-tuning step against what the step allocates, with and without
``--recompute``; the plan of whole ``minillama finetune`` runs against their measured peak
resident memory, on short and on long chat records; and the example tokens per second of padded
against packed chat batches.

Memory: the checkpoint (default: SmolLM2-135M-Instruct Q4_1 GGUF, its blocks kept quantized) with
LoRA (rank 8 on all seven linears), one (B, T) micro-batch of random tokens. For each mode
(plain, recompute): the plan's activation bytes (:mod:`minillama.train.memplan`), the bytes of the
arrays the forward keeps (measured on the tape), the peak of ``tracemalloc`` over one
``loss_and_grads`` (NumPy reports its buffers to it) and the step's time.

Plan against peak (``rss``): ``minillama finetune`` in a subprocess (``--backend``, ``--batch``,
``--context`` = ``--seq``, ``--rss-steps`` steps) on 8 short chat records (one question and a
few-word answer each) and on 8 chat records that fill the context (an answer of repeated words
as long as the context takes, through the model's own template and tokenizer). The plan's total
(the line the command prints) against the process's peak resident memory (``VmHWM``), and the
plan's part above the memory the process held before the command against the measured rise.

Packing: a synthetic chat set (question/answer conversations of varied lengths as prompt and
completion, the loss on the last answer), ``Finetuner`` train steps padded then packed (the
same settings otherwise), their steps interleaved; example tokens (not padding) per second of
training time.

    python -m scripts.bench_finetune_memory --threads 2 --batch 4 --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from scripts._measure import peak_alloc, pin_threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=os.environ.get(
        "MINILLAMA_SMOLLM2", "/tmp/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--pack-steps", type=int, default=4, help="timed train steps per mode")
    ap.add_argument("--pack-context", type=int, default=256)
    ap.add_argument("--rss-steps", type=int, default=1, help="steps of each measured run")
    ap.add_argument("--skip", choices=("memory", "rss", "pack"), action="append", default=[])
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402

from minillama.io.load import load_params  # noqa: E402
from minillama.model.lora import LoRA, LoRAConfig  # noqa: E402
from minillama.model.transformer import Transformer  # noqa: E402
from minillama.train import memplan  # noqa: E402
from minillama.train.finetune import Finetuner  # noqa: E402

MiB = 1024 ** 2


def tape_bytes(model, x, y) -> int:
    """Bytes the training forward keeps: the tape (every op's ctx, or under recompute the block
    inputs) and the loss head's ctx."""
    be = model.backend
    B, T = x.shape
    model.lora.training = True
    try:
        hn, tape = model._run(x, 0, None, train=True, head=False)
        _, c = be.linear_cross_entropy_forward(hn.reshape(B * T, -1), model.output_weight,
                                               be.asarray(y.reshape(-1)), -1)
    finally:
        model.lora.training = False
    return memplan.saved_bytes([tape, c, x, y], exclude=memplan.model_buffers(model))


def memory() -> None:
    _, cfg, params, _ = load_params(ARGS.checkpoint)
    model = Transformer(cfg, params, backend=ARGS.backend, dtype=np.float32)
    lora = LoRA(model, LoRAConfig(rank=8), seed=0).attach(model)
    rng = np.random.default_rng(0)
    B, T = ARGS.batch, ARGS.seq
    seq = rng.integers(0, cfg.vocab_size, size=(B, T + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    print(f"## memory: {os.path.basename(ARGS.checkpoint)}, LoRA rank 8 on all seven linears, "
          f"B x T = {B} x {T}, backend {ARGS.backend}")
    print()
    print("| mode | plan: activations | measured: saved arrays | plan: act. + workspace + "
          "grads | measured: tracemalloc peak of the step | step (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    grads_ref = None
    for recompute in (False, True):
        model.recompute = recompute
        p = memplan.plan(model, lora.params, B, T, recompute=recompute)
        saved = tape_bytes(model, x, y)
        _, g = model.loss_and_grads(x, y)  # warm
        grads_ref = g if grads_ref is None else grads_ref
        same = all(np.array_equal(g[k], grads_ref[k]) for k in g)
        peak = peak_alloc(lambda: model.loss_and_grads(x, y))
        t0 = time.perf_counter()
        model.loss_and_grads(x, y)  # untraced timing
        dt = time.perf_counter() - t0
        bound = p.activations + p.workspace + p.gradients
        print(f"| {'--recompute' if recompute else 'plain'} | {p.activations / MiB:.1f} MiB | "
              f"{saved / MiB:.1f} MiB | {bound / MiB:.1f} MiB | {peak / MiB:.1f} MiB | "
              f"{dt:.2f} |" + ("" if same else " (gradients differ!)"))
        if not recompute:
            print("\n".join(f"<!-- {line} -->" for line in p.lines()))
    model.recompute = False
    print()


#: runs ``minillama ARGS``; prints the resident memory before it and the peak after it
MEASURE = r"""
import json, sys
from minillama.cli import main as cli

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

base = status("VmRSS:")
rc = cli.main(sys.argv[1:])
print("measured " + json.dumps({"rc": rc, "base": base, "peak": status("VmHWM:")}),
      file=sys.stderr)
"""
UNITS = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}
PLAN = re.compile(r"^memory plan: ([0-9.]+) (\S+) at peak = (?:runtime ([0-9.]+) (\S+) \+ )?"
                  r".*B x T = (\d+ x \d+)", re.M)
SHORT_CHAT = [("what is the capital of france?", "paris."), ("name a color.", "blue."),
              ("2+2?", "4."), ("say hi.", "hi!"), ("what is water made of?", "hydrogen and "
              "oxygen."), ("largest planet?", "jupiter."), ("a fruit?", "an apple."),
              ("opposite of hot?", "cold.")]
WORDS = "the quick brown fox jumps over the lazy dog and runs far away".split()


def _answer(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def long_chat(tok, context: int) -> list[tuple[str, str]]:
    """The questions of :data:`SHORT_CHAT`, each answered by as many repeated words as fit in
    ``context`` + 1 tokens of the model's template."""
    from minillama.train.finetune import chat_example

    out = []
    for q, _ in SHORT_CHAT:
        def size(n, q=q):
            return len(chat_example(tok, [{"role": "user", "content": q},
                                          {"role": "assistant", "content": _answer(n)}]).ids)
        lo, hi = 1, 4 * context
        while lo < hi:  # the most words that fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(mid) <= context + 1 else (lo, mid - 1)
        out.append((q, _answer(lo)))
    return out


def measured_run(name: str, label: str, pairs, d: str) -> str:
    """One table row: ``minillama finetune`` on the chat records ``pairs`` in a subprocess."""
    data = os.path.join(d, f"{name}.jsonl")
    with open(data, "w") as f:
        for q, a in pairs:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    args = ["finetune", "-c", ARGS.checkpoint, "--data", data, "--out", os.path.join(d, name),
            "--batch-size", str(ARGS.batch), "--context", str(ARGS.seq), "--steps",
            str(ARGS.rss_steps), "--val-fraction", "0", "--backend", ARGS.backend,
            "--no-progress"]
    got = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True)
    line = [x for x in got.stderr.splitlines() if x.startswith("measured ")]
    plans = PLAN.findall(got.stderr)
    if not line or not plans:
        return f"| {label} | run failed: {got.stderr.strip().splitlines()[-1:]} |"
    m = json.loads(line[0][len("measured "):])
    total, unit, rt, rt_unit, shape = plans[-1]
    total = float(total) * UNITS[unit]
    runtime = float(rt) * UNITS[rt_unit] if rt else 0.0
    return (f"| {label} | {shape} | {total / MiB:.0f} MiB ({runtime / MiB:.0f} + "
            f"{(total - runtime) / MiB:.0f}) | {m['peak'] / MiB:.0f} MiB | "
            f"{total / m['peak']:.2f} | {m['base'] / MiB:.0f} MiB | "
            f"{(total - m['base']) / (m['peak'] - m['base']):.2f} |")


def rss() -> None:
    tok = load_params(ARGS.checkpoint)[3]
    d = tempfile.mkdtemp()
    print(f"## plan vs measured peak: `minillama finetune` on {os.path.basename(ARGS.checkpoint)}"
          f", LoRA (defaults), --batch-size {ARGS.batch} --context {ARGS.seq} --steps "
          f"{ARGS.rss_steps}, backend {ARGS.backend}, a subprocess per run")
    print()
    print("| data | B x T planned | plan (runtime + rest) | measured peak (VmHWM) | plan / peak | "
          "before the command | planned rise / measured rise |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(measured_run("short", "8 short chat records", SHORT_CHAT, d))
    print(measured_run("long", "8 chat records filling the context", long_chat(tok, ARGS.seq),
                       d))
    print()


CHAT_Q = ["what is the capital of {c}?", "name a river in {c}.", "how do you say hello in {l}?",
          "give me one fact about {c}.", "tell me a short story about a {a} from {c}."]
CHAT_A = ["{c} has many cities; the capital is well known.", "a river flows through {c}.",
          "in {l} people greet each other politely.",
          "one fact: {c} is a country with a long history and many {a}s.",
          "once upon a time a {a} from {c} walked for days, found a friend, and came home "
          "happy. the end."]
PLACES = [("france", "french", "cat"), ("japan", "japanese", "fox"), ("peru", "spanish", "llama"),
          ("kenya", "swahili", "lion"), ("norway", "norwegian", "moose"),
          ("india", "hindi", "tiger")]


def chat_set(path, n=96) -> None:
    """Conversations of 1 to 3 question/answer turns, each written as a prompt (the turns as
    ``role: text`` lines up to the last ``assistant:``) and its completion (the last answer):
    the loss on the answer only. (Chat records through the GGUF tokenizer's template would need
    token offsets it does not give.)"""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            c, lang, a = PLACES[i % len(PLACES)]
            lines = ["system: you are brief."]
            for _ in range(1 + int(rng.integers(0, 3))):
                k = int(rng.integers(0, len(CHAT_Q)))
                q, ans = CHAT_Q[k].format(c=c, l=lang, a=a), CHAT_A[k].format(c=c, l=lang, a=a)
                lines.append(f"user: {q}")
                lines.append(f"assistant: {ans}")
            last = lines.pop()[len("assistant: "):]
            f.write(json.dumps({"prompt": "\n".join(lines) + "\nassistant:",
                                "completion": " " + last}) + "\n")


def pack() -> None:
    d = tempfile.mkdtemp()
    data = os.path.join(d, "chat.jsonl")
    chat_set(data)
    print(f"## padded vs packed: {os.path.basename(ARGS.checkpoint)}, LoRA rank 8, synthetic "
          f"chat set (96 conversations), --batch-size {ARGS.batch} --context "
          f"{ARGS.pack_context}, backend {ARGS.backend}, {ARGS.pack_steps} interleaved timed steps "
          f"each after one")
    print()
    print("| mode | examples / step | positions / step | example tokens / s | step (s) |")
    print("|---|---:|---:|---:|---:|")
    runs = {}
    for packed in (False, True):
        s = {"checkpoint": ARGS.checkpoint, "data": data, "val_data": None, "val_fraction": 0.0,
             "full": False, "lora_rank": 8, "lora_alpha": 16.0,
             "lora_targets": "q,k,v,o,gate,up,down", "lora_dropout": 0.0, "rslora": False,
             "steps": 1000, "batch_size": ARGS.batch, "grad_accum": 1,
             "context": ARGS.pack_context, "lr": 1e-4, "min_lr": 1e-5, "warmup": 1,
             "weight_decay": 0.0, "grad_clip": 1.0, "eval_interval": 1000, "seed": 0,
             "backend": ARGS.backend, "skip_bad": False, "pack": packed, "recompute": False}
        ft = Finetuner(s, os.path.join(d, f"out{int(packed)}"), progress=False,
                       say=lambda m: None)
        ft.train_step()  # warm
        runs[packed] = (ft, ft.sampler.epoch * len(ft.train_ex) + ft.sampler.pos,
                        ft.tokens_seen, ft.example_tokens, [])
    for _ in range(ARGS.pack_steps):  # interleaved: padded, packed, padded, ...
        for ft, *_, times in runs.values():
            t0 = time.perf_counter()
            ft.train_step()
            times.append(time.perf_counter() - t0)
    rate = {}
    for packed, (ft, n_ex0, pos0, ex_tok0, times) in runs.items():
        dt, n = sum(times), ARGS.pack_steps
        n_ex = ft.sampler.epoch * len(ft.train_ex) + ft.sampler.pos - n_ex0
        rate[packed] = (ft.example_tokens - ex_tok0) / dt
        print(f"| {'--pack' if packed else 'padded'} | {n_ex / n:.1f} | "
              f"{(ft.tokens_seen - pos0) / n:.0f} | {rate[packed]:.1f} | {dt / n:.2f} |")
    print(f"\npacked / padded example tokens per second: {rate[True] / rate[False]:.2f}; "
          f"load {os.getloadavg()[0]:.2f} at the end")
    print()


def main() -> int:
    print(f"# fine-tuning memory and packing — "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {ARGS.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}, numpy {np.__version__}")
    print()
    if "memory" not in ARGS.skip:
        memory()
    if "rss" not in ARGS.skip:
        rss()
    if "pack" not in ARGS.skip:
        pack()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
