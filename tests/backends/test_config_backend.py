"""ModelConfig validation, LLaMA's FFN size rule, the backend seam and parameter initialisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minillama import MinillamaError, ModelConfig, Transformer
from minillama.backends import BACKENDS, get_backend, resolve_name
from minillama.core.config import llama_hidden_dim, param_shapes
from minillama.model.transformer import check_params, init_params


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,fields",
    [
        (dict(dim=130, n_heads=4), ["dim", "n_heads"]),
        (dict(dim=128, n_heads=4, n_kv_heads=3), ["n_heads", "n_kv_heads"]),
        (dict(dim=36, n_heads=4, n_kv_heads=2), ["dim", "n_heads", "head"]),  # hd = 9, odd
        (dict(dim=0), ["dim"]),
        (dict(dim=-8), ["dim"]),
        (dict(n_layers=0), ["n_layers"]),
        (dict(n_heads=0), ["n_heads"]),
        (dict(n_kv_heads=-1), ["n_kv_heads"]),
        (dict(vocab_size=0), ["vocab_size"]),
        (dict(hidden_dim=0), ["hidden_dim"]),
        (dict(max_seq_len=0), ["max_seq_len"]),
        (dict(multiple_of=0), ["multiple_of"]),
        (dict(n_layers=2.5), ["n_layers"]),
        (dict(norm_eps=0.0), ["norm_eps"]),
        (dict(rope_theta=-1.0), ["rope_theta"]),
    ],
)
def test_invalid_config_names_fields(kwargs, fields):
    with pytest.raises(MinillamaError) as e:
        ModelConfig(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fields:
        assert f in msg, (f, msg)


def test_validate_catches_later_mutation():
    cfg = ModelConfig(dim=64, n_heads=4)
    cfg.n_kv_heads = 3
    with pytest.raises(MinillamaError, match="n_kv_heads"):
        cfg.validate()
    with pytest.raises(MinillamaError, match="n_kv_heads"):
        Transformer(cfg)


def test_valid_configs_and_derived_sizes():
    mha = ModelConfig(dim=64, n_heads=4)
    assert mha.n_kv_heads == 4 and mha.head_dim == 16 and mha.n_rep == 1
    gqa = ModelConfig(dim=64, n_heads=8, n_kv_heads=2)
    assert gqa.head_dim == 8 and gqa.n_rep == 4
    mqa = ModelConfig(dim=64, n_heads=8, n_kv_heads=1)
    assert mqa.n_rep == 8


@pytest.mark.parametrize(
    "dim,multiple_of,mult,expected",
    [
        (4096, 256, None, 11008),  # LLaMA-7B
        (5120, 256, None, 13824),  # LLaMA-13B
        (8192, 4096, 1.3, 28672),  # Llama-2-70B
        (4096, 1024, 1.3, 14336),  # Llama-3-8B
        (288, 32, None, 768),  # llama2.c stories15M
        (64, 4, None, 172),  # int(512/3) = 170 -> 172
        (48, 1, None, 128),
    ],
)
def test_llama_hidden_dim(dim, multiple_of, mult, expected):
    assert llama_hidden_dim(dim, multiple_of, mult) == expected


def test_hidden_dim_default_and_explicit():
    assert ModelConfig(dim=288, n_heads=6, multiple_of=32).hidden_dim == 768
    assert ModelConfig(dim=288, n_heads=6, hidden_dim=700).hidden_dim == 700


def test_config_round_trip_and_unknown_field():
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=40,
                      tie_embeddings=False, rope_theta=5e5)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(MinillamaError, match="bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


@pytest.mark.parametrize("tie", [True, False])
def test_n_params_counts_every_tensor(tie):
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=40,
                      tie_embeddings=tie)
    assert cfg.n_params() == sum(int(np.prod(s)) for s in param_shapes(cfg).values())
    assert ("output.weight" in param_shapes(cfg)) is (not tie)


# ---------------------------------------------------------------------------------------------
# backend seam
# ---------------------------------------------------------------------------------------------
def test_unknown_backend_lists_names():
    with pytest.raises(MinillamaError) as e:
        get_backend("tpu")
    msg = str(e.value)
    assert "tpu" in msg
    for name in BACKENDS:
        assert name in msg


def test_default_and_env_selection(monkeypatch):
    monkeypatch.delenv("MINILLAMA_BACKEND", raising=False)
    assert resolve_name(None) == "numpy"
    assert get_backend().name == "numpy"
    monkeypatch.setenv("MINILLAMA_BACKEND", "no-such")
    with pytest.raises(MinillamaError, match="no-such"):
        get_backend()
    monkeypatch.setenv("MINILLAMA_BACKEND", "numpy")
    assert Transformer(ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=8)).backend.name \
        == "numpy"
    # an explicit name wins over the environment
    monkeypatch.setenv("MINILLAMA_BACKEND", "no-such")
    assert get_backend("numpy").name == "numpy"


def _run_py(code: str, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_env_var_selects_backend_in_fresh_process():
    code = ("import minillama, sys; m = minillama.Transformer(minillama.ModelConfig(dim=16, "
            "n_layers=1, n_heads=2, vocab_size=8)); print(m.backend.name)")
    r = _run_py(code, {"MINILLAMA_BACKEND": "numpy"})
    assert r.returncode == 0 and r.stdout.strip() == "numpy", r.stderr
    r = _run_py(code, {"MINILLAMA_BACKEND": "warp-drive"})
    assert r.returncode != 0 and "warp-drive" in r.stderr and "numpy" in r.stderr


def test_import_does_not_pull_heavy_modules():
    code = ("import sys, minillama, minillama.model.transformer, minillama.core.ops\n"
            "m = minillama.Transformer(minillama.ModelConfig(dim=16, n_layers=1, n_heads=2, "
            "vocab_size=8), backend='numpy')\n"
            "bad = [k for k in ('cupy', 'numba', 'torch') if k in sys.modules]\n"
            "print(','.join(bad))")
    r = _run_py(code, {"MINILLAMA_BACKEND": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported on `import minillama`: {r.stdout.strip()}"


def test_backend_interface(backend):
    """Every backend offers every op pair and the helpers, and round-trips arrays."""
    for op in ("embedding", "linear", "rmsnorm", "rope", "attention", "swiglu", "cross_entropy"):
        assert callable(getattr(backend, f"{op}_forward"))
        assert callable(getattr(backend, f"{op}_backward"))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(backend.to_numpy(backend.asarray(a)), a)
    backend.synchronize()
    assert get_backend(backend) is backend  # an instance passes through


# ---------------------------------------------------------------------------------------------
# initialisation
# ---------------------------------------------------------------------------------------------
def test_init_statistics_and_seed():
    cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, hidden_dim=384)
    p = init_params(cfg, seed=0)
    check_params(cfg, p)
    scaled = 0.02 / np.sqrt(2 * cfg.n_layers)
    for k, v in p.items():
        assert v.dtype == np.float32
        if k.endswith("norm.weight"):
            np.testing.assert_array_equal(v, 1.0)
            continue
        want = scaled if k.endswith(("wo.weight", "w2.weight")) else 0.02
        # sample std of n >= 16384 normals: relative std error sqrt(1/(2n)) < 0.6%; 5% is loose
        assert abs(v.std() / want - 1) < 0.05, (k, v.std(), want)
        assert abs(v.mean()) < 5 * want / np.sqrt(v.size)
    q = init_params(cfg, seed=0)
    r = init_params(cfg, seed=1)
    for k in p:
        np.testing.assert_array_equal(p[k], q[k])
    assert not np.array_equal(p["layers.0.attention.wq.weight"], r["layers.0.attention.wq.weight"])
    p64 = init_params(cfg, seed=0, dtype=np.float64)
    assert p64["tok_embeddings.weight"].dtype == np.float64
    np.testing.assert_allclose(p64["tok_embeddings.weight"], p["tok_embeddings.weight"], rtol=1e-6)


def test_model_seed_reproducible(backend):
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=2, vocab_size=20)
    tok = np.arange(8).reshape(2, 4)
    a = backend.to_numpy(Transformer(cfg, backend=backend, seed=7).forward(tok))
    b = backend.to_numpy(Transformer(cfg, backend=backend, seed=7).forward(tok))
    c = backend.to_numpy(Transformer(cfg, backend=backend, seed=8).forward(tok))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_check_params_errors():
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=20)
    p = init_params(cfg)
    bad = dict(p)
    del bad["norm.weight"]
    with pytest.raises(MinillamaError, match="missing.*norm.weight"):
        Transformer(cfg, bad)
    with pytest.raises(MinillamaError, match="unexpected.*output.weight"):
        Transformer(cfg, {**p, "output.weight": p["tok_embeddings.weight"]})
    with pytest.raises(MinillamaError, match="wq.weight has shape"):
        Transformer(cfg, {**p, "layers.0.attention.wq.weight": np.zeros((16, 15), np.float32)})
    with pytest.raises(MinillamaError, match="float32 or float64"):
        Transformer(cfg, p, dtype=np.float16)
