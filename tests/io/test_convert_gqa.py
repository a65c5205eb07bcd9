"""``minillama convert-gqa`` and ``train --init-from``: the written file, the bad inputs, and an
uptraining start from the converted weights."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import load_checkpoint, save_checkpoint
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import init_params


@pytest.fixture
def mha_ckpt(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=ByteTokenizer.vocab_size,
                      max_seq_len=32)
    params = init_params(cfg, seed=0)
    return save_checkpoint(tmp_path / "mha.safetensors", cfg, params, tokenizer=ByteTokenizer()), \
        params


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, err


def test_convert_gqa_writes_mean_pooled_heads(mha_ckpt, tmp_path, capsys):
    src, params = mha_ckpt
    rc, err = _cli(capsys, "convert-gqa", str(src), str(tmp_path / "gqa.safetensors"),
                   "--n-kv-heads", "2")
    assert rc == 0, err
    cfg, p, meta = load_checkpoint(tmp_path / "gqa.safetensors")
    assert cfg.n_kv_heads == 2 and cfg.n_heads == 4 and meta["tokenizer"] == {"type": "byte"}
    wk = params["layers.1.attention.wk.weight"].reshape(4, 8, 32)
    np.testing.assert_allclose(p["layers.1.attention.wk.weight"].reshape(2, 8, 32)[1],
                               (wk[2] + wk[3]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(p["layers.0.attention.wq.weight"],
                                  params["layers.0.attention.wq.weight"])


@pytest.mark.parametrize("g,msg", [("3", "cannot group 4 query heads into 3"),
                                   ("8", "cannot group 4 query heads into 8"),
                                   ("0", "positive integer")])
def test_convert_gqa_bad_group_counts(mha_ckpt, tmp_path, capsys, g, msg):
    rc, err = _cli(capsys, "convert-gqa", str(mha_ckpt[0]), str(tmp_path / "x.safetensors"),
                   "--n-kv-heads", g)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("minillama: error: ")
    assert msg in lines[0]
    assert not (tmp_path / "x.safetensors").exists()


def test_train_init_from_starts_at_the_converted_weights(mha_ckpt, tmp_path, capsys):
    from minillama.io.data import prepare_text_file
    from minillama.train.trainer import CKPT_NAME

    src, _ = mha_ckpt
    gqa = tmp_path / "gqa.safetensors"
    assert _cli(capsys, "convert-gqa", str(src), str(gqa), "--n-kv-heads", "1")[0] == 0
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 400, encoding="utf-8")
    data = prepare_text_file(text, tmp_path / "data")
    out = tmp_path / "up"
    rc, err = _cli(capsys, "train", "--no-progress", "--init-from", str(gqa), "--data", str(data),
                   "--out", str(out), "--context", "32", "--batch-size", "2", "--steps", "1",
                   "--eval-interval", "1", "--eval-iters", "1", "--lr", "1e-9", "--min-lr", "0",
                   "--warmup", "0", "--weight-decay", "0")
    assert rc == 0, err
    cfg, p, _ = load_checkpoint(out / CKPT_NAME)
    _, p0, _ = load_checkpoint(gqa)
    assert cfg.n_kv_heads == 1 and cfg.dim == 32  # the model shape came from the checkpoint
    np.testing.assert_allclose(p["layers.0.attention.wk.weight"],
                               p0["layers.0.attention.wk.weight"], atol=1e-6)
    # a shape flag that contradicts the weights is one clear line
    rc, err = _cli(capsys, "train", "--no-progress", "--init-from", str(gqa), "--data", str(data),
                   "--out", str(tmp_path / "bad"), "--n-kv-heads", "2", "--steps", "1")
    assert rc == 2 and "--init-from" in err and "n_kv_heads=1" in err


def test_convert_gqa_cannot_add_kv_heads():
    from minillama.core.errors import MinillamaError
    from minillama.model.gqa import convert_gqa

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=11, max_seq_len=8)
    with pytest.raises(MinillamaError, match="into a divisor of 2, not 4"):
        convert_gqa(cfg, init_params(cfg), 4)


def test_convert_gqa_pools_kv_biases_too():
    from minillama.model.gqa import convert_gqa
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=4, vocab_size=11, max_seq_len=8, qkv_bias=True)
    p = init_params(cfg, dtype=np.float64)
    rng = np.random.default_rng(0)
    for w in ("wk", "wv"):  # equal heads within each pair: the conversion must be exact
        p[f"layers.0.attention.{w}.weight"] = np.repeat(rng.standard_normal((2, 1, 4, 16)), 2,
                                                        axis=1).reshape(16, 16)
        p[f"layers.0.attention.{w}.bias"] = np.repeat(rng.standard_normal((2, 1, 4)), 2,
                                                      axis=1).reshape(16)
    tok = rng.integers(0, 11, (1, 6))
    cfg2, p2 = convert_gqa(cfg, p, 2)
    assert p2["layers.0.attention.wk.bias"].shape == (8,)
    np.testing.assert_allclose(Transformer(cfg2, p2).forward(tok), Transformer(cfg, p).forward(tok),
                               rtol=1e-10, atol=1e-12)
