"""``minillama generate --cuda-graph`` without a GPU: the flag's validation (one line, status 2,
before any model loads), which models the CUDA-graph decoder takes, and the chunked streaming
loop that drives it (:func:`minillama.backends.cupy.graph.stream_greedy`), run here against an
eager stand-in with the decoder's interface: the same tokens, stop rule and budget as the eager
loop of :func:`minillama.infer.generate.generate_steps`. The graph itself (GraphDecoder on a GPU) is
checked by tests/backends/cupy/test_backend.py, which skips without one.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from minillama.backends.cupy.graph import MAX_BATCH, stream_greedy, unsupported_reason
from minillama.cli.main import main
from minillama.core.config import ModelConfig
from minillama.infer.generate import GenerationStats, generate_steps
from minillama.io.checkpoint import save_checkpoint
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import Transformer, init_params

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=40,
                  max_seq_len=48)


@pytest.fixture
def byte_ckpt(tmp_path):
    return save_checkpoint(tmp_path / "m.safetensors", CFG, init_params(CFG, seed=3),
                           tokenizer=ByteTokenizer())


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("minillama: error: ")
    return err[0]


@pytest.mark.parametrize("argv, needle", [
    (["--cuda-graph", "on"], "--cuda-graph on needs --backend cupy (the backend is numpy)"),
    (["--cuda-graph", "on", "--backend", "numba"], "needs --backend cupy"),
    # refused before the model loads, so no GPU is needed to see it
    (["--cuda-graph", "on", "--backend", "cupy", "--temperature", "0.8"],
     "decodes greedily; use --temperature 0"),
])
def test_cuda_graph_flag_errors_are_one_line(byte_ckpt, capsys, argv, needle):
    rc = main(["generate", "-c", str(byte_ckpt), "-n", "5", "--temperature", "0", *argv])
    assert rc == 2
    assert needle in _err_line(capsys)


def test_cuda_graph_bad_choice_exits_2(byte_ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "-c", str(byte_ckpt), "--cuda-graph", "yes"])
    assert e.value.code == 2
    assert "--cuda-graph: invalid choice: 'yes'" in _err_line(capsys)


def test_auto_and_off_are_the_eager_loop_on_a_cpu_backend(byte_ckpt, capsys):
    outs = []
    for mode in ("auto", "off"):
        rc = main(["generate", "-c", str(byte_ckpt), "--prompt", "To be", "-n", "12",
                   "--temperature", "0", "--cuda-graph", mode])
        out, err = capsys.readouterr()
        assert rc == 0 and "CUDA graph" not in err
        outs.append(out)
    assert outs[0] == outs[1] and outs[0].startswith("To be")


def _fake(cfg=CFG, name="cupy", dtype=np.float32, params=None):
    params = params if params is not None else init_params(cfg, seed=0)
    return types.SimpleNamespace(backend=types.SimpleNamespace(name=name), dtype=np.dtype(dtype),
                                 cfg=cfg, params=params)


def test_which_models_the_graph_decoder_takes():
    assert unsupported_reason(_fake()) is None
    assert unsupported_reason(_fake(), MAX_BATCH) is None
    assert "1 to 8 sequences" in unsupported_reason(_fake(), MAX_BATCH + 1)
    assert "needs the cupy backend (this model is on numpy)" in unsupported_reason(
        Transformer(CFG, backend="numpy", seed=0))
    assert "float32" in unsupported_reason(_fake(dtype=np.float64))
    for variant in (dict(norm="layernorm"), dict(norm_position="post"), dict(ffn="gelu"),
                    dict(pos_encoding="sinusoidal"), dict(logit_scale=0.5)):
        cfg = ModelConfig(**{**CFG.to_dict(), **variant})
        assert "architecture variants" in unsupported_reason(_fake(cfg)), variant
    cfg = ModelConfig(**{**CFG.to_dict(), "qkv_bias": True})
    assert "no biases" in unsupported_reason(_fake(cfg))
    cfg = ModelConfig(**{**CFG.to_dict(), "hidden_dim": 42})
    assert "divisible by 4" in unsupported_reason(_fake(cfg))


class EagerStandIn:
    """The interface of GraphDecoder (prefill / more / room) on the eager KV-cached forward of
    a CPU model: greedy argmax, one cache of ``S`` positions, the same capacity rule."""

    def __init__(self, model, S: int):
        self.model, self.S = model, S
        self.cache = model.new_cache(1, S)
        self.P = self.done = None
        self.calls = []

    def prefill(self, prompt):
        self.P, self.done = prompt.shape[1], 1
        z = self.model.forward(prompt, 0, self.cache, last_only=True)
        self.last = np.argmax(z, axis=-1).astype(np.int64)
        return self.last.copy()

    def room(self):
        return self.S - self.P - self.done + 1

    def more(self, k):
        assert 0 < k <= self.room(), (k, self.room())
        self.calls.append(k)
        ids = []
        for _ in range(k):
            pos = self.P + self.done - 1
            z = self.model.forward(self.last[:, None], pos, self.cache, last_only=True)
            self.last = np.argmax(z, axis=-1).astype(np.int64)
            ids.append(self.last.copy())
            self.done += 1
        return np.stack(ids, axis=1)


@pytest.mark.parametrize("prompt_len, n_new, chunk, stop_at", [
    (5, 30, 16, None),     # plain budget, two chunks
    (5, 30, 4, 9),         # a stop token in the middle of a chunk
    (5, 30, 16, 0),        # the first (prefill) token is a stop token
    (40, 30, 16, None),    # the context (48) ends first: budget 48 - 40 + 1 = 9
    (48, 5, 16, None),     # prompt fills the context: one token from the prefill
    (3, 1, 16, None),      # one token only: no replay at all
])
def test_stream_greedy_matches_the_eager_loop(prompt_len, n_new, chunk, stop_at):
    model = Transformer(CFG, backend="numpy", seed=5)
    prompt = list(np.random.default_rng(prompt_len).integers(0, CFG.vocab_size, prompt_len))
    free = [t for step in generate_steps(model, [prompt], n_new) for _, t in step]
    stop = {free[stop_at]} if stop_at is not None else set()
    ref_stats, got_stats = GenerationStats(), GenerationStats()
    ref = [t for step in generate_steps(model, [prompt], n_new, stop_ids=stop,
                                        stats=ref_stats) for _, t in step]
    S = min(CFG.max_seq_len, prompt_len + n_new)
    dec = EagerStandIn(model, S)
    got = [t for step in stream_greedy(dec, prompt, n_new, CFG.max_seq_len, stop, got_stats,
                                       chunk=chunk) for _, t in step]
    assert got == ref
    if stop_at is None:
        assert len(got) == min(n_new, CFG.max_seq_len - prompt_len + 1)
    assert got_stats.new_tokens == ref_stats.new_tokens == len(got)
    assert got_stats.prompt_tokens == prompt_len
    assert all(k <= chunk for k in dec.calls)
