"""The model families (:data:`minillama.io.families.FAMILIES`, one entry each).

The table: every family round-trips through its own names (``model_type``, class, GGUF
architecture), an entry added in a test is read and written by the HF and GGUF code with nothing
else changed, and no module outside the table spells a family's name.

Parity with `transformers` for every supported checkpoint family: a tiny random model is built
and saved by transformers here, loaded by minillama, and must give the same float32 logits (within
1e-4 of the largest logit) and the same greedy tokens, on every backend that runs here.

Families: llama (plain RoPE, Llama 3.1 rope scaling, linear / dynamic-NTK / yarn scaling, a
head_dim that differs from hidden / heads, attention and MLP biases), mistral (sliding window
shorter than the sequence) and qwen2 (q/k/v biases).
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.infer.generate import generate
from minillama.io import families
from minillama.io.hf import config_from_hf, config_to_hf
from minillama.io.load import load_model

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs torch, transformers")

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}

#: name -> (HF config class name, model class name, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-scaling": ("LlamaConfig", "LlamaForCausalLM",
                       {"rope_parameters": LLAMA3, "hidden_size": 64}),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 12}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 10000.0}}),
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      {"max_position_embeddings": 12,
                       "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                           "rope_theta": 10000.0}}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM",
                   {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 16}}),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True,
                                                          "mlp_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5, "head_dim": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: past the window of 5


def build_hf(family: str, folder):
    """A random transformers model of ``family`` saved (safetensors) into ``folder``, biases
    randomised too (transformers starts them at zero)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_family(request, tmp_path_factory):
    if transformers is None:
        pytest.skip("needs torch, transformers")
    folder = tmp_path_factory.mktemp(request.param)
    model = build_hf(request.param, folder)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
        greedy = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    return request.param, folder, logits, greedy


def test_logits_and_greedy_tokens_match_transformers(hf_family, backend):
    family, folder, ref_logits, ref_greedy = hf_family
    model, _ = load_model(folder, backend=backend.name)
    logits = backend.to_numpy(model.forward(np.array([PROMPT])))[0]
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err <= 1e-4, f"{family} on {backend.name}: relative logit error {err:.2e}"
    got = generate(model, PROMPT, max_new_tokens=8, temperature=0.0)
    assert got == ref_greedy, family


@needs_transformers
def test_family_options_reach_the_config(tmp_path):
    """What each family turns on in ModelConfig (so the parity above exercises it)."""
    def cfg_of(family):
        cfg_cls, _, extra = FAMILIES[family]
        return config_from_hf(getattr(transformers, cfg_cls)(**{**BASE, **extra}).to_dict())

    assert cfg_of("qwen2").qkv_bias and not cfg_of("qwen2").attn_out_bias
    assert cfg_of("mistral").sliding_window == 5 and cfg_of("mistral").head_dim == 8
    assert cfg_of("llama-head-dim").head_dim == 12 and cfg_of("llama-head-dim").dim == 32
    b = cfg_of("llama-biases")
    assert b.qkv_bias and b.attn_out_bias and b.mlp_bias
    assert cfg_of("llama3-scaling").rope_scaling["rope_type"] == "llama3"
    dyn = cfg_of("llama-dynamic")
    assert dyn.max_seq_len == 24 and dyn.rope_scaling["original_max_position_embeddings"] == 12


@needs_transformers
@pytest.mark.parametrize("change, needle", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope scaling type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_settings_are_one_clear_line(change, needle):
    c = transformers.LlamaConfig(**BASE).to_dict()
    c.update(change)
    with pytest.raises(MinillamaError) as e:
        config_from_hf(c)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _hf_grads_as_ours(model, cfg):
    """The gradients of a transformers model under minillama's names and RoPE row order."""
    from minillama.io.families import HF_TENSORS
    from minillama.io.hf import hf_to_interleaved

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().numpy()
        ours = HF_TENSORS.ours(name)
        if ".wq." in ours or ".wk." in ours:
            g = hf_to_interleaved(g, cfg.n_heads if ".wq." in ours else cfg.n_kv_heads)
        out[ours] = g
    return out


@needs_transformers
@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama-biases", "llama-head-dim",
                                    "llama3-scaling"])
def test_gradients_match_torch_autograd(family, tmp_path):
    """loss_and_grads (hand-written backward, biases and sliding window included) equals
    torch.autograd on the transformers model cast to float64. transformers keeps RoPE's cos/sin,
    RMSNorm and the softmax in float32 even then, so the agreement is float32's (1e-5 of each
    gradient's largest entry); exact float64 checks are the central differences below."""
    from minillama.model.transformer import Transformer

    hf = build_hf(family, tmp_path).double()
    model64, _ = load_model(tmp_path, backend="numpy", dtype=np.float64)
    rng = np.random.default_rng(0)
    x = rng.integers(0, BASE["vocab_size"], size=(2, 13))
    y = rng.integers(0, BASE["vocab_size"], size=(2, 13))
    loss, grads = model64.loss_and_grads(x, y)
    logits = hf(torch.tensor(x)).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            torch.tensor(y).reshape(-1))
    ref.backward()
    assert abs(loss - ref.item()) < 1e-6
    ref_grads = _hf_grads_as_ours(hf, model64.cfg)
    assert set(ref_grads) == set(grads)
    for k, g in grads.items():
        err = np.abs(g - ref_grads[k]).max() / np.abs(ref_grads[k]).max()
        assert err < 1e-5, (k, err)
    assert isinstance(model64, Transformer)


def test_bias_and_window_gradients_by_central_differences():
    """float64 central differences on a few entries of every bias, with a sliding window and a
    decoupled head_dim, for the model's own loss_and_grads."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer, init_params

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=10, vocab_size=11,
                      hidden_dim=24, max_seq_len=16, qkv_bias=True, attn_out_bias=True,
                      mlp_bias=True, sliding_window=3, tie_embeddings=False,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    params = init_params(cfg, seed=1, dtype=np.float64)
    rng = np.random.default_rng(2)
    for k in params:
        if k.endswith(".bias"):
            params[k] = rng.normal(0, 0.5, params[k].shape)
    x, y = rng.integers(0, 11, (2, 7)), rng.integers(0, 11, (2, 7))
    _, grads = Transformer(cfg, params, backend="numpy").loss_and_grads(x, y)
    eps = 1e-6
    for k in [k for k in params if k.endswith(".bias")] + ["layers.0.attention.wk.weight"]:
        for idx in [tuple(rng.integers(0, n) for n in params[k].shape) for _ in range(3)]:
            plus, minus = dict(params), dict(params)
            plus[k], minus[k] = params[k].copy(), params[k].copy()
            plus[k][idx] += eps
            minus[k][idx] -= eps
            num = (Transformer(cfg, plus, backend="numpy").loss(x, y)
                   - Transformer(cfg, minus, backend="numpy").loss(x, y)) / (2 * eps)
            assert abs(num - grads[k][idx]) < 1e-7, (k, idx)


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
#: family -> ModelConfig options of a config that family claims (a new family adds its row)
CLAIMED = {"llama": {"qkv_bias": True, "attn_out_bias": True, "mlp_bias": True},
           "mistral": {"sliding_window": 5},
           "qwen2": {"qkv_bias": True}}
SMALL = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=23, hidden_dim=24,
             max_seq_len=16, tie_embeddings=False)


def test_every_family_has_a_claimed_config():
    assert set(CLAIMED) == set(families.FAMILIES)


@pytest.mark.parametrize("name", list(CLAIMED))
def test_each_family_round_trips_through_its_own_names(name):
    fam = families.FAMILIES[name]
    cfg = ModelConfig(**SMALL, **CLAIMED[name])
    assert families.family_for(cfg) is fam
    hf = config_to_hf(cfg)
    assert hf["model_type"] == name and hf["architectures"] == [fam.hf_class]
    back = config_from_hf(json.loads(json.dumps(hf)))
    for key in ("qkv_bias", "attn_out_bias", "mlp_bias", "sliding_window"):
        assert getattr(back, key) == getattr(cfg, key), (name, key)
    if fam.gguf_arch is not None:
        assert families.gguf_family(fam.gguf_arch, "x.gguf") is fam
    for pre, (pattern, _) in list(fam.gguf_pre.items())[:1]:
        assert families.pre_tokenizers()[pre][0] == pattern
        assert families.pre_tokenizer_name(pattern) == pre
    assert set(fam.stop_names) <= set(families.stop_names())


def test_unknown_names_are_one_line():
    with pytest.raises(MinillamaError, match="model_type 'gpt2' is not supported "
                                             r"\(supported: llama, mistral, qwen2\)"):
        families.hf_family({"model_type": "gpt2"}, "config.json")
    with pytest.raises(MinillamaError, match="model_type"):
        families.hf_family({"model_type": ["llama"]}, "config.json")
    with pytest.raises(MinillamaError, match=r"GGUF architecture 'mistral' is not supported "
                                             r"\(supported: llama, qwen2\)"):
        families.gguf_family("mistral", "x.gguf")


def _toy_family():
    """A family that exists only in this test: MLP biases alone, GGUF architecture ``toy``
    with qwen2's half-split q/k rows, its own pre-tokenizer name and stop token."""
    return dataclasses.replace(
        families.FAMILIES["qwen2"], name="toy", hf_class="ToyForCausalLM", gguf_arch="toy",
        hf_options=lambda c, where: {"mlp_bias": bool(c.get("toy_mlp_bias"))},
        hf_fields=lambda cfg: {"toy_mlp_bias": cfg.mlp_bias},
        claims=lambda cfg: cfg.mlp_bias and not cfg.qkv_bias and not cfg.attn_out_bias,
        gguf_pre={}, stop_names=("<|toy_end|>",))


def test_a_new_family_is_one_entry(monkeypatch, tmp_path):
    """An entry added to the table (and nothing else) is written and read back by the HF and
    GGUF code under its own names, with the same logits."""
    from minillama.io.gguf import load_gguf, save_gguf
    from minillama.io.hf import load_hf, save_hf
    from minillama.model.transformer import Transformer, init_params

    monkeypatch.setitem(families.FAMILIES, "toy", _toy_family())
    cfg = ModelConfig(**SMALL, mlp_bias=True)
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    for k in params:
        if k.endswith(".bias"):
            params[k] = rng.normal(0, 0.5, params[k].shape).astype(np.float32)
    x = np.array([[1, 5, 7, 2, 9, 11]])
    want = Transformer(cfg, params, backend="numpy").forward(x)

    save_hf(tmp_path / "hf", cfg, params)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "toy" and written["architectures"] == ["ToyForCausalLM"]
    assert written["toy_mlp_bias"] is True
    cfg2, params2 = load_hf(tmp_path / "hf")
    np.testing.assert_allclose(Transformer(cfg2, params2, backend="numpy").forward(x), want,
                               rtol=1e-5, atol=1e-5)
    assert "<|toy_end|>" in families.stop_names()

    pytest.importorskip("gguf")
    save_gguf(tmp_path / "toy.gguf", cfg, params)
    import gguf

    reader = gguf.GGUFReader(str(tmp_path / "toy.gguf"))
    assert reader.fields["general.architecture"].contents() == "toy"
    assert "toy.block_count" in reader.fields
    cfg3, params3, _ = load_gguf(tmp_path / "toy.gguf")
    assert cfg3.mlp_bias and not cfg3.qkv_bias
    np.testing.assert_allclose(Transformer(cfg3, params3, backend="numpy").forward(x), want,
                               rtol=1e-5, atol=1e-5)


def test_no_family_is_spelled_outside_the_table():
    """No string constant of the package (docstrings aside) names a family, its class or its
    GGUF architecture but the table's module: per-family branches read the table. (``llama`` is
    left out: it is also llama.cpp's name of the SentencePiece tokenizer model.)"""
    names = {n for f in families.FAMILIES.values() for n in (f.name, f.hf_class, f.gguf_arch)
             if n and n != "llama"}
    root = Path(families.__file__).resolve().parents[1]
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "families.py" and path.parent.name == "io":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                        ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings and node.value in names:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert not found, "family names outside minillama/io/families.py:\n" + "\n".join(found)
