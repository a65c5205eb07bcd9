"""What the commands say beside their output: a -n cut by the context is noted, a backend that
compiles kernels says so while it does and is warmed up before the timed generation, a finished
run resumed without new steps says how to extend it (and reports its last loss, never NaN)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.core.sampling import SamplingParams
from minillama.infer.generate import warm_prefill, warm_up
from minillama.io.checkpoint import save_checkpoint
from minillama.io.data import prepare_text_file
from minillama.io.load import load_model
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import init_params

CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=ByteTokenizer.vocab_size,
                  hidden_dim=24, max_seq_len=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("msg")
    return save_checkpoint(d / "m.safetensors", CFG, init_params(CFG, seed=2),
                           tokenizer=ByteTokenizer())


def _gen(capsys, *argv):
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_n_past_the_context_is_noted(ckpt, capsys):
    rc, out, err = _gen(capsys, "-c", str(ckpt), "--prompt", "ab", "-n", "1000",
                        "--temperature", "0", "--backend", "numpy")
    assert rc == 0
    # BOS + 2 prompt tokens in a context of 32: 30 more tokens fit
    assert "minillama: note: -n 1000 is cut to 30 new tokens: the model's context is 32 " \
           "tokens and the prompt takes 3" in err
    assert "decode: 29 tokens" in err
    rc, out, err = _gen(capsys, "-c", str(ckpt), "--prompt", "ab", "-n", "30",
                        "--temperature", "0", "--backend", "numpy")
    assert rc == 0 and "note" not in err


@pytest.mark.parametrize("n", ["0", "-3"])
def test_n_below_one_is_refused(ckpt, capsys, n):
    rc, out, err = _gen(capsys, "-c", str(ckpt), "-n", n)
    assert rc == 2 and out == ""
    assert err.strip() == f"minillama: error: -n/--max-new-tokens must be at least 1, got {n}"


def test_warm_up_says_it_compiles_only_on_a_compiling_backend(ckpt):
    said = []
    model, tok = load_model(ckpt, backend="numpy")
    assert warm_up(model, tok.encode("x", bos=True), SamplingParams(), note_after=0.0,
                   say=said.append) == 0.0
    assert said == []
    pytest.importorskip("numba")
    model, tok = load_model(ckpt, backend="numba")
    dt = warm_up(model, tok.encode("x", bos=True), SamplingParams(temperature=1.0, top_p=0.9),
                 note_after=0.0,
                 say=said.append)
    # which of the two depends on the kernel cache: tests/backends/numba/test_warmup.py
    assert dt > 0
    assert said[0] in ("numba: compiling kernels (once, cached) ...",
                       "numba: loading compiled kernels ...")
    assert said[-1].startswith(" done in ") and said[-1].endswith((" s\n", " compiled)\n"))


def test_warm_up_runs_the_prefill_kernels_when_asked(ckpt, monkeypatch):
    """A warm-up runs a few tokens of the prompt only (what the first answer needs); with
    then=warm_prefill (a server) also a 64-token prompt (or the context, if shorter), two padded
    rows at their own positions and a decode step of two rows, so the first long prompt or batch
    does not compile."""
    pytest.importorskip("numba")
    model, tok = load_model(ckpt, backend="numba")
    shapes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k: (
        shapes.append(np.shape(ids)), forward(ids, *a, **k))[1])
    warm_up(model, tok.encode("x", bos=True), SamplingParams(), note_after=1e9, say=lambda t: 0)
    assert all(s[1] <= 8 for s in shapes)
    shapes.clear()
    warm_up(model, tok.encode("x", bos=True), SamplingParams(), note_after=0.0, say=lambda t: 0,
            then=warm_prefill)
    S = model.cfg.max_seq_len
    assert {(1, min(64, S - 1)), (4, min(64, S - 1)), (2, 1)} <= set(shapes)  # prompts, a step
    if S >= 64:
        assert (2, 12) in shapes


def test_generate_on_numba_says_its_warm_up_on_stderr(ckpt, capsys, monkeypatch):
    pytest.importorskip("numba")
    import minillama.cli.generate as g

    real = g.warm_up
    monkeypatch.setattr(g, "warm_up", lambda *a, **k: real(*a, **{**k, "note_after": 0.0}))
    rc, out, err = _gen(capsys, "-c", str(ckpt), "--backend", "numba", "-n", "4", "--seed", "1")
    assert rc == 0
    first, stats = err.strip().splitlines()[-2:]
    assert first.startswith(("numba: compiling kernels (once, cached) ... done in ",
                             "numba: loading compiled kernels ... done in "))
    assert stats.startswith("prefill: ") and "backend numba" in stats


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    (d / "t.txt").write_text("To be, or not to be, that is the question. " * 200)
    data = prepare_text_file(d / "t.txt", d / "data")
    argv = ["train", "--no-progress", "--dim", "16", "--n-layers", "1", "--n-heads", "2",
            "--n-kv-heads", "1", "--context", "16", "--batch-size", "2", "--eval-iters", "1",
            "--steps", "3", "--eval-interval", "3", "--data", str(data), "--out", str(d / "out"),
            "--plot", "false"]
    assert cli.main(argv) == 0
    return d / "out"


def test_resuming_a_finished_run_says_how_to_extend_it(finished_run, capsys):
    capsys.readouterr()
    rc = cli.main(["train", "--no-progress", "--resume", "--out", str(finished_run)])
    out, err = capsys.readouterr()
    assert rc == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps_run"] == 0 and summary["steps"] == 3
    assert summary["final_train_loss"] is not None and summary["final_train_loss"] == \
        summary["final_train_loss"]  # not NaN
    assert "NaN" not in out
    assert (f"the run in {finished_run} is complete: step 3 of --steps 3, nothing to train; to "
            f"extend it pass more steps, e.g. `minillama train --resume --out {finished_run} "
            f"--steps 6`") in err
    rc = cli.main(["train", "--no-progress", "--resume", "--out", str(finished_run),
                   "--steps", "4"])
    out, err = capsys.readouterr()
    assert (rc == 0 and json.loads(out.strip().splitlines()[-1])["steps_run"] == 1
            and "complete" not in err)


# --- warmup scaled to the run, and said ---------------------------------------------------------
def test_warmup_scales_to_a_short_run():
    from minillama.train.optim import lr_at
    from minillama.train.trainer import TrainConfig

    assert TrainConfig().warmup_steps == 100  # the default 2000-step run: as before
    short = TrainConfig(steps=30)
    assert short.warmup_steps == 3
    assert lr_at(short.warmup_steps, short.lr, short.warmup_steps, short.steps,
                 short.min_lr) == pytest.approx(short.lr)  # the peak lr is reached
    assert TrainConfig(steps=30, warmup=50).warmup_steps == 50  # an explicit warmup is kept
    assert TrainConfig(steps=5).warmup_steps == 0


def test_train_says_its_schedule(finished_run, capsys):
    capsys.readouterr()
    rc = cli.main(["train", "--no-progress", "--resume", "--out", str(finished_run),
                   "--steps", "5"])
    err = capsys.readouterr().err
    assert rc == 0
    assert ("schedule: 5 steps, linear warmup over 0 to lr 0.002, cosine decay to 0.0002 "
            "(warmup: min(100, steps // 10); set --warmup)") in err


# --- the auto backend ---------------------------------------------------------------------------
def test_auto_backend_by_model_size_and_type(monkeypatch):
    import minillama.backends as backends
    from minillama.backends import AUTO_REFERENCE_MAX_PARAMS, auto_backend, resolve_name

    monkeypatch.delenv("MINILLAMA_BACKEND", raising=False)
    big = ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=32000)
    assert CFG.n_params() <= AUTO_REFERENCE_MAX_PARAMS < big.n_params()
    assert auto_backend(CFG) == "reference" and auto_backend(big) == "numba"
    assert auto_backend(CFG, quantized=True) == "numba"  # GGML blocks: numba's kernels
    assert auto_backend(CFG, task="train") == "numpy"
    assert auto_backend(big, task="train", quantized=True) == "numpy"
    assert resolve_name(None, CFG) == resolve_name("auto", CFG) == "reference"
    assert resolve_name(None, big) == "numba"
    assert resolve_name(None, CFG, quantized=True) == "numba"
    assert resolve_name(None) == "numpy"  # no model to size: numpy
    monkeypatch.setenv("MINILLAMA_BACKEND", "numba")  # the environment overrides auto
    assert resolve_name(None, CFG) == "numba"
    assert resolve_name("numpy", CFG) == "numpy"  # and a flag overrides the environment
    monkeypatch.setenv("MINILLAMA_BACKEND", "auto")
    assert resolve_name(None, big) == "numba"
    monkeypatch.setattr(backends, "numba_installed", lambda: False)  # no Numba: numpy if large
    assert auto_backend(big) == "numpy" and auto_backend(CFG, quantized=True) == "reference"


def test_load_model_picks_numba_for_a_quantized_file(tmp_path, monkeypatch):
    """A GGUF file whose weights stay in blocks loads on numba under auto, even when small."""
    pytest.importorskip("gguf")
    from minillama.io.gguf import save_gguf
    from minillama.io.load import load_model
    from minillama.model.transformer import init_params

    monkeypatch.delenv("MINILLAMA_BACKEND", raising=False)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=2, vocab_size=64, hidden_dim=64,
                      max_seq_len=16)
    save_gguf(tmp_path / "q.gguf", cfg, init_params(cfg, seed=0), matrix_type="Q8_0")
    save_gguf(tmp_path / "f.gguf", cfg, init_params(cfg, seed=0))
    assert load_model(tmp_path / "q.gguf")[0].backend.name == "numba"
    assert load_model(tmp_path / "f.gguf")[0].backend.name == "reference"


def _ran_on(err: str) -> str:
    """The backend the speed line (the last line of stderr) names: ``backend NAME, N threads``."""
    return re.search(r"backend (\w+), \d+ threads?$", err.strip()).group(1)


def test_generate_defaults_to_auto(ckpt, capsys, monkeypatch):
    monkeypatch.delenv("MINILLAMA_BACKEND", raising=False)
    rc, out, err = _gen(capsys, "-c", str(ckpt), "-n", "3", "--seed", "0")
    assert rc == 0 and _ran_on(err) == "reference"
    monkeypatch.setenv("MINILLAMA_BACKEND", "numpy")
    rc, out, err = _gen(capsys, "-c", str(ckpt), "-n", "3", "--seed", "0")
    assert rc == 0 and _ran_on(err) == "numpy"
    rc, out, err = _gen(capsys, "-c", str(ckpt), "-n", "3", "--seed", "0", "--backend", "auto")
    assert rc == 0 and _ran_on(err) == "reference"


def test_serve_warms_up_on_the_engine_thread(monkeypatch):
    """Every warm-up forward of `serve` (the first request's and warm_prefill's) runs on the
    engine's scheduler thread, the one that serves: Numba's parallel kernels ran 2x slower on an
    OS thread other than the first that ran them (Engine.run_in_thread)."""
    import threading

    from minillama.cli import main as cli
    from minillama.cli import serve as serve_cli

    where = []

    def fake_warm_up(model, ids, run=None, then=None, **kw):  # every backend, no compiling
        run()
        then(model)
        return 0.0

    monkeypatch.setattr(serve_cli, "warm_up", fake_warm_up)
    monkeypatch.setattr(serve_cli, "warm_prefill",
                        lambda model: where.append(threading.current_thread().name))
    args = cli.build_parser().parse_args(["serve", "--backend", "numpy", "--max-context", "64"])
    engine, _, _ = serve_cli.load_engine(args)
    try:
        assert where == ["minillama-engine"]
    finally:
        engine.close()
