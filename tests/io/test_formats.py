"""Checkpoint formats: llama2.c v0/v1, Hugging Face directories, the own format; round trips
against our writers and against transformers' LlamaForCausalLM; every kind of bad file."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import save_checkpoint
from minillama.io.hf import hf_to_interleaved, interleaved_to_hf
from minillama.io.llama2c import MAGIC
from minillama.io.load import detect_format, load_model, load_params, save_hf, save_llama2c
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import Transformer, init_params


def _cfg(tie=True, kvh=2, V=40):
    return ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=kvh, vocab_size=V,
                       hidden_dim=40, max_seq_len=32, tie_embeddings=tie)


def _params(cfg, seed=0):
    p = init_params(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for v in p.values():
        v[...] = rng.normal(0, 0.3, v.shape).astype(np.float32)
    return p


TOKENS = np.array([[1, 5, 9, 3, 7, 2, 11, 4], [0, 6, 6, 8, 39, 12, 1, 2]])


def _logits(cfg, params, backend="numpy"):
    return Transformer(cfg, params, backend=backend).forward(TOKENS)


# ---------------------------------------------------------------------------------------------
# round trips through our writers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("tie", [True, False])
def test_llama2c_round_trip(tmp_path, backend, version, tie):
    cfg, params = _cfg(tie), _params(_cfg(tie))
    path = save_llama2c(tmp_path / "m.bin", cfg, params, version=version)
    assert detect_format(path) == "llama2c"
    fmt, cfg2, params2, tok = load_params(path)
    assert cfg2 == cfg and tok is None
    assert set(params2) == set(params)
    for k in params:
        np.testing.assert_array_equal(params2[k], params[k])
    model, _ = load_model(path, backend=backend.name)
    np.testing.assert_array_equal(backend.to_numpy(model.forward(TOKENS)),
                                  backend.to_numpy(_logits(cfg, params, backend.name)))
    expect = 28 if version == 0 else 256
    n_float = sum(v.size for v in params.values())
    if version == 0:
        n_float += 2 * cfg.max_seq_len * cfg.head_dim // 2
    assert path.stat().st_size == expect + 4 * n_float


def test_llama2c_v0_header_signals_unshared_classifier(tmp_path):
    path = save_llama2c(tmp_path / "m.bin", _cfg(False), _params(_cfg(False)), version=0)
    fields = struct.unpack("<7i", path.read_bytes()[:28])
    assert fields[5] == -40
    path = save_llama2c(tmp_path / "t.bin", _cfg(True), _params(_cfg(True)), version=1)
    head = path.read_bytes()[:37]
    assert struct.unpack("<I", head[:4])[0] == MAGIC and head[36] == 1


def test_stories260k_v0_rewritten_as_v1_reads_back_identically(shared_data, tmp_path):
    _, cfg, params, _ = load_params(shared_data / "stories260K.bin")
    assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size,
            cfg.max_seq_len, cfg.tie_embeddings) == (64, 172, 5, 8, 4, 512, 512, True)
    save_llama2c(tmp_path / "s1.bin", cfg, params, version=1)
    _, cfg2, params2, _ = load_params(tmp_path / "s1.bin")
    assert cfg2 == cfg
    for k in params:
        np.testing.assert_array_equal(params2[k], params[k])
    # the stored RoPE tables in the v0 file are the ones we compute (so skipping them is right)
    raw = np.frombuffer((shared_data / "stories260K.bin").read_bytes()[28:], dtype="<f4")
    n_before = sum(v.size for k, v in params.items())
    half = cfg.max_seq_len * cfg.head_dim // 2
    cos = raw[n_before:n_before + half].reshape(cfg.max_seq_len, -1)
    from minillama.core.ops import rope_tables
    c, _ = rope_tables(cfg.head_dim, cfg.max_seq_len, 10000.0, np.float64)
    np.testing.assert_allclose(cos, c, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("shard", [None, 6000])
def test_hf_directory_round_trip(tmp_path, backend, tie, shard):
    cfg, params = _cfg(tie), _params(_cfg(tie))
    d = save_hf(tmp_path / "hf", cfg, params, max_shard_bytes=shard)
    if shard:
        assert (d / "model.safetensors.index.json").is_file()
        assert len(list(d.glob("model-*.safetensors"))) > 1
    assert detect_format(d) == "hf"
    model, tok = load_model(d, backend=backend.name)
    assert tok is None and model.cfg == cfg
    np.testing.assert_array_equal(backend.to_numpy(model.forward(TOKENS)),
                                  backend.to_numpy(_logits(cfg, params, backend.name)))


def test_hf_permutation_is_an_inverse_pair():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(hf_to_interleaved(interleaved_to_hf(w, 3), 3), w)
    # head 0, hd = 8: HF row i (first half) is Meta row 2i, HF row 4 + i is Meta row 2i + 1
    hf = interleaved_to_hf(w, 3)
    np.testing.assert_array_equal(hf[1], w[2])
    np.testing.assert_array_equal(hf[5], w[3])


def test_own_format_round_trip_with_tokenizer(tmp_path, backend):
    cfg = _cfg(V=258)
    params = _params(cfg)
    path = save_checkpoint(tmp_path / "m.safetensors", cfg, params, tokenizer=ByteTokenizer())
    assert detect_format(path) == "minillama"
    model, tok = load_model(path, backend=backend.name)
    assert isinstance(tok, ByteTokenizer)
    np.testing.assert_array_equal(backend.to_numpy(model.forward(TOKENS)),
                                  backend.to_numpy(_logits(cfg, params, backend.name)))


def test_hf_bfloat16_weights_are_widened(tmp_path):
    """A bf16 checkpoint (the usual HF dtype) loads: values are the float32 with low bits 0."""
    cfg, params = _cfg(), _params(_cfg())
    d = save_hf(tmp_path / "hf", cfg, params)
    from minillama.io.hf import read_safetensors_file
    tensors, _ = read_safetensors_file(d / "model.safetensors")
    # write bf16 by hand: truncate float32 bits to the top 16 (safetensors' numpy API has no bf16)
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = (v.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    _, cfg2, p2, _ = load_params(d)
    for k, v in params.items():
        expect = (v.view(np.uint32) & 0xFFFF0000).view(np.float32)
        np.testing.assert_array_equal(p2[k], expect)


# ---------------------------------------------------------------------------------------------
# against transformers' own LlamaForCausalLM
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kvh,tie", [(4, False), (2, False), (2, True), (1, True)])
def test_hf_transformers_llama_matches(tmp_path, backend, kvh, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kvh, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(kvh + 10 * tie)
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init so that errors would show
        for p in ref.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = np.random.default_rng(0).integers(0, 60, size=(2, 12))
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    model, _ = load_model(tmp_path / "hf", backend=backend.name)
    assert model.cfg.rope_theta == 500.0 and model.cfg.n_kv_heads == kvh
    assert model.cfg.tie_embeddings == tie
    got = backend.to_numpy(model.forward(ids))
    assert np.abs(got - want).max() <= 1e-4


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def _v1(tmp_path, tie=True):
    return save_llama2c(tmp_path / "m.bin", _cfg(tie), _params(_cfg(tie)), version=1)


def test_truncated_llama2c_files(tmp_path):
    for version in (0, 1):
        path = save_llama2c(tmp_path / f"m{version}.bin", _cfg(), _params(_cfg()), version=version)
        data = path.read_bytes()
        path.write_bytes(data[:-100])
        with pytest.raises(MinillamaError, match="truncated"):
            load_model(path)
        path.write_bytes(data + b"\0" * 8)
        with pytest.raises(MinillamaError, match="trailing bytes"):
            load_model(path)
    p = tmp_path / "tiny.bin"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(MinillamaError, match="not a recognised checkpoint"):
        load_model(p)


def test_wrong_magic_and_bad_headers(tmp_path):
    path = _v1(tmp_path)
    data = bytearray(path.read_bytes())
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\xff" * 64)  # magic wrong, header fields negative: nothing matches
    with pytest.raises(MinillamaError, match="not a recognised checkpoint"):
        load_model(junk)
    v2 = bytearray(data)
    v2[4:8] = struct.pack("<i", 2)
    path.write_bytes(bytes(v2))
    with pytest.raises(MinillamaError, match="unsupported llama2.c file version 2"):
        load_model(path)
    # header sizes that overrun the file
    big = bytearray(data)
    big[8:12] = struct.pack("<i", 4096)  # dim
    path.write_bytes(bytes(big))
    with pytest.raises(MinillamaError, match="truncated"):
        load_model(path)
    bad = bytearray(data)
    bad[8:12] = struct.pack("<i", 30)  # dim not divisible by n_heads
    path.write_bytes(bytes(bad))
    with pytest.raises(MinillamaError, match="bad llama2.c header"):
        load_model(path)


@pytest.mark.parametrize("fmt", ["llama2c", "hf", "own"])
def test_non_finite_weights_are_rejected(tmp_path, fmt):
    cfg, params = _cfg(), _params(_cfg())
    params["layers.1.feed_forward.w2.weight"][3, 4] = np.nan
    if fmt == "llama2c":
        path = save_llama2c(tmp_path / "m.bin", cfg, params)
    elif fmt == "hf":
        path = save_hf(tmp_path / "hf", cfg, params)
    else:
        path = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    with pytest.raises(MinillamaError, match="NaN|non-finite"):
        load_model(path)


def test_hf_wrong_shape_dtype_missing_and_unsupported(tmp_path):
    from safetensors.numpy import save_file

    from minillama.io.hf import read_safetensors_file
    cfg, params = _cfg(), _params(_cfg())
    d = save_hf(tmp_path / "hf", cfg, params)
    good, _ = read_safetensors_file(d / "model.safetensors")
    t = dict(good)
    t["model.layers.0.mlp.up_proj.weight"] = np.zeros((41, 32), np.float32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(MinillamaError, match="shape"):
        load_model(d)
    t = dict(good)
    t["model.norm.weight"] = np.ones(32, np.int32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(MinillamaError, match="unsupported dtype I32"):
        load_model(d)
    t = dict(good)
    del t["model.layers.1.self_attn.v_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(MinillamaError, match="missing parameter"):
        load_model(d)
    save_file(good, str(d / "model.safetensors"))
    conf = json.loads((d / "config.json").read_text())
    for patch, msg in [({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
                        "rope scaling type 'longrope' is not supported"),
                       ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
                        r"llama3\): factor"),
                       ({"attention_bias": True}, "missing parameter.*attention.wq.bias"),
                       ({"model_type": "gpt2"}, "model_type"),
                       ({"hidden_size": None}, "bad field")]:
        (d / "config.json").write_text(json.dumps({**conf, **patch}))
        with pytest.raises(MinillamaError, match=msg):
            load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(MinillamaError, match="corrupt"):
        load_model(d)


def test_corrupt_safetensors(tmp_path):
    cfg, params = _cfg(), _params(_cfg())
    d = save_hf(tmp_path / "hf", cfg, params)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-64])
    with pytest.raises(MinillamaError, match="truncated"):
        load_model(d)
    f.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    with pytest.raises(MinillamaError, match="overruns"):
        load_model(d)
    f.unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK")
    with pytest.raises(MinillamaError, match="never unpickles"):
        load_model(d)
    own = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    raw = own.read_bytes()
    own.write_bytes(raw[:-50])
    with pytest.raises(MinillamaError):
        load_model(own)


def test_detect_format_errors(tmp_path):
    with pytest.raises(MinillamaError, match="not found"):
        detect_format(tmp_path / "nope.bin")
    with pytest.raises(MinillamaError, match="without config.json"):
        detect_format(tmp_path)
