"""Compile ahead of time the kernels that ``generate``, ``chat`` and ``serve`` run, into the
backend's disk cache, so that a first answer does not wait for the compiler (``minillama
compile``; an editable install runs it too, see ``build_hooks.py`` at the repository's root).

Numba compiles a kernel for the types of its arguments (array dtypes, layouts, read-only flags),
not for their sizes, and keys its disk cache on them and on the host's CPU. So a model of the
same kind as a real one, but tiny, run through the same warm-ups as the commands (loaded by the
same loader: a GGUF file of block-quantized matrices and the float model that ships), compiles
every kernel a real model of that kind needs: afterwards `generate`, `chat` and `serve` on, say,
SmolLM2-135M-Instruct Q4_1 load their kernels from the cache, with ``--exact`` too (a test
holds every kernel and signature the real model's commands compile to be among those compiled
here). The GGML type
of each matrix is an argument of the kernels, not a type, so one file with a mix of block types
covers them all.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from minillama.backends import get_backend
from minillama.core.config import ModelConfig
from minillama.core.sampling import SamplingParams
from minillama.infer.engine import Engine
from minillama.infer.generate import _warm_steps, warm_prefill, warm_verify
from minillama.io.gguf import save_gguf
from minillama.io.load import load_model
from minillama.model.transformer import Transformer, init_params

#: the block types of the file, one per linear weight of a layer (blocks of 32 and K
#: super-blocks of 256) and for the embedding; the classifier ties to it
MATRIX_TYPES = {"wq": "Q4_0", "wk": "Q4_1", "wv": "Q8_0", "wo": "Q5_0", "w1": "Q4_K",
                "w2": "Q6_K", "w3": "Q5_1"}
EMBEDDING_TYPE = "Q8_0"


def tiny_quantized_config() -> ModelConfig:
    """A model whose rows are whole K super-blocks (256), with grouped-query attention, a
    context long enough for the server's warm-up (:func:`~minillama.infer.generate.warm_prefill`)
    and rows wide enough that its prompts cross the sizes from which row operations and RoPE
    split over threads (as those of a 135M model do)."""
    return ModelConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=320,
                       hidden_dim=1024, max_seq_len=320, tie_embeddings=True)


def write_tiny_gguf(path) -> Path:
    """A GGUF file of :func:`tiny_quantized_config`'s shape, random weights in the block types of
    :data:`MATRIX_TYPES` and :data:`EMBEDDING_TYPE` (no tokenizer)."""
    cfg = tiny_quantized_config()
    params = init_params(cfg, seed=0)
    types = {name: MATRIX_TYPES[name.split(".")[-2]] for name in params
             if name.split(".")[-2] in MATRIX_TYPES}
    types["tok_embeddings.weight"] = EMBEDDING_TYPE
    return save_gguf(path, cfg, params, matrix_type="F32", types=types)


def warm_model(model) -> None:
    """The warm-ups of ``generate`` and ``chat`` (a prompt, greedy steps, a drafts' verification)
    and of ``serve`` (its engine's first request, then long prompts and batches on the engine's
    thread), on ``model``."""
    _warm_steps(model, list(range(1, 40)), SamplingParams(temperature=0.0))
    engine = Engine(model)
    try:
        engine.generate([0], max_tokens=2)
        engine.run_in_thread(_warm_serving, model)
    finally:
        engine.close()


def warm_exact(model) -> None:
    """The steps of ``generate --exact`` and ``chat --exact`` on ``model``: float32 products
    (``MINILLAMA_QUANT_DOTS=float``) and a float32 KV cache; the environment and the model's
    cache setting as they were after it."""
    before, kind = os.environ.get("MINILLAMA_QUANT_DOTS"), model.kv_cache
    os.environ["MINILLAMA_QUANT_DOTS"], model.kv_cache = "float", "f32"
    try:
        _warm_steps(model, list(range(1, 40)), SamplingParams(temperature=0.0))
        # a short prompt: products of few rows, on all threads past a size (a real model's head)
        model.forward(np.arange(1, 9)[None], 0, model.new_cache(1, 16), last_only=True)
    finally:
        model.kv_cache = kind
        if before is None:
            os.environ.pop("MINILLAMA_QUANT_DOTS", None)
        else:
            os.environ["MINILLAMA_QUANT_DOTS"] = before


def _warm_serving(model) -> None:
    warm_prefill(model)
    warm_verify(model)


def precompile(say=print) -> float:
    """Compile (or load) the numba kernels of a GGUF model with block-quantized matrices and of
    a float32 model of the same shape; ``say`` gets one line for each. The kernel of several
    decode rows compiles here, not in the worker process a command would start for it. Returns
    the seconds spent."""
    backend = get_backend("numba")
    t0 = time.perf_counter()
    own = vars(backend).get("compile_in_background", _UNSET)  # the instance's own, if any
    backend.compile_in_background = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_tiny_gguf(Path(tmp) / "tiny.gguf")
            t = time.perf_counter()
            model, _ = load_model(path, backend=backend)
            warm_model(model)
            say(f"numba: kernels of GGUF block-quantized models ready "
                f"({time.perf_counter() - t:.1f} s)")
            t = time.perf_counter()
            warm_exact(model)
            say(f"numba: their kernels with --exact ready ({time.perf_counter() - t:.1f} s)")
        t = time.perf_counter()
        cfg = tiny_quantized_config()
        warm_model(Transformer(cfg, init_params(cfg, seed=0), backend=backend))
        say(f"numba: kernels of float32 models ready ({time.perf_counter() - t:.1f} s)")
    finally:
        if own is _UNSET:
            del backend.compile_in_background
        else:
            backend.compile_in_background = own
    return time.perf_counter() - t0


_UNSET = object()
