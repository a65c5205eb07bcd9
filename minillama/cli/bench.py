"""``minillama backends``, ``minillama compile`` and ``minillama bench``: what can run here, its
kernels compiled ahead, and how fast each backend is.

``minillama bench`` is a quick, self-contained check that switching backends gives the same numbers
and what each one costs: for one model shape it runs a training step (forward + backward) and a
KV-cached greedy decode on every chosen backend, and prints tokens/s with the largest difference
from the NumPy reference. The peer comparisons (PyTorch, Hugging Face, llama2.c) live in the
scripts under ``scripts/``.
"""

from __future__ import annotations

import os
import time

import numpy as np

from minillama.backends import (
    AUTO_REFERENCE_MAX_PARAMS,
    ENV_VAR,
    auto_backend,
    backend_names,
    get_backend,
)
from minillama.cli.common import add_backend_list_flag, positive_int
from minillama.core.config import SHAPES, ModelConfig
from minillama.core.errors import MinillamaError
from minillama.infer.precompile import precompile
from minillama.model.transformer import Transformer, init_params


def add_cli(sub) -> None:
    p = sub.add_parser("backends", help="list the backends and whether each can run here",
                       description="List every registered backend and whether it can run on "
                                   "this machine (and if not, what to install).")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("compile", help="compile the numba kernels of generate, chat and serve "
                                       "ahead (an editable install does it)",
                       description="Compile the numba kernels that generate, chat and serve run "
                                   "on GGUF block-quantized and float32 models into Numba's disk "
                                   "cache, for this CPU, so that the first answer does not wait "
                                   "for the compiler: what `pip install -e .` does at install. "
                                   "For a wheel install, after MINILLAMA_PRECOMPILE=0, or after "
                                   "the cache was cleared. Kernels already cached load in seconds.")
    p.set_defaults(func=cmd_compile)

    shapes = "; ".join(f"{k}: D={v['dim']}, L={v['n_layers']}, H={v['n_heads']}, "
                       f"V={v['vocab_size']}" for k, v in SHAPES.items())
    p = sub.add_parser("bench", help="time a training step and cached decode on each backend",
                       description=__doc__.split("\n\n", 1)[1])
    add_backend_list_flag(p)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                   help=f"the model shape, random weights ({shapes})")
    p.add_argument("--batch", type=positive_int, default=8, help="B of the training step")
    p.add_argument("--seq", type=positive_int, default=128, help="T of the training step")
    p.add_argument("--decode-tokens", type=positive_int, default=32,
                   help="tokens decoded at batch 1")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs of each measurement; the fastest is reported")
    p.set_defaults(func=cmd_bench)


def cmd_backends(args) -> int:
    width = max(len(name) for name in backend_names())
    for name in backend_names():
        try:
            be = get_backend(name)
        except MinillamaError as e:
            print(f"{name:{width}s} unavailable: {e}")
        else:
            print(f"{name:{width}s} ok ({getattr(be, 'device', 'cpu')})")
    print(auto_summary() + (f"; {ENV_VAR}={os.environ[ENV_VAR]} overrides it"
                            if os.environ.get(ENV_VAR) else ""))
    return 0


def cmd_compile(args) -> int:
    try:
        get_backend("numba")
    except MinillamaError as e:
        raise MinillamaError(f"compile: the numba backend cannot run here: {e}") from None
    print(f"compiled (or loaded) in {precompile():.1f} s")
    return 0


class _Size:
    """A stand-in config of ``n`` parameters: all :func:`auto_backend` reads of a config."""

    def __init__(self, n: int):
        self.n = n

    def n_params(self) -> int:
        return self.n


def auto_summary() -> str:
    """What ``auto`` picks here, asked of :func:`auto_backend` itself for each kind of model."""
    m = AUTO_REFERENCE_MAX_PARAMS
    small, large = _Size(m), _Size(m + 1)
    return (f"default: auto, which picks by the model: a quantized model (weights in GGML "
            f"blocks, e.g. a Q4 GGUF file): {auto_backend(small, quantized=True)}; a float model "
            f"of more than {m / 1e6:g}M parameters: {auto_backend(large)}; a smaller one: "
            f"{auto_backend(small)}; training and fine-tuning: {auto_backend(large, 'train')}")


def _chosen(spec: str) -> list[str]:
    if spec == "all":
        names = []
        for name in backend_names():
            try:
                get_backend(name)
            except MinillamaError:
                continue
            names.append(name)
        return names
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        get_backend(name)  # clear error for unknown or unavailable backends
    return names


def _best(fn, repeats: int, sync) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def cmd_bench(args) -> int:
    names = _chosen(args.backend)
    cfg = ModelConfig(**SHAPES[args.shape])
    if args.seq > cfg.max_seq_len or args.decode_tokens >= cfg.max_seq_len:
        raise MinillamaError(f"--seq and --decode-tokens must fit the context {cfg.max_seq_len}")
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    x, y = tok[:, :-1], tok[:, 1:]
    print(f"shape {args.shape}: {cfg.n_params() / 1e6:.2f}M params, train step B={args.batch} "
          f"T={args.seq}, decode {args.decode_tokens} tokens at B=1")
    print("| backend | train tok/s | decode tok/s | max |dlogits| vs numpy "
          "| max |dgrad| vs numpy |")
    print("|---|---|---|---|---|")
    ref_logits = ref_grads = None
    for name in names:
        be = get_backend(name)
        model = Transformer(cfg, params, backend=be)
        loss, grads = model.loss_and_grads(x, y)  # warm-up (and Numba compilation)
        t_train = _best(lambda model=model: model.loss_and_grads(x, y), args.repeats,
                        be.synchronize)

        def decode(model=model, be=be):
            cache = model.new_cache(1, args.decode_tokens + 1)
            t = np.array([[1]])
            for pos in range(args.decode_tokens):
                logits = model.forward(t, pos, cache, last_only=True)
                t = np.asarray(be.to_numpy(logits.argmax(-1))).reshape(1, 1)

        decode()
        t_dec = _best(decode, args.repeats, be.synchronize)
        logits = be.to_numpy(model.forward(x[:1]))
        g = {k: be.to_numpy(v) for k, v in grads.items()}
        if ref_logits is None:
            ref_logits, ref_grads = logits, g
            d_logits = d_grads = 0.0
        else:
            d_logits = float(np.abs(logits - ref_logits).max())
            d_grads = max(float(np.abs(g[k] - ref_grads[k]).max()) for k in g)
        print(f"| {name} | {args.batch * args.seq / t_train:,.0f} | "
              f"{args.decode_tokens / t_dec:,.1f} | {d_logits:.2e} | {d_grads:.2e} |")
    return 0
