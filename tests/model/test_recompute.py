"""Gradient checkpointing (``--recompute``, minillama/model/recompute.py): the forward keeps only
each block's input and the backward rebuilds one block at a time. The gradients are those of the
plain backward bit for bit (same backend), with LoRA (its dropout masks replayed) and full training,
on the model's variants; the arrays kept by the forward shrink to the block inputs (measured) and
the step's peak allocation drops; ``minillama finetune --recompute`` writes the same adapter."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.model.lora import LoRA, LoRAConfig
from minillama.model.transformer import Transformer
from minillama.train import memplan
from tests.train.test_memplan import tape_bytes

CFG = dict(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=211, max_seq_len=96)


def _model(backend, lora=None, dtype=np.float32, **variant):
    if backend == "numba":
        pytest.importorskip("numba")
    m = Transformer(ModelConfig(**CFG, **variant), backend=backend, dtype=dtype, seed=0)
    if lora is not None:
        LoRA(m, LoRAConfig(rank=4, dropout=lora), seed=3).attach(m)
        rng = np.random.default_rng(4)
        for v in m.lora.params.values():
            v[...] = rng.standard_normal(v.shape).astype(v.dtype) * 0.05
    return m


def _batch(B=3, T=40):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 211, (B, T))
    y[:, ::5] = -1
    return rng.integers(0, 211, (B, T)), y


def _step(m, x, y, recompute):
    m.recompute = recompute
    rng_before = m.lora.rng.bit_generator.state if m.lora is not None else None
    loss, grads = m.loss_and_grads(x, y)
    rng_after = m.lora.rng.bit_generator.state if m.lora is not None else None
    if m.lora is not None:
        m.lora.rng.bit_generator.state = rng_before  # the next run draws the same masks
    return loss, grads, rng_after


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
@pytest.mark.parametrize("lora", [None, 0.0, 0.1], ids=["full", "lora", "lora-dropout"])
def test_recompute_gradients_are_bit_identical(backend, lora):
    m = _model(backend, lora)
    x, y = _batch()
    loss0, g0, rng0 = _step(m, x, y, False)
    loss1, g1, rng1 = _step(m, x, y, True)
    assert loss0 == loss1 and g0.keys() == g1.keys() and rng0 == rng1
    for k in g0:
        assert np.array_equal(g0[k], g1[k]), k


@pytest.mark.parametrize("variant", [dict(norm_position="post", norm="layernorm"),
                                     dict(ffn="gelu", pos_encoding="sinusoidal"),
                                     dict(logit_scale=0.5, tie_embeddings=False)],
                         ids=["post-layernorm", "gelu-sinusoidal", "logit-scale"])
def test_recompute_on_the_variants(variant):
    m = _model("reference", dtype=np.float64, **variant)
    x, y = _batch(2, 24)
    _, g0, _ = _step(m, x, y, False)
    _, g1, _ = _step(m, x, y, True)
    for k in g0:
        assert np.array_equal(g0[k], g1[k]), k


@pytest.mark.parametrize("backend", ["reference", "numpy"])
def test_recompute_keeps_only_block_inputs_and_lowers_the_peak(backend):
    m = _model(backend, 0.0)
    x, y = _batch(4, 64)
    B, T = x.shape
    kept = {}
    peaks = {}
    for recompute in (False, True):
        m.recompute = recompute
        kept[recompute] = tape_bytes(m, x, y)
        m.loss_and_grads(x, y)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            m.loss_and_grads(x, y)
            peaks[recompute] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        p = memplan.plan(m, m.lora.params, B, T, recompute=recompute)
        assert p.activations <= peaks[recompute] <= p.activations + p.workspace + p.gradients
    L, e = m.cfg.n_layers, 4
    inputs = L * B * T * m.cfg.dim * e
    head = memplan.head_saved(m, B, T)
    assert abs(kept[True] - (inputs + head)) <= 0.01 * kept[True]
    assert kept[True] < 0.5 * kept[False]
    assert peaks[True] < 0.75 * peaks[False]


def test_finetune_recompute_writes_the_same_adapter(tmp_path, capsys):
    """The shipped byte-level model, plain text: with and without --recompute (dropout on), the
    same adapter bit for bit; the memory plan names the mode."""
    from minillama.io.load import DEFAULT_CHECKPOINT

    (tmp_path / "t.txt").write_text("the cat sat on the mat. the dog sat on the log. " * 30)
    common = ["finetune", "-c", str(DEFAULT_CHECKPOINT), "--data", str(tmp_path / "t.txt"),
              "--context", "48", "--steps", "3", "--batch-size", "2", "--eval-interval", "3",
              "--lora-dropout", "0.1", "--lora-targets", "q,v,down", "--no-progress",
              "--backend", "numpy"]
    assert cli.main(common + ["--out", str(tmp_path / "a")]) == 0
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--recompute"]) == 0
    err = capsys.readouterr().err
    assert "recomputing blocks" in err and "(--recompute: block inputs + one block)" in err
    from safetensors.numpy import load_file
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_finetune_bad_max_memory_is_one_line(tmp_path, capsys):
    from minillama.io.load import DEFAULT_CHECKPOINT

    (tmp_path / "t.txt").write_text("abc " * 100)
    rc = cli.main(["finetune", "-c", str(DEFAULT_CHECKPOINT), "--data", str(tmp_path / "t.txt"),
                   "--out", str(tmp_path / "o"), "--max-memory", "12Q", "--recompute"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "minillama: error: --max-memory: cannot read '12Q' (e.g. 8G, 512M, 2.5GiB)"]


def test_train_recompute_writes_the_same_weights(tmp_path, capsys):
    from minillama.io.checkpoint import load_checkpoint

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    common = ["train", "--data", str(text), "--dim", "32", "--n-layers", "2", "--n-heads", "2",
              "--n-kv-heads", "1", "--context", "32", "--batch-size", "2", "--steps", "3",
              "--eval-iters", "1", "--no-progress", "--plot", "false", "--backend", "numpy"]
    assert cli.main(common + ["--out", str(tmp_path / "a")]) == 0
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--recompute"]) == 0
    assert "(--recompute: block inputs + one block)" in capsys.readouterr().err
    _, pa, _ = load_checkpoint(tmp_path / "a" / "ckpt.safetensors")
    _, pb, _ = load_checkpoint(tmp_path / "b" / "ckpt.safetensors")
    assert pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_finetune_pack_cannot_start_on_a_resume(tmp_path, capsys):
    from minillama.io.load import DEFAULT_CHECKPOINT

    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 40)
    assert cli.main(["finetune", "-c", str(DEFAULT_CHECKPOINT), "--data", str(tmp_path / "t.txt"),
                     "--context", "32", "--steps", "2", "--stop-at", "1", "--no-progress",
                     "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    assert cli.main(["finetune", "--out", str(tmp_path / "o"), "--resume", "--pack"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minillama: error: --pack: the run in")
