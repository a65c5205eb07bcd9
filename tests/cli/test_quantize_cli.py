"""`minillama quantize` and save_gguf with quantized tensors: the files are held to what the
``gguf`` package, minillama's loader and transformers read from them (logits equal to the same
model carrying the dequantized weights), the type mixtures to llama.cpp's rules."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from minillama.cli.main import main
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.core.quantize import plan_types, quantize_params, resolve_type
from minillama.io.gguf import save_gguf
from minillama.io.load import load_model, load_params
from minillama.model.transformer import Transformer, init_params
from tests.support.errormodel import logits_bound

gguf = pytest.importorskip("gguf")

SHIPPED = "minillama/weights/shakespeare.safetensors"


def tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def decoded(params):
    """``params`` with every QuantMatrix replaced by the floats the gguf package decodes."""
    return {k: gguf.quants.dequantize(v.data, gguf.GGMLQuantizationType[v.qtype]).reshape(v.shape)
            if isinstance(v, QuantMatrix) else np.asarray(v, np.float32) for k, v in params.items()}


# ---------------------------------------------------------------------------------------------
# the plan: which type each matrix gets
# ---------------------------------------------------------------------------------------------
def test_resolve_type_falls_back_like_llama_cpp():
    assert resolve_type("Q4_K", 512) == ("Q4_K", None)
    assert resolve_type("Q4_K", 192)[0] == "Q5_0"
    assert resolve_type("Q5_K", 192)[0] == "Q5_1"
    assert resolve_type("Q6_K", 96)[0] == "Q8_0"
    kind, note = resolve_type("Q8_0", 48)
    assert kind == "F16" and "48" in note
    assert resolve_type("Q4_K", 256, np.array([1e5]))[0] == "F32"  # beyond float16
    assert resolve_type("F16", 256, np.array([-1e5]))[0] == "F32"


def test_plan_presets():
    cfg = ModelConfig(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=300,
                      hidden_dim=512, max_seq_len=32, tie_embeddings=False)
    params = init_params(cfg, seed=0)
    plan = plan_types(cfg, params, "Q4_K_M")
    assert plan["output.weight"] == "Q6_K" and plan["tok_embeddings.weight"] == "Q4_K"
    more = [i for i in range(8) if plan[f"layers.{i}.attention.wv.weight"] == "Q6_K"]
    assert more == [0, 3, 6, 7]  # first and last eighth, every third in between
    assert all(plan[f"layers.{i}.feed_forward.w2.weight"] == ("Q6_K" if i in more else "Q4_K")
               for i in range(8))
    assert {plan[f"layers.{i}.attention.wq.weight"] for i in range(8)} == {"Q4_K"}
    assert "norm.weight" not in plan
    plain = plan_types(cfg, params, "Q4_0", embedding_type="Q8_0")
    assert plain["output.weight"] == "Q6_K" and plain["tok_embeddings.weight"] == "Q8_0"
    assert plan_types(cfg, params, "Q8_0")["output.weight"] == "Q8_0"
    assert plan_types(cfg, params, "Q4_K", output_type="F16")["output.weight"] == "F16"
    tied = ModelConfig(**{**cfg.__dict__, "tie_embeddings": True})
    tparams = init_params(tied, seed=0)
    assert plan_types(tied, tparams, "Q5_K", embedding_type="Q4_0")["tok_embeddings.weight"] \
        == "Q6_K"  # the tied embeddings are the head
    with pytest.raises(MinillamaError, match="unknown tensor type"):
        plan_types(cfg, params, "Q3_X")


# ---------------------------------------------------------------------------------------------
# files: minillama and the gguf package read what was written
# ---------------------------------------------------------------------------------------------
def test_shipped_model_quantized_loads_with_its_decoded_weights(tmp_path, capsys):
    out = tmp_path / "q8.gguf"
    assert main(["quantize", SHIPPED, str(out), "--type", "Q8_0"]) == 0
    capsys.readouterr()
    types = tensor_types(out)
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    _, cfg, params, _ = load_params(SHIPPED)
    q, _, _ = quantize_params(cfg, params, "Q8_0")
    ref = Transformer(cfg, decoded(q), backend="numpy", dtype=np.float32)
    model, tok = load_model(out, backend="numpy")  # minillama's loader reads Q8_0
    assert type(tok).__name__ == "ByteTokenizer"  # the file carries the byte vocabulary
    ids = np.array([[256, 84, 104, 101, 32, 107, 105, 110, 103]])
    # the same float32 model (the blocks read back against their decoded floats) computed two
    # ways: within the rounding bound of two evaluations of its logits
    got, tol = model.forward(ids), logits_bound(ref, ids.shape[1])
    assert np.abs(got - ref.forward(ids)).max() <= tol
    orig = Transformer(cfg, params, backend="numpy", dtype=np.float32).forward(ids)
    # quantizing moves the logits, by more than rounding and by less than a tenth
    assert tol < np.abs(got - orig).max() < 0.1 * np.abs(orig).max()


def test_every_type_round_trips_through_the_gguf_package(tmp_path):
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      hidden_dim=512, max_seq_len=32, tie_embeddings=False)
    params = init_params(cfg, seed=1)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                  "IQ4_NL", "Q4_K_M", "F16"):
        q, types, _ = quantize_params(cfg, params, qtype)
        path = save_gguf(tmp_path / f"{qtype}.gguf", cfg, q, types=types)
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            if t.name == "output.weight":
                want = {"Q8_0": "Q8_0", "F16": "F16"}.get(qtype, "Q6_K")
                assert t.tensor_type.name == want, qtype
            elif t.name == "blk.0.attn_q.weight":
                assert t.tensor_type.name == qtype.replace("_M", ""), qtype
        got = {t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type)
               for t in reader.tensors}
        want = decoded(q)
        assert np.array_equal(got["blk.1.ffn_down.weight"],
                              np.asarray(want["layers.1.feed_forward.w2.weight"],
                                         dtype=np.float16 if qtype == "F16" else np.float32)
                              .astype(np.float32))
        assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file


def test_save_gguf_quantizes_itself(tmp_path):
    """save_gguf(matrix_type=...) quantizes float matrices, with the fallback per row length."""
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=40,
                      hidden_dim=96, max_seq_len=16, tie_embeddings=True)
    params = init_params(cfg, seed=2)
    path = save_gguf(tmp_path / "a.gguf", cfg, params, matrix_type="Q4_K")
    types = tensor_types(path)
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.ffn_down.weight"] == "Q5_0"
    with pytest.raises(MinillamaError, match="unknown tensor type"):
        save_gguf(tmp_path / "b.gguf", cfg, params, matrix_type="Q7")


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["quantize", SHIPPED, str(tmp_path / "x.gguf"), "--type", "Q9_9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillama: error: unknown tensor type") and err.count("\n") == 1
    assert main(["quantize", str(tmp_path / "none"), str(tmp_path / "x.gguf"),
                 "--type", "Q8_0"]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------------------------------------
# transformers reads the files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q4_K_M", "IQ4_NL"])
def test_transformers_loads_quantized_file(qtype, tmp_path, hf_tokenizer_json):
    """A random HF llama with a byte-level tokenizer, quantized by the command: transformers'
    logits from the GGUF file equal its logits from a float folder holding the weights the
    gguf package decodes; its tokenizer from the GGUF encodes like the tokenizer.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from minillama.io.hf import save_hf

    hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    src = tmp_path / "hf"
    transformers.LlamaForCausalLM(hf_cfg).eval().save_pretrained(src)
    shutil.copy(hf_tokenizer_json, src / "tokenizer.json")
    out = tmp_path / "out" / "m.gguf"
    assert main(["quantize", str(src), str(out), "--type", qtype]) == 0

    _, cfg, params, _ = load_params(src)
    q, _, _ = quantize_params(cfg, params, qtype)
    save_hf(tmp_path / "deq", cfg, decoded(q))
    try:
        from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
            out.parent, gguf_file=out.name, dtype=torch.float32).eval()
    except (ImportError, ValueError, NotImplementedError) as e:
        pytest.skip(f"transformers cannot read this GGUF: {e}")
    deq = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq",
                                                            dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 250, 3, 99, 180, 42]])
    with torch.no_grad():
        a = from_gguf(ids).logits
        b = deq(ids).logits
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-5 * b.abs().max().item())

    tok = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_tokenizer_json))
    text = "the cat sat on the mat, was it?"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text,
                                                                   add_special_tokens=False)


def test_gguf_input_keeps_its_tokenizer(tmp_path, shared_data):
    """A GGUF input's tokenizer.* metadata is copied as it is; the quantized file's tokenizer
    encodes like the original SentencePiece tokenizer."""
    from minillama.io.gguf import load_gguf_tokenizer
    from minillama.io.tokenizer import load_tokenizer

    tok = load_tokenizer(str(shared_data / "tokenizer.bin"))
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32000,
                      hidden_dim=96, max_seq_len=32, tie_embeddings=True)
    src = save_gguf(tmp_path / "in.gguf", cfg, init_params(cfg, seed=3), tokenizer=tok)
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(src), str(out), "--type", "Q4_0"]) == 0

    def fields(path):
        return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
                if k.startswith("tokenizer.")}

    a, b = fields(src), fields(out)
    assert a == b and len(a["tokenizer.ggml.tokens"]) == 32000
    text = "Once upon a time, a tiny robot dreamed of \u00e9clairs."
    assert load_gguf_tokenizer(str(out)).encode(text, bos=True) == tok.encode(text, bos=True)
    assert tensor_types(out)["token_embd.weight"] == "Q8_0"  # tied head, rows of 64: Q6_K->Q8_0
