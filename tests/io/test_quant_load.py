"""GGUF files with block-quantized tensors: every type of ``minillama.core.quant.QUANT_TYPES``
loads, its matrices stay quantized (a QuantMatrix over the file's bytes), and the model gives the
logits of the same model with the matrices dequantized by the `gguf` package; malformed tensor
tables are one-line errors (exit 2 through the CLI). The real-file checks against transformers
are in ``test_quant_smollm2.py``."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES, QuantMatrix
from minillama.io.gguf import GGUFFile, load_gguf
from minillama.io.load import load_model
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import Transformer, init_params
from tests.support.errormodel import logits_bound
from tests.support.quantblocks import random_quant_rows

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

#: every row a whole number of 256-value super-blocks, so one config serves every type
CFG = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=48, hidden_dim=256,
                  max_seq_len=16, tie_embeddings=False)
TOKENS = np.array([[1, 5, 9, 40, 3, 3, 17, 2]])
NAMES = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
         "output.weight": "output.weight"}
LAYER = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
         "attention.wv": "attn_v", "attention.wo": "attn_output", "ffn_norm": "ffn_norm",
         "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
         "feed_forward.w3": "ffn_up"}


def gguf_name(ours: str) -> str:
    if ours in NAMES:
        return NAMES[ours]
    _, layer, rest = ours.split(".", 2)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[base]}.{kind}"


def write_quant_gguf(path, cfg, qtype: str, seed=0, tokenizer=True, arch="llama"):
    """A llama GGUF with every matrix as ``qtype`` (quantized by the gguf package where it can,
    else random valid blocks), vectors F32. Returns the params as the gguf package dequantizes
    them (what minillama must compute with)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    for add, v in ((w.add_context_length, cfg.max_seq_len), (w.add_embedding_length, cfg.dim),
                   (w.add_block_count, cfg.n_layers), (w.add_feed_forward_length, cfg.hidden_dim),
                   (w.add_head_count, cfg.n_heads), (w.add_head_count_kv, cfg.n_kv_heads),
                   (w.add_layer_norm_rms_eps, cfg.norm_eps),
                   (w.add_rope_freq_base, cfg.rope_theta)):
        add(v)
    if tokenizer:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(cfg.vocab_size - 3)])
        w.add_token_scores([0.0] * cfg.vocab_size)
    held = {}
    for name, a in init_params(cfg, seed=seed).items():
        if a.ndim == 1:
            a = (1 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
            w.add_tensor(gguf_name(name), a)
            held[name] = a
            continue
        try:
            raw = gguf.quants.quantize(a, Q[qtype])
        except NotImplementedError:  # K-quant scales multiply 6-bit sub-block scales
            raw = random_quant_rows(qtype, *a.shape, rng,
                                    0.0002 if QUANT_TYPES[qtype].block_elems == 256 else 0.002)
        w.add_tensor(gguf_name(name), raw, raw_dtype=Q[qtype])
        held[name] = gguf.quants.dequantize(raw, Q[qtype]).reshape(a.shape).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_every_block_type_loads_quantized_with_the_dequantized_logits(qtype, tmp_path):
    cfg = ModelConfig(**{**CFG.to_dict(), "tie_embeddings": qtype in ("Q4_1", "Q6_K", "IQ4_NL")})
    path = tmp_path / f"tiny-{qtype}.gguf"
    held = write_quant_gguf(path, cfg, qtype)
    _, params, tok = load_gguf(path)
    assert tok is not None and set(params) == set(held)
    for k, v in params.items():
        if np.ndim(held[k]) == 2:  # kept in blocks: no float copy of W
            assert isinstance(v, QuantMatrix) and v.qtype == qtype and v.shape == held[k].shape
        else:
            assert isinstance(v, np.ndarray) and v.dtype == np.float32
            np.testing.assert_array_equal(v, held[k])
    ref = Transformer(cfg, held, backend="reference")
    want = ref.forward(TOKENS)
    # the same float32 model computed two ways (blocks dequantized per matrix or per row tile,
    # another BLAS kernel family): within the rounding bound of two evaluations of its logits
    tol = logits_bound(ref, TOKENS.shape[1])
    for backend in ("reference", "numpy"):
        model, _ = load_model(path, backend=backend)
        if cfg.tie_embeddings:
            assert model.output_weight is model.params["tok_embeddings.weight"]
        got = model.forward(TOKENS)
        assert np.abs(got - want).max() <= tol, (backend, qtype, np.abs(got - want).max(), tol)


def _tensor_field(path, name):
    """(offset of the field's n_dims, n_dims, offset of its type id) in the tensor table."""
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    at = t.field.offset + 8 + len(name.encode())
    n = len(t.shape)
    return at, n, at + 4 + 8 * n


def _patched(path, out, name, dims=None, type_id=None):
    data = bytearray(path.read_bytes())
    at, n, type_at = _tensor_field(path, name)
    if dims is not None:
        struct.pack_into(f"<{n}Q", data, at + 4, *dims)
    if type_id is not None:
        struct.pack_into("<I", data, type_at, type_id)
    out.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "good.gguf"
    write_quant_gguf(path, CFG, "Q8_0")
    return path


def _bad_cases(good, d):
    """(file, words of its error)"""
    wq = "blk.0.attn_q.weight"  # (256, 256) Q8_0, not the last tensor
    cut = d / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-4096])
    return [
        (_patched(good, d / "unknown.gguf", wq, type_id=99),
         f"tensor {wq} has unknown GGML type id 99"),
        (_patched(good, d / "iq2.gguf", wq, type_id=Q.IQ2_XXS.value),
         f"tensor {wq} has GGML type IQ2_XXS, which is not supported"),
        (_patched(good, d / "rows.gguf", wq, dims=(240, 256)),
         f"tensor {wq} (Q8_0) has rows of 240 values, not a whole number of blocks of 32"),
        (_patched(good, d / "bytes.gguf", wq, dims=(256, 300)),
         f"tensor {wq} (Q8_0, [300, 256]) needs 81600 bytes, but tensor"),
        (cut, "beyond the end of the file"),
    ]


def test_bad_tensor_tables_are_one_line_errors(q8_file, tmp_path):
    for path, words in _bad_cases(q8_file, tmp_path):
        with pytest.raises(MinillamaError) as e:
            load_gguf(path)
        msg = str(e.value)
        assert words in msg and str(path) in msg and "\n" not in msg, (path.name, msg)


def test_bad_tensor_tables_exit_2_through_the_cli(q8_file, tmp_path, capsys):
    for path, words in _bad_cases(q8_file, tmp_path):
        rc = cli.main(["generate", "--checkpoint", str(path), "--backend", "numpy", "-n", "2",
                       "--prompt", "hi"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("minillama: error: ")
        assert words in err[0], err


def test_nan_block_scale_is_refused(q8_file, tmp_path):
    data = bytearray(q8_file.read_bytes())
    r = gguf.GGUFReader(str(q8_file))
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight")
    struct.pack_into("<H", data, t.data_offset + 34 * 5, 0x7E00)  # block 5's d: a float16 NaN
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(MinillamaError, match=r"layers.1.feed_forward.w3 \(Q8_0\) holds 1 NaN/inf"):
        load_gguf(bad)


def test_a_quantized_model_is_not_trained(q8_file, tmp_path, capsys):
    """train --init-from a quantized file: one line, exit 2 (its matrices are frozen)."""
    cfg = ModelConfig(**{**CFG.to_dict(), "vocab_size": ByteTokenizer.vocab_size, "dim": 64,
                         "hidden_dim": 64, "head_dim": None, "n_layers": 1})
    path = tmp_path / "bytes.gguf"
    write_quant_gguf(path, cfg, "Q4_0", tokenizer=False)
    rc = cli.main(["train", "--init-from", str(path), "--steps", "1", "--out",
                   str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "quantized Q4_0 matrix" in err[0], err


def test_export_widens_quantized_matrices(q8_file, tmp_path, capsys):
    """export of a quantized file writes the dequantized weights: the same logits back."""
    out = tmp_path / "f32.gguf"
    assert cli.main(["export", str(q8_file), "--format", "gguf", "--out", str(out)]) == 0
    a, _ = load_model(q8_file, backend="reference")
    b, _ = load_model(out, backend="reference")
    assert not any(isinstance(v, QuantMatrix) for v in b.params.values())
    np.testing.assert_array_equal(b.forward(TOKENS), a.forward(TOKENS))


def test_header_cut_anywhere_is_one_line(q8_file, tmp_path):
    """The header parser checks every read: a file cut inside its metadata or tensor table is
    a one-line error naming the file, never an exception from below."""
    data = q8_file.read_bytes()
    table_end = GGUFFile(q8_file).tensor_start
    for n in sorted({0, 3, 4, 8, 15, 23, 24, 40, 100, 1000, 5000, table_end - 9, table_end - 1}):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(MinillamaError) as e:
            load_gguf(cut)
        assert str(cut) in str(e.value) and "\n" not in str(e.value), (n, str(e.value))


def test_reading_needs_no_gguf_package(q8_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails
    cfg, params, tok = load_gguf(q8_file)
    assert cfg.dim == CFG.dim and isinstance(params["output.weight"], QuantMatrix)
    assert tok.vocab_size == CFG.vocab_size


def test_qwen2_rows_are_permuted_in_their_blocks(tmp_path):
    """A qwen2 file keeps q/k rows in the half-split RoPE order; the loader reorders whole rows
    of blocks (a QuantMatrix row is a row of W) into the interleaved order."""
    from minillama.core.quant import dequantize
    from minillama.io.hf import hf_to_interleaved

    path = tmp_path / "qwen2.gguf"
    held = write_quant_gguf(path, CFG, "Q4_K", arch="qwen2")
    _, params, _ = load_gguf(path)
    for key, heads in (("layers.1.attention.wq.weight", CFG.n_heads),
                       ("layers.1.attention.wk.weight", CFG.n_kv_heads)):
        assert isinstance(params[key], QuantMatrix)
        want = hf_to_interleaved(held[key], heads)
        assert not np.array_equal(want, held[key])
        np.testing.assert_array_equal(dequantize(params[key]), want)
    np.testing.assert_array_equal(dequantize(params["layers.1.attention.wv.weight"]),
                                  held["layers.1.attention.wv.weight"])
