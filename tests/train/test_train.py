"""The training loop: overfitting, a short real run, exact resume, atomic checkpoints, NaN stop,
gradient accumulation, export, and one-line CLI errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import load_checkpoint, read_safetensors
from minillama.io.data import prepare_text_file, shakespeare_documents
from minillama.model.transformer import Transformer
from minillama.train.optim import AdamW, clip_grad_norm
from minillama.train.trainer import CKPT_NAME, PLOT_NAME, TrainConfig, Trainer, TrainingDiverged

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, context=32, batch_size=4,
            eval_iters=2, warmup=2, lr=3e-3, min_lr=3e-4)


@pytest.fixture(scope="module")
def play_txt(tmp_path_factory):
    """Hamlet as a plain text file (about 170 kB)."""
    path = tmp_path_factory.mktemp("corpus") / "hamlet.txt"
    path.write_text(dict(shakespeare_documents())["hamlet_gut.txt"], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def play_data(play_txt, tmp_path_factory):
    return prepare_text_file(play_txt, tmp_path_factory.mktemp("prepared"))


def _trainer(play_data, out, backend=None, **kw):
    tc = TrainConfig(**{**TINY, "out": str(out), "data": str(play_data), **kw})
    if backend is not None:
        tc.backend = backend.name
    return Trainer(tc, progress=False)


def _error_lines(err: str) -> list[str]:
    """The error report of a failed command: exactly its ``minillama:`` lines (the progress
    lines ``model: ...``/``data: ...`` may precede it); never a traceback."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("minillama:")]
    assert errors and lines[-1] == errors[-1], err
    return errors


def _run_cli(capsys, *argv):
    rc = cli.main(["train", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --- learning ----------------------------------------------------------------------------------
def test_overfits_a_single_batch(backend):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, max_seq_len=32)
    model = Transformer(cfg, backend=backend, seed=0, dtype=np.float32)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    w = np.random.default_rng(0).integers(0, 258, (4, 33))
    x, y = w[:, :-1], w[:, 1:]
    first = None
    for _ in range(200):
        loss, grads = model.loss_and_grads(x, y)
        first = loss if first is None else first
        clip_grad_norm(grads, 1.0)
        opt.step(grads)
    assert first > 5.0  # ~ln(258) at initialisation
    assert model.loss(x, y) < 0.05


def test_short_run_lowers_validation_loss(play_txt, tmp_path, capsys):
    out = tmp_path / "run"
    rc, stdout, _ = _run_cli(
        capsys, "--data", str(play_txt), "--out", str(out), "--dim", "64", "--n-layers", "2",
        "--n-heads", "4", "--n-kv-heads", "2", "--context", "64", "--batch-size", "8",
        "--steps", "120", "--warmup", "10", "--lr", "4e-3", "--min-lr", "4e-4",
        "--eval-interval", "60", "--eval-iters", "4")
    assert rc == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 120 and summary["tokens_seen"] == 120 * 8 * 64
    _, _, meta = load_checkpoint(out / CKPT_NAME)
    val = meta["train_state"]["history"]["val"]
    assert [s for s, _ in val] == [0, 60, 120]
    assert val[0][1] > 5.0
    assert val[-1][1] < val[0][1] - 2.2, val  # from ~5.5 nats to below ~3.3
    assert (out / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- resume ------------------------------------------------------------------------------------
def test_resume_is_bit_for_bit(play_data, tmp_path, backend):
    kw = dict(steps=8, grad_accum=2, eval_interval=3, seed=5)
    straight = _trainer(play_data, tmp_path / "a", backend, **kw)
    straight.train()

    first = _trainer(play_data, tmp_path / "b", backend, **kw)
    first.train(stop_at=4)
    assert first.step == 4
    second = _trainer(play_data, tmp_path / "b", backend, **kw)
    second.resume()
    assert second.step == 4
    second.train()

    _, pa, ma = load_checkpoint(tmp_path / "a" / CKPT_NAME, with_extras=True)
    _, pb, mb = load_checkpoint(tmp_path / "b" / CKPT_NAME, with_extras=True)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    assert ma["tensors"].keys() == mb["tensors"].keys() and len(ma["tensors"]) == 2 * len(pa)
    for k in ma["tensors"]:
        np.testing.assert_array_equal(ma["tensors"][k], mb["tensors"][k], err_msg=k)
    sa, sb = ma["train_state"], mb["train_state"]
    assert sa["history"] == sb["history"]  # identical train and val losses, step by step
    assert sa["data"] == sb["data"] and sa["optim_step"] == sb["optim_step"] == 8


def test_cli_resume_matches_straight_run(play_data, tmp_path, capsys):
    common = ["--data", str(play_data), "--dim", "32", "--n-layers", "2", "--n-heads", "4",
              "--n-kv-heads", "2", "--context", "32", "--batch-size", "4", "--steps", "6",
              "--warmup", "2", "--eval-interval", "2", "--eval-iters", "2"]
    assert _run_cli(capsys, *common, "--out", str(tmp_path / "a"))[0] == 0
    assert _run_cli(capsys, *common, "--out", str(tmp_path / "b"), "--stop-at", "3")[0] == 0
    _, _, mid = load_checkpoint(tmp_path / "b" / CKPT_NAME)
    assert mid["train_state"]["step"] == 3
    assert _run_cli(capsys, "--resume", "--out", str(tmp_path / "b"))[0] == 0
    _, pa, ma = load_checkpoint(tmp_path / "a" / CKPT_NAME)
    _, pb, mb = load_checkpoint(tmp_path / "b" / CKPT_NAME)
    assert ma["train_state"]["history"] == mb["train_state"]["history"]
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k])


def test_grad_accumulation_equals_one_big_batch(play_data, tmp_path):
    """Two micro-batches of 4 give the same update as one batch of their 8 windows."""
    acc = _trainer(play_data, tmp_path / "acc", batch_size=4, grad_accum=2, grad_clip=0.0)
    big = _trainer(play_data, tmp_path / "big", batch_size=8, grad_accum=1, grad_clip=0.0)
    x, y = big.data.train_batch(8)
    halves = iter([(x[:4], y[:4]), (x[4:], y[4:])])
    acc.data.train_batch = lambda bs: next(halves)
    big.data.train_batch = lambda bs: (x, y)
    la, _, _ = acc.train_step()
    lb, _, _ = big.train_step()
    assert la == pytest.approx(lb, rel=1e-5)
    for k in big.model.params:
        np.testing.assert_allclose(acc.opt.m[k], big.opt.m[k], rtol=1e-4, atol=1e-9, err_msg=k)
        np.testing.assert_allclose(acc.model.params[k], big.model.params[k], rtol=1e-5,
                                   atol=1e-6, err_msg=k)


# --- checkpoints -------------------------------------------------------------------------------
def test_interrupted_checkpoint_write_keeps_the_previous_one(play_data, tmp_path, monkeypatch):
    tr = _trainer(play_data, tmp_path / "run", steps=6, eval_interval=3)
    tr.train(stop_at=3)
    ckpt = tmp_path / "run" / CKPT_NAME
    before = ckpt.read_bytes()
    _, saved, _ = load_checkpoint(ckpt)
    tr.train_step()  # the in-memory model moves on

    import safetensors.numpy

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # half a file, then the "crash"
            f.write(b"\x00" * 1000)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken_save)
    with pytest.raises(OSError, match="simulated"):
        tr.save()
    assert ckpt.read_bytes() == before
    _, params, meta = load_checkpoint(ckpt)
    assert meta["train_state"]["step"] == 3
    for k in params:
        np.testing.assert_array_equal(params[k], saved[k])
    assert sorted(p.name for p in ckpt.parent.iterdir() if p.name.endswith(".tmp")) == []


def test_nan_loss_stops_with_last_good_checkpoint(play_data, tmp_path, capsys, monkeypatch):
    calls = {"n": 0}
    real = Transformer.loss_and_grads

    def flaky(self, tokens, targets, ignore_index=-1):
        loss, grads = real(self, tokens, targets, ignore_index)
        calls["n"] += 1
        return (float("nan") if calls["n"] >= 5 else loss), grads

    monkeypatch.setattr(Transformer, "loss_and_grads", flaky)
    out = tmp_path / "run"
    rc, _, err = _run_cli(capsys, "--data", str(play_data), "--out", str(out), "--dim", "32",
                          "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                          "--context", "32", "--batch-size", "4", "--steps", "10",
                          "--eval-interval", "2", "--eval-iters", "2")
    assert rc == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("minillama: error: training diverged")
    assert "step 5" in lines[0] and "kept" in lines[0]
    _, params, meta = load_checkpoint(out / CKPT_NAME)  # finite, readable
    assert meta["train_state"]["step"] == 4


def test_nan_before_any_checkpoint(play_data, tmp_path, monkeypatch):
    tr = _trainer(play_data, tmp_path / "run", steps=4, eval_interval=2)
    monkeypatch.setattr(tr.model, "loss_and_grads", lambda x, y: (float("inf"), {}))
    with pytest.raises(TrainingDiverged, match="no checkpoint was written"):
        tr.train()


def test_export_float16_model(play_data, tmp_path, capsys):
    out = tmp_path / "run"
    exp = tmp_path / "model.safetensors"
    rc, _, _ = _run_cli(capsys, "--data", str(play_data), "--out", str(out), "--dim", "32",
                        "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                        "--context", "32", "--batch-size", "4", "--steps", "3",
                        "--eval-interval", "3", "--eval-iters", "2", "--export", str(exp))
    assert rc == 0
    tensors, raw = read_safetensors(exp)
    assert all(v.dtype == np.float16 for v in tensors.values())
    assert not any(k.startswith("optim.") for k in tensors)
    assert exp.stat().st_size < 0.3 * (out / CKPT_NAME).stat().st_size
    cfg, p16, meta = load_checkpoint(exp)
    assert meta["tokenizer"] == {"type": "byte"} and meta["train_summary"]["step"] == 3
    _, p32, _ = load_checkpoint(out / CKPT_NAME)
    m16 = Transformer(cfg, p16, dtype=np.float32)
    m32 = Transformer(cfg, p32, dtype=np.float32)
    tok = np.arange(20)[None] % 258
    np.testing.assert_allclose(m16.forward(tok), m32.forward(tok), atol=2e-2)


def test_config_file_and_flag_precedence(play_data, tmp_path, capsys):
    toml = tmp_path / "cfg.toml"
    toml.write_text(f'data = "{play_data}"\nout = "{tmp_path / "run"}"\ndim = 32\nn_layers = 1\n'
                    'n_heads = 4\nn_kv_heads = 1\ncontext = 16\nbatch_size = 2\nsteps = 5\n'
                    'eval_interval = 2\neval_iters = 1\nlr = 1\n')  # int lr is read as a float
    rc, stdout, _ = _run_cli(capsys, "--config", str(toml), "--steps", "3")
    assert rc == 0
    cfg, _, meta = load_checkpoint(tmp_path / "run" / CKPT_NAME)
    st = meta["train_state"]
    assert st["step"] == 3 and st["config"]["steps"] == 3 and st["config"]["lr"] == 1.0
    assert (cfg.dim, cfg.n_layers, cfg.n_kv_heads, cfg.max_seq_len) == (32, 1, 1, 16)
    js = tmp_path / "cfg.json"
    js.write_text(json.dumps({"train": {**json.loads(json.dumps(st["config"])),
                                        "out": str(tmp_path / "run2"), "steps": 2}}))
    assert _run_cli(capsys, "--config", str(js))[0] == 0
    assert load_checkpoint(tmp_path / "run2" / CKPT_NAME)[2]["train_state"]["step"] == 2


def test_prepare_data_command(play_txt, tmp_path, capsys):
    rc = cli.main(["prepare-data", "--data", str(play_txt), "--out", str(tmp_path / "p")])
    out, _ = capsys.readouterr()
    assert rc == 0 and "train tokens" in out
    assert (tmp_path / "p" / "train.bin").stat().st_size > 0
    assert (tmp_path / "p" / "val.bin").stat().st_size > 0


# --- bad input: one line, non-zero exit ---------------------------------------------------------
def _bad_cases(tmp_path, play_data):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be.\nThat is the question.\n")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"dimm": 64}))
    neg = tmp_path / "neg.toml"
    neg.write_text("lr = -0.1\n")
    wrong_type = tmp_path / "wrong.json"
    wrong_type.write_text(json.dumps({"steps": "ten"}))
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    out = ["--out", str(tmp_path / "o")]
    d = ["--data", str(play_data)]
    return [
        (["--data", str(tmp_path / "missing.txt"), *out], "data file not found"),
        (["--data", str(empty), *out], "is empty"),
        (["--data", str(small), "--context", "256", *out], "context 256 is longer than"),
        (["--config", str(unknown), *d, *out], "unknown field(s) dimm"),
        (["--config", str(neg), *d, *out], "lr must be"),
        (["--config", str(wrong_type), *d, *out], "steps must be a positive integer"),
        (["--config", str(broken), *d, *out], "cannot parse config file"),
        (["--config", str(tmp_path / "none.toml"), *d, *out], "config file not found"),
        (["--dim", "30", "--n-heads", "4", *d, *out], "dim % n_heads"),
        (["--n-heads", "6", "--n-kv-heads", "4", *d, *out], "n_heads % n_kv_heads"),
        (["--lr", "1e-4", "--min-lr", "1e-3", *d, *out], "min_lr"),
        (["--backend", "tpu", *d, *out], "unknown backend"),
        (["--resume", *out], "no checkpoint"),
    ]


def test_bad_input_is_one_clear_line(play_data, tmp_path, capsys):
    for argv, expected in _bad_cases(tmp_path, play_data):
        rc, _, err = _run_cli(capsys, *argv)
        lines = _error_lines(err)
        assert rc == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("minillama: error: "), (argv, err)
        assert expected in lines[0], (argv, lines[0])
    assert not (tmp_path / "o" / CKPT_NAME).exists()


def test_resume_rejects_a_different_model(play_data, tmp_path, capsys):
    base = ["--data", str(play_data), "--out", str(tmp_path / "r"), "--dim", "32",
            "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2", "--context", "16",
            "--batch-size", "2", "--steps", "2", "--eval-interval", "2", "--eval-iters", "1"]
    assert _run_cli(capsys, *base)[0] == 0
    rc, _, err = _run_cli(capsys, "--resume", "--out", str(tmp_path / "r"), "--dim", "64")
    assert rc == 2 and "dim=32" in err and len(_error_lines(err)) == 1


# --- the shipped default model ------------------------------------------------------------------
def test_shipped_default_checkpoint():
    """The model `minillama generate` runs by default: small, GQA, float16 on disk, and it
    predicts the held-out plays at <= 1.6 nats per byte (the full split gave 1.4636)."""
    from minillama.io.data import VAL_PLAYS, encode_documents, shakespeare_documents
    from minillama.io.load import DEFAULT_CHECKPOINT

    assert DEFAULT_CHECKPOINT.is_file()
    assert DEFAULT_CHECKPOINT.stat().st_size < 8e6
    tensors, _ = read_safetensors(DEFAULT_CHECKPOINT)
    assert all(v.dtype == np.float16 for v in tensors.values())
    cfg, params, meta = load_checkpoint(DEFAULT_CHECKPOINT)
    assert meta["tokenizer"] == {"type": "byte"} and cfg.vocab_size == 258
    assert cfg.n_params() <= 5_000_000 and cfg.n_kv_heads < cfg.n_heads
    model = Transformer(cfg, params, dtype=np.float32)
    docs = dict(shakespeare_documents())
    val = encode_documents([docs[p] for p in VAL_PLAYS]).astype(np.int64)
    T = cfg.max_seq_len
    starts = np.linspace(0, val.size - T - 1, 32).astype(np.int64)
    w = val[starts[:, None] + np.arange(T + 1)[None, :]]
    losses = [model.loss(w[i:i + 8, :-1], w[i:i + 8, 1:]) for i in range(0, 32, 8)]
    assert float(np.mean(losses)) <= 1.6
