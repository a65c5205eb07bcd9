"""The memory plan of a training step (minillama/train/memplan.py) against what a step really keeps:
the saved-activation estimate against the arrays the forward's tape holds (within 1 %, on each
CPU backend, with and without LoRA and its dropout), the whole step's peak allocation (tracemalloc)
against the plan's bounds, LoRA keeping no gradient or AdamW state for frozen weights, the measured
runtime part, and :func:`~minillama.train.memplan.settle` holding a plan to ``--max-memory``
(recompute turned on when it alone fits, else one error line naming the largest batch and context
that fit). The plan against a whole run's measured peak is tests/train/test_max_memory.py."""

from __future__ import annotations

import re
import tracemalloc

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.model.lora import LoRA, LoRAConfig
from minillama.model.transformer import Transformer
from minillama.train import memplan
from minillama.train.optim import AdamW

CFG = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=128)
BACKENDS = ["reference", "numpy", "numba"]


def _backend_or_skip(name):
    if name == "numba":
        pytest.importorskip("numba")
    return name


def tape_bytes(model, x, y) -> int:
    """Bytes of every array the training forward keeps for the backward (the blocks' tape, the
    loss head's ctx, the ids), each buffer once, weights left out."""
    be = model.backend
    B, T = x.shape
    if model.lora is not None:
        model.lora.training = True
    try:
        hn, tape = model._run(x, 0, None, train=True, head=False)
        _, c = be.linear_cross_entropy_forward(hn.reshape(B * T, -1), model.output_weight,
                                               be.asarray(y.reshape(-1)), -1)
    finally:
        if model.lora is not None:
            model.lora.training = False
    return memplan.saved_bytes([tape, c, x, y], exclude=memplan.model_buffers(model))


def _model(backend, lora=None, ffn="swiglu", seed=0):
    m = Transformer(ModelConfig(**CFG, ffn=ffn), backend=_backend_or_skip(backend), seed=seed)
    if lora is not None:
        LoRA(m, LoRAConfig(rank=4, dropout=lora, targets=("q", "v", "o", "gate", "down")),
             seed=1).attach(m)
    return m


def _batch(B=3, T=40, V=300):
    rng = np.random.default_rng(0)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lora", [None, 0.0, 0.1], ids=["full", "lora", "lora-dropout"])
def test_activation_estimate_matches_the_tape(backend, lora):
    m = _model(backend, lora)
    x, y = _batch()
    measured = tape_bytes(m, x, y)
    est = memplan.activation_bytes(m, *x.shape)
    assert abs(est - measured) <= 0.01 * measured, (est, measured)


@pytest.mark.parametrize("ffn", ["gelu", "relu"])
def test_activation_estimate_two_matrix_ffn(ffn):
    m = _model("reference", ffn=ffn)
    x, y = _batch()
    measured = tape_bytes(m, x, y)
    assert abs(memplan.activation_bytes(m, *x.shape) - measured) <= 0.01 * measured


@pytest.mark.parametrize("backend", ["reference", "numpy"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step_peak_lies_within_the_plan(backend, lora):
    """tracemalloc (NumPy reports its buffers to it) over one loss_and_grads: the peak holds at
    least the saved activations and at most activations + workspace + gradients."""
    m = _model(backend, 0.0 if lora else None)
    trainable = m.lora.params if lora else m.params
    x, y = _batch(4, 64)
    m.loss_and_grads(x, y)  # warm: buffers a backend keeps from step to step exist already
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        m.loss_and_grads(x, y)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    p = memplan.plan(m, trainable, 4, 64)
    assert p.activations <= peak <= p.activations + p.workspace + p.gradients, (peak, p)


def test_lora_keeps_no_gradient_or_adamw_state_for_frozen_weights():
    m = _model("reference", 0.0)
    x, y = _batch()
    _, grads = m.loss_and_grads(x, y)
    assert set(grads) == set(m.lora.params)  # no base weight, norm or embedding gradient
    opt = AdamW(m.lora.params, lr=1e-3)
    assert set(opt.m) == set(opt.v) == set(m.lora.params)
    p = memplan.plan(m, m.lora.params, *x.shape)
    adapters = sum(v.nbytes for v in m.lora.params.values())
    assert p.gradients == adapters and p.optimizer == 2 * adapters
    full = memplan.plan(m, m.params, *x.shape)
    assert full.gradients == sum(v.nbytes for v in m.params.values()) > 10 * p.gradients
    assert "no gradient, no AdamW state" in p.lines()[0]


def test_quantized_weights_count_at_their_block_size():
    from minillama.core.quantize import quantize

    m = _model("reference")
    w = m.params["layers.0.feed_forward.w1.weight"]
    q = quantize(np.asarray(w, dtype=np.float32), "Q8_0")
    before = memplan.plan(m, {}, 1, 8).weights
    m.params["layers.0.feed_forward.w1.weight"] = q
    after = memplan.plan(m, {}, 1, 8).weights
    assert after - before == q.nbytes - w.nbytes and q.nbytes < w.nbytes / 3


def test_grad_accum_holds_two_gradients_and_recompute_shrinks_activations():
    m = _model("reference")
    one, two = memplan.plan(m, m.params, 2, 64), memplan.plan(m, m.params, 2, 64, grad_accum=4)
    assert two.gradients == 2 * one.gradients
    rec = memplan.plan(m, m.params, 2, 64, recompute=True)
    L, N, D = m.cfg.n_layers, 2 * 64, m.cfg.dim
    assert rec.activations == one.activations - (L - 1) * memplan.block_saved(m, 2, 64) \
        + L * N * D * 4


def test_parse_size():
    assert memplan.parse_size("8G") == 8 * 1024 ** 3
    assert memplan.parse_size("512MiB") == 512 * 1024 ** 2
    assert memplan.parse_size("1.5k") == 1536
    assert memplan.parse_size("100") == 100
    for bad in ("lots", "-1G", "0", "3X"):
        with pytest.raises(MinillamaError, match="--max-memory"):
            memplan.parse_size(bad)


def test_the_runtime_part_is_the_resident_memory_the_other_parts_do_not_hold():
    m = _model("reference", 0.0)
    p = memplan.plan(m, m.lora.params, 2, 64)
    held = p.weights + p.adapters + p.optimizer
    q = memplan.plan(m, m.lora.params, 2, 64, resident=held + 5_000_000)
    assert p.runtime == 0 and q.runtime == 5_000_000 and q.total == p.total + 5_000_000
    assert "runtime 4.77 MiB + weights" in q.lines()[0] and "runtime" not in p.lines()[0]
    assert memplan.plan(m, m.lora.params, 2, 64, resident=held // 2).runtime == 0
    assert memplan.resident_bytes() is None or memplan.resident_bytes() > 10 * 1024 ** 2


def _settle(m, limit, B=4, T=64, recompute=False, **kw):
    said = []
    p = memplan.settle(m, m.params, B, T, 1, recompute, limit, said.append, **kw)
    return p, said


def test_settle_prints_the_plan_and_keeps_one_that_fits(monkeypatch):
    monkeypatch.setattr(memplan, "resident_bytes", lambda: 50 * 1024 ** 2)
    m = _model("reference")
    full = memplan.plan(m, m.params, 4, 64, resident=50 * 1024 ** 2)
    p, said = _settle(m, full.total)
    assert p == full and said == full.lines()


def test_settle_turns_recompute_on_when_that_alone_fits_and_says_so(monkeypatch):
    monkeypatch.setattr(memplan, "resident_bytes", lambda: 50 * 1024 ** 2)
    m = _model("reference")
    plain = memplan.plan(m, m.params, 4, 64, resident=50 * 1024 ** 2)
    rec = memplan.plan(m, m.params, 4, 64, recompute=True, resident=50 * 1024 ** 2)
    p, said = _settle(m, rec.total)
    assert p == rec and (p.B, p.T) == (4, 64)
    assert len(said) == 2 and "--recompute turned on" in said[0] and said[1] == rec.lines()[0]
    assert plain.total > rec.total


def test_settle_refuses_in_one_line_naming_the_largest_batch_and_context_that_fit(monkeypatch):
    monkeypatch.setattr(memplan, "resident_bytes", lambda: 50 * 1024 ** 2)
    m = _model("reference")

    def total(B, T, rec=False, accum=1):
        return memplan.plan(m, m.params, B, T, accum, rec, resident=50 * 1024 ** 2).total

    limit = (total(4, 64, accum=2) + total(5, 64, accum=2)) // 2  # B = 4 fits, 5 does not
    assert total(16, 64, rec=True) > limit
    with pytest.raises(MinillamaError) as e:
        _settle(m, limit, B=16)
    line = str(e.value)
    assert "\n" not in line and line.startswith("the memory plan, ")
    assert "what fits: --batch-size 4 --grad-accum 4 (the same 16 examples a step, " in line
    t = int(re.search(r"or --context (\d+) ", line).group(1))
    assert total(16, t) <= limit < total(16, t + 1)
    b = re.search(r"--recompute --batch-size (\d+)", line)
    assert b is not None and total(int(b.group(1)), 64, True, 2) <= limit \
        < total(int(b.group(1)) + 1, 64, True, 2)
    # a context that would drop every record is not offered
    with pytest.raises(MinillamaError) as e:
        _settle(m, limit, B=16, shorter=lambda t: None)
    assert "--context" not in str(e.value) and "--batch-size 4" in str(e.value)
    with pytest.raises(MinillamaError, match="nothing fits: the runtime, weights, gradients and "
                                             "AdamW alone take"):
        _settle(m, 1000)


def test_settle_without_a_limit_warns_when_the_step_needs_more_than_is_free(monkeypatch):
    m = _model("reference")
    monkeypatch.setattr(memplan, "available_bytes", lambda backend: 1000)
    p, said = _settle(m, None)
    assert len(said) == 2 and said[1].startswith("memory plan: the step needs") \
        and "try --recompute" in said[1]
    monkeypatch.setattr(memplan, "available_bytes", lambda backend: 1 << 40)
    assert len(_settle(m, None)[1]) == 1


def test_train_refuses_a_bad_max_memory_in_one_line(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 400)
    common = ["train", "--data", str(text), "--dim", "32", "--n-layers", "2", "--n-heads", "2",
              "--n-kv-heads", "1", "--context", "32", "--batch-size", "2", "--steps", "1",
              "--eval-iters", "1", "--no-progress", "--plot", "false", "--backend", "reference"]
    assert cli.main(common + ["--out", str(tmp_path / "a"), "--max-memory", "1K"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "memory plan:" in err[-2] and err[-1].startswith(
        "minillama: error: the memory plan, ") and "exceeds --max-memory 1.00 KiB" in err[-1]
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--max-memory", "lots"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["minillama: error: --max-memory: cannot read 'lots' (e.g. 8G, 512M, "
                     "2.5GiB)"]
