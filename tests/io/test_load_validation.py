"""Loading is total: each malformed input found by fuzzing is one clear MinillamaError.

Every case here was a bare traceback, a hang, a huge allocation or NaN logits before; each test
names the input and the words the one-line error must contain."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError, OutputError
from minillama.io.checkpoint import check_finite, load_checkpoint, save_checkpoint
from minillama.io.load import load_model, save_hf, save_llama2c
from minillama.io.safetensors_file import read_safetensors_file
from minillama.io.tokenizer import ByteTokenizer, Llama2cTokenizer, tokenizer_from_spec
from minillama.model.transformer import init_params


def _cfg(**kw):
    base = dict(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, hidden_dim=24,
                max_seq_len=16, tie_embeddings=False)
    return ModelConfig(**{**base, **kw})


# --- ModelConfig: the one place that validates a config -------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("n_layers", 10**12, "n_layers must be in [1, 1024]"),
    ("max_seq_len", 10**12, "max_seq_len must be in"),
    ("vocab_size", 0, "vocab_size must be in"),
    ("n_heads", 0, "n_heads must be in"),
    ("dim", "many", "dim must be an integer"),
    ("dim", 16.0, "dim must be an integer"),
    ("dim", True, "dim must be an integer"),
    ("hidden_dim", -3, "hidden_dim must be in"),
    ("norm_eps", float("nan"), "norm_eps must be a finite number"),
    ("norm_eps", 0.0, "norm_eps must be a finite number"),
    ("rope_theta", "1e4", "rope_theta must be a number"),
    ("rope_theta", math.inf, "rope_theta must be a finite number"),
    ("tie_embeddings", 1, "tie_embeddings must be true or false"),
    ("ffn_dim_multiplier", -1.0, "ffn_dim_multiplier must be"),
    ("n_kv_heads", 4, "n_heads % n_kv_heads"),
])
def test_model_config_refuses_each_bad_field(field, value, words):
    with pytest.raises(MinillamaError, match=words.replace("[", r"\[").replace("%", "%")):
        _cfg(**{field: value})


def test_rope_tables_are_bounded():
    """A small file cannot claim 2M positions at a wide head: 2M x 256 entries of RoPE tables."""
    with pytest.raises(MinillamaError, match=r"max_seq_len \* head_dim = 2097152 \* 256"):
        _cfg(dim=256, n_heads=1, n_kv_heads=1, max_seq_len=1 << 21)
    _cfg(dim=256, n_heads=2, n_kv_heads=1, max_seq_len=1 << 20)  # 1M positions at hd = 128: fine


def test_model_config_accepts_numpy_scalars_and_stores_python_values():
    cfg = _cfg(dim=np.int64(16), rope_theta=np.float32(500.0), tie_embeddings=np.bool_(True))
    assert type(cfg.dim) is int and type(cfg.rope_theta) is float
    assert type(cfg.tie_embeddings) is bool
    json.dumps(cfg.to_dict())  # plain JSON-able values


def test_model_config_from_dict_refuses_non_mappings():
    with pytest.raises(MinillamaError, match="must be a mapping"):
        ModelConfig.from_dict([1, 2])


# --- Hugging Face config.json -----------------------------------------------------------------
@pytest.fixture
def hf_dir(tmp_path):
    cfg = _cfg()
    return save_hf(tmp_path / "hf", cfg, init_params(cfg, seed=0))


@pytest.mark.parametrize("patch, words", [
    ({"rope_parameters": "fast"}, "rope_parameters must be an object"),
    ({"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
    ({"rope_scaling": 4.0}, "rope_scaling must be an object"),
    ({"num_attention_heads": 0}, "num_attention_heads must be in"),
    ({"head_dim": "many"}, "head_dim must be an integer, got 'many'"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings must be in"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers must be in"),
    ({"hidden_size": 1e300}, "hidden_size must be an integer"),
    ({"vocab_size": "32"}, "vocab_size must be an integer"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be set"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
])
def test_hf_config_fields(hf_dir, patch, words):
    conf = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**conf, **patch}))
    with pytest.raises(MinillamaError, match=words):
        load_model(hf_dir)


def test_hf_config_not_an_object_and_not_json(hf_dir):
    (hf_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(MinillamaError, match="not a JSON object"):
        load_model(hf_dir)
    (hf_dir / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(MinillamaError, match="corrupt"):
        load_model(hf_dir)
    (hf_dir / "config.json").write_text("[" * 100000)
    with pytest.raises(MinillamaError, match="corrupt"):
        load_model(hf_dir)


def test_hf_sharded_index_is_checked(tmp_path):
    cfg = _cfg()
    d = save_hf(tmp_path / "hf", cfg, init_params(cfg, seed=0), max_shard_bytes=4000)
    index = d / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    for bad, words in [({"weight_map": []}, "no weight_map"),
                       ([1], "no weight_map"),
                       ({"weight_map": {"x": "../../etc/passwd"}}, "not a file name"),
                       ({"weight_map": {"x": 3}}, "not a file name"),
                       ({"weight_map": {"x": "absent.safetensors"}}, "not found")]:
        index.write_text(json.dumps(bad))
        with pytest.raises(MinillamaError, match=words):
            load_model(d)
    index.write_text(json.dumps(good))
    load_model(d)


def test_hf_tokenizer_config_and_vocabulary(hf_dir, hf_tokenizer_json):
    (hf_dir / "tokenizer.json").write_bytes(hf_tokenizer_json.read_bytes())
    with pytest.raises(MinillamaError, match=r"tokenizer vocabulary \(\d+ tokens\) does not "
                                             r"match the model vocabulary \(32\)"):
        load_model(hf_dir)
    (hf_dir / "tokenizer.json").write_text('{"model": 5}')
    with pytest.raises(MinillamaError, match="cannot read tokenizer"):
        load_model(hf_dir)


def test_tokenizer_config_json_must_be_an_object(tmp_path, hf_tokenizer_json):
    from minillama.io.tokenizer import HFTokenizer

    (tmp_path / "tokenizer_config.json").write_text('"eos"')
    with pytest.raises(MinillamaError, match="tokenizer_config.json: not a JSON object"):
        HFTokenizer(hf_tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(MinillamaError, match="corrupt"):
        HFTokenizer(hf_tokenizer_json)


# --- safetensors headers ------------------------------------------------------------------------
def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("edit, words", [
    (lambda h: h[_first_tensor(h)].__setitem__("shape", ["4", 16]), "non-negative integers"),
    (lambda h: h[_first_tensor(h)].__setitem__("shape", [-4, -16]), "non-negative integers"),
    (lambda h: h[_first_tensor(h)].__setitem__("shape", [True, 16]), "non-negative integers"),
    (lambda h: h[_first_tensor(h)].__setitem__("shape", [10**15, 10**15]), "does not fit"),
    (lambda h: h[_first_tensor(h)].__setitem__("shape", [1] * 40), "at most 8"),
    (lambda h: h[_first_tensor(h)].__setitem__("dtype", "I64"), "unsupported dtype I64"),
    (lambda h: h[_first_tensor(h)].__setitem__("dtype", ["F32"]), "unsupported dtype"),
    (lambda h: h[_first_tensor(h)].__setitem__("data_offsets", [0]), "data_offsets"),
    (lambda h: h[_first_tensor(h)].__setitem__("data_offsets", [8, 4]), "data_offsets"),
    (lambda h: h[_first_tensor(h)].__setitem__("data_offsets", [0, 1 << 40]), "does not fit"),
    (lambda h: h[_first_tensor(h)].pop("dtype"), "exactly dtype, shape and data_offsets"),
    (lambda h: h.__setitem__(_first_tensor(h), 7), "exactly dtype, shape and data_offsets"),
    (lambda h: h.__setitem__("__metadata__", {"format": {"a": 1}}), "map strings to strings"),
    (lambda h: h.__setitem__("__metadata__", ["x"]), "map strings to strings"),
])
def test_safetensors_header_edits(tmp_path, edit, words):
    cfg = _cfg()
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=0))
    _rewrite_header(path, edit)
    with pytest.raises(MinillamaError, match=words):
        read_safetensors_file(path)
    with pytest.raises(MinillamaError):
        load_model(path)


def test_overlapping_tensors_are_refused(tmp_path):
    cfg = _cfg()
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=0))

    def overlap(h):
        names = [k for k in h if k != "__metadata__" and h[k]["shape"] == [16]]
        h[names[1]]["data_offsets"] = h[names[0]]["data_offsets"]
    _rewrite_header(path, overlap)
    with pytest.raises(MinillamaError, match="overlap"):
        read_safetensors_file(path)


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer", '["byte"]', "corrupt tokenizer metadata"),
    ("tokenizer", '{"type": "llama2c", "path": 5}', "no path"),
    ("tokenizer", '{"type": 7}', "unknown tokenizer type"),
    ("config", '"dim"', "corrupt config metadata"),
    ("config", "{", "corrupt metadata 'config'"),
    ("format_version", "99", "unsupported minillama format_version"),
])
def test_own_checkpoint_metadata(tmp_path, key, value, words):
    cfg = _cfg()
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=0),
                           tokenizer=ByteTokenizer())
    _rewrite_header(path, lambda h: h["__metadata__"].__setitem__(key, value))
    with pytest.raises(MinillamaError, match=words):
        load_model(path)


def test_tokenizer_from_spec_non_mapping():
    with pytest.raises(MinillamaError, match="bad tokenizer spec"):
        tokenizer_from_spec(["byte"])


# --- weights: NaN/inf and implausible magnitudes, named ------------------------------------
def test_non_finite_llama2c_weight_is_named_with_its_count(tmp_path):
    cfg = _cfg()
    params = init_params(cfg, seed=0)
    w = params["layers.1.attention.wq.weight"]
    w.flat[[0, 5, 9]] = [np.nan, np.inf, -np.inf]
    path = save_llama2c(tmp_path / "m.bin", cfg, params)
    with pytest.raises(MinillamaError, match=r"^layers\.1\.attention\.wq holds 3 NaN/inf values"):
        load_model(path)


@pytest.mark.parametrize("fmt", ["llama2c", "hf", "minillama"])
def test_flipped_exponent_bit_is_refused(tmp_path, fmt):
    """0.02 with its top exponent bit flipped is 6.8e36: finite, but it overflows the forward."""
    cfg = _cfg()
    params = init_params(cfg, seed=0)
    w = params["layers.0.feed_forward.w1.weight"]
    bits = w.view(np.uint32)
    bits[3, 2] ^= np.uint32(1 << 30)
    assert np.isfinite(w[3, 2]) and abs(w[3, 2]) > 1e30
    path = {"llama2c": lambda: save_llama2c(tmp_path / "m.bin", cfg, params),
            "hf": lambda: save_hf(tmp_path / "hf", cfg, params),
            "minillama": lambda: save_checkpoint(tmp_path / "m.safetensors", cfg, params)}[fmt]()
    with pytest.raises(MinillamaError, match=r"layers\.0\.feed_forward\.w1 holds 1 value beyond"):
        load_model(path)


def test_check_finite_counts_only_on_failure():
    check_finite({"a.weight": np.ones(3, np.float32)})
    with pytest.raises(MinillamaError, match="^a holds 2 NaN/inf values$"):
        check_finite({"a.weight": np.array([np.nan, 1, np.inf], np.float32)})
    check_finite({"m": np.array([1e6], np.float32)}, limit=None)


# --- llama2.c tokenizer.bin -------------------------------------------------------------------
def _tokenizer_bin(path, scores=None):
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [bytes([c]) for c in b"abc "]
    scores = scores or [0.0] * len(pieces)
    out = struct.pack("<i", 8)
    for p, s in zip(pieces, scores):
        out += struct.pack("<fi", s, len(p)) + p
    path.write_bytes(out)
    return path


def test_tokenizer_bin_nan_score_and_truncation(tmp_path):
    p = _tokenizer_bin(tmp_path / "tok.bin")
    assert Llama2cTokenizer(p).vocab_size == 7
    _tokenizer_bin(p, scores=[0.0, 0.0, float("nan"), 0, 0, 0, 0])
    with pytest.raises(MinillamaError, match="score nan"):
        Llama2cTokenizer(p)
    _tokenizer_bin(p)
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(MinillamaError, match="truncated tokenizer file"):
        Llama2cTokenizer(p)


# --- output paths ---------------------------------------------------------------------------------
def test_checkpoint_path_that_is_a_folder_or_below_a_file(tmp_path):
    cfg = _cfg()
    params = init_params(cfg, seed=0)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(OutputError, match="is a folder, not a file"):
        save_checkpoint(tmp_path / "dir.safetensors", cfg, params)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="file is a file, not a folder"):
        save_checkpoint(tmp_path / "file" / "m.safetensors", cfg, params)
    with pytest.raises(OutputError, match="file, which is a file, not a folder"):
        save_llama2c(tmp_path / "file" / "sub" / "m.bin", cfg, params)
    with pytest.raises(OutputError, match="is a file, not a folder"):
        save_hf(tmp_path / "file", cfg, params)


def test_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    """ENOSPC midway through a write: one clear error, the good file untouched, no temporary."""
    import errno

    import safetensors.numpy

    cfg = _cfg()
    params = init_params(cfg, seed=0)
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    before = path.read_bytes()

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OutputError, match="No space left on device.*previous file is kept"):
        save_checkpoint(path, cfg, params)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    load_checkpoint(path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root may write anywhere: permissions cannot be tested")
def test_unwritable_folder(tmp_path):
    cfg = _cfg()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="not writable"):
            save_checkpoint(ro / "m.safetensors", cfg, init_params(cfg, seed=0))
    finally:
        ro.chmod(0o700)


def test_train_out_is_a_file_and_export_is_a_folder(tmp_path, capsys):
    f = tmp_path / "somefile"
    f.write_text("x")
    for argv, words in [(["--out", str(f)], "is a file, not a folder"),
                        (["--out", str(f / "sub")], "which is a file, not a folder"),
                        (["--out", str(tmp_path / "o"), "--export", str(tmp_path)],
                         "--export file"),
                        ]:
        rc = cli.main(["train", "--no-progress", "--steps", "1", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("minillama: error: "), err
        assert words in lines[0], lines[0]
    assert not (tmp_path / "o").exists()  # refused before any work


def test_prepare_data_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "somefile"
    f.write_text("x")
    txt = tmp_path / "t.txt"
    txt.write_text("hello world\n" * 50)
    rc = cli.main(["prepare-data", "--data", str(txt), "--out", str(f)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("minillama: error: ") and "is a file" in err, err


def test_generation_stops_on_non_finite_logits(monkeypatch):
    """Weights that load but overflow in the forward pass: one clear error, not sampled garbage."""
    from minillama.infer.generate import generate
    from minillama.model.transformer import Transformer

    cfg = _cfg()
    model = Transformer(cfg, init_params(cfg, seed=0), backend="numpy")
    real = model.forward
    calls = []

    def overflowing(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        if len(calls) == 2:  # the first decode step
            out = out * np.float32(np.inf)
        return out

    monkeypatch.setattr(model, "forward", overflowing)
    with pytest.raises(MinillamaError, match="logits for position 3 hold NaN/inf"):
        generate(model, [1, 2, 3], max_new_tokens=5, temperature=0.0)


@pytest.mark.parametrize("patch, words", [
    ({"max_position_embeddings": "many"}, "max_position_embeddings must be an integer"),
    ({"max_position_embeddings": float("inf")}, "max_position_embeddings must be an integer"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": float("inf")}}, "factor must be"),
    ({"rope_scaling": {"rope_type": {"a": 1}}}, "rope scaling type"),
    ({"rope_scaling": {"type": ["dynamic"]}}, "rope scaling type"),
])
def test_mistral_dynamic_scaling_fields(patch, words):
    """Found by the fuzzer: the dynamic-NTK context stretch multiplied unchecked values."""
    from minillama.io.hf import config_from_hf

    base = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 40, "intermediate_size": 24, "max_position_embeddings": 12,
            "model_type": "mistral", "sliding_window": 8,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert config_from_hf(base).max_seq_len == 24
    with pytest.raises(MinillamaError, match=words):
        config_from_hf({**base, **patch})
