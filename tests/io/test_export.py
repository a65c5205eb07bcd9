"""`minillama export --format hf|llama2c|gguf`: export the project's checkpoint, load it back,
same logits; transformers loads the Hugging Face export with the same logits; what a format
cannot hold is one clear line."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import save_checkpoint
from minillama.io.load import load_model
from minillama.model.transformer import init_params
from tests.support.errormodel import logits_bound

TOKENS = np.array([[5, 17, 3, 250, 99, 42, 8, 1, 200, 77]])
PLAIN = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=48,
                    max_seq_len=32, tie_embeddings=False)
QWEN = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=48,
                   max_seq_len=32, qkv_bias=True, head_dim=12)


def checkpoint(tmp_path, cfg):
    params = init_params(cfg, seed=4)
    rng = np.random.default_rng(5)
    for k in params:
        if k.endswith(".bias"):
            params[k] = rng.normal(0, 0.5, params[k].shape).astype(np.float32)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, cfg, params)
    return path


def run(capsys, *argv):
    rc = cli.main(["export", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("cfg", [PLAIN, QWEN], ids=["llama", "qwen2-like"])
@pytest.mark.parametrize("fmt", ["hf", "llama2c", "gguf"])
def test_export_round_trip(cfg, fmt, tmp_path, capsys):
    ckpt = checkpoint(tmp_path, cfg)
    ref, _ = load_model(ckpt, backend="numpy")
    out = tmp_path / {"hf": "hf", "llama2c": "m.bin", "gguf": "m.gguf"}[fmt]
    rc, _, err = run(capsys, str(ckpt), "--format", fmt, "--out", str(out))
    if fmt == "llama2c" and cfg is QWEN:
        assert rc == 2 and "llama2.c files cannot hold head_dim != dim / n_heads, biases" in err
        assert len(err.strip().splitlines()) == 1
        return
    assert rc == 0, err
    back, _ = load_model(out, backend="numpy")
    assert back.cfg.qkv_bias == cfg.qkv_bias and back.cfg.head_dim == cfg.head_dim
    want = ref.forward(TOKENS)
    assert np.abs(back.forward(TOKENS) - want).max() <= logits_bound(ref, TOKENS.shape[-1])


@pytest.mark.parametrize("cfg", [PLAIN, QWEN], ids=["llama", "qwen2-like"])
def test_transformers_loads_the_hf_export(cfg, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ckpt = checkpoint(tmp_path, cfg)
    ref, _ = load_model(ckpt, backend="numpy")
    assert run(capsys, str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))[0] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if cfg is QWEN else "LlamaForCausalLM")
    with torch.no_grad():
        got = hf(torch.tensor(TOKENS)).logits.numpy()
    want = ref.forward(TOKENS)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
