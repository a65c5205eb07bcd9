#!/usr/bin/env python
"""Time one LoRA fine-tuning step of minillama against PyTorch eager + PEFT, same CPU and threads.

The model has SmolLM2-135M's shape (D 576, 30 layers, 9 heads / 3 KV heads, F 1536, V 49152, tied
embeddings, RoPE theta 1e5), random weights shared by both sides; LoRA rank 16, alpha 32 on all
seven linears of every block (q, k, v, o, gate, up, down); B x T = 4 x 256 (defaults). One step =
forward, backward (adapter gradients only) and AdamW on the adapters: minillama's
``loss_and_grads`` with a :class:`minillama.model.lora.LoRA` attached +
``minillama.train.optim.AdamW``, against transformers' ``LlamaForCausalLM`` wrapped by
``peft.get_peft_model`` + ``torch.optim.AdamW`` (eager, SDPA attention). The two sides take turns
step by step (A B A B ...), with ``--gap`` seconds of sleep before each timed step so the other
side's BLAS threads have stopped spinning. Each side's wall time and CPU time (all its threads,
``time.process_time``) per step are reported: on a machine shared with other jobs the CPU time tells
the work done from the time spent waiting for a core.

    python -m scripts.bench_finetune --threads 2 --steps 5
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from scripts._measure import pin_threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", help="minillama backend (default numpy)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / torch threads (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30, help="blocks (30 = SmolLM2-135M)")
    ap.add_argument("--gap", type=float, default=0.3, help="sleep before each timed step (s)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch + PEFT peer")
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from minillama import ModelConfig, Transformer  # noqa: E402
from minillama.model.lora import LoRA, LoRAConfig  # noqa: E402
from minillama.model.transformer import init_params  # noqa: E402
from minillama.train.optim import AdamW  # noqa: E402

SMOLLM2 = dict(dim=576, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152,
               max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True)


def minillama_step(cfg, params, tokens, targets):
    model = Transformer(cfg, params, backend=ARGS.backend)
    lora = LoRA(model, LoRAConfig(rank=ARGS.rank, alpha=2.0 * ARGS.rank), seed=0).attach(model)
    opt = AdamW(lora.params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0,
                backend=model.backend)

    def step():
        loss, grads = model.loss_and_grads(tokens, targets)
        opt.step(grads)
        return loss

    return step, sum(int(v.size) for v in lora.params.values())


def torch_step(torch, cfg, params, tokens, targets):
    import peft
    import transformers

    from minillama.io.hf import config_to_hf, interleaved_to_hf

    hcfg = transformers.LlamaConfig(**{k: v for k, v in config_to_hf(cfg).items()
                                       if k not in ("architectures", "torch_dtype", "dtype")})
    hcfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hcfg)
    sd = {"model.embed_tokens.weight": params["tok_embeddings.weight"],
          "model.norm.weight": params["norm.weight"]}
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for layer in range(cfg.n_layers):
        for mine, theirs in names.items():
            w = params[f"layers.{layer}.{mine}.weight"]
            if mine in ("attention.wq", "attention.wk"):
                w = interleaved_to_hf(w, cfg.n_heads if mine == "attention.wq" else cfg.n_kv_heads)
            sd[f"model.layers.{layer}.{theirs}.weight"] = w
    model.load_state_dict({k: torch.tensor(v) for k, v in sd.items()}, strict=False)
    lc = peft.LoraConfig(r=ARGS.rank, lora_alpha=2 * ARGS.rank, lora_dropout=0.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lc)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    tok = torch.tensor(tokens)
    tgt = torch.tensor(targets)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=tok).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tgt.reshape(-1), ignore_index=-1)
        loss.backward()
        opt.step()
        return loss.item()

    return step, sum(p.numel() for p in trainable)


def main() -> int:
    torch = None
    if not ARGS.no_torch:
        import torch

        torch.set_num_threads(ARGS.threads)
    cfg = ModelConfig(n_layers=ARGS.layers, **SMOLLM2)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    B, T = ARGS.batch, ARGS.seq
    seq = rng.integers(0, cfg.vocab_size, size=(B, T + 1))
    tokens, targets = seq[:, :-1], seq[:, 1:]
    sides = {"minillama": minillama_step(cfg, params, tokens, targets)}
    if torch is not None:
        sides["torch+peft"] = torch_step(torch, cfg, params, tokens, targets)
    first = {name: fn() for name, (fn, _) in sides.items()}  # same weights: same first loss
    for _ in range(ARGS.warmup - 1):
        for fn, _ in sides.values():
            fn()
    times = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    for _ in range(ARGS.steps):
        for name, (fn, _) in sides.items():
            time.sleep(ARGS.gap)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    print(f"# LoRA fine-tuning step — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {ARGS.threads} threads each, "
          f"numpy {np.__version__}" + (f", torch {torch.__version__}" if torch else ""))
    print(f"model: SmolLM2-135M shape, {cfg.n_layers} layers, {cfg.n_params():,} params; LoRA "
          f"rank {ARGS.rank} on q,k,v,o,gate,up,down; B x T = {B} x {T}; backend "
          f"{ARGS.backend}; median of {ARGS.steps} interleaved steps")
    print("first-step loss: " + ", ".join(f"{k} {v:.5f}" for k, v in first.items()))
    print()
    print("| side | trainable | step (s) | tokens/s | time / minillama's | CPU s / step | CPU / "
          "minillama's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ref = float(np.median(times["minillama"]))
    cref = float(np.median(cpu["minillama"]))
    for name, ts in times.items():
        t, c = float(np.median(ts)), float(np.median(cpu[name]))
        print(f"| {name} | {sides[name][1]:,} | {t:.3f} | {B * T / t:,.0f} | {t / ref:.2f} | "
              f"{c:.2f} | {c / cref:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
