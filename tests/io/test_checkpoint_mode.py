"""The own checkpoint format's writer: file mode and atomic replacement."""

import os
import stat

import numpy as np

from minillama.core.config import ModelConfig
from minillama.io.checkpoint import load_checkpoint, save_checkpoint
from minillama.model.transformer import init_params


def test_checkpoint_gets_umask_mode_and_round_trips(tmp_path):
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=10, hidden_dim=24, max_seq_len=8)
    params = init_params(cfg, seed=3)
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    cfg2, params2, _ = load_checkpoint(path)
    assert cfg2 == cfg
    for k in params:
        np.testing.assert_array_equal(params2[k], params[k])
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary left behind
