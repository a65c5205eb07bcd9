"""GGUF (llama.cpp) files: written here with the `gguf` package, read by minillama; the
dequantisation is held to the package's own, and the logits to the same weights loaded another
way (the original float32 arrays, the package's dequantised arrays, or transformers for qwen2)."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.gguf import dequantize
from minillama.io.hf import interleaved_to_hf
from minillama.io.load import detect_format, load_model
from minillama.model.transformer import Transformer, init_params
from tests.support.errormodel import logits_bound

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=272, hidden_dim=96,
                  max_seq_len=32, tie_embeddings=False)
TOKENS = [8, 40, 41, 3, 100, 200, 7, 66, 99, 130]

_GGUF_LAYER = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
               "attention.wv": "attn_v", "attention.wo": "attn_output", "ffn_norm": "ffn_norm",
               "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
               "feed_forward.w3": "ffn_up"}


def gguf_name(ours: str) -> str:
    top = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "output.weight": "output.weight"}
    if ours in top:
        return top[ours]
    _, layer, rest = ours.split(".", 2)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[base]}.{kind}"


def spm_vocab():
    """A SentencePiece-style vocabulary: control pieces, 256 byte pieces, a few words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["\u2581", "t", "h", "e", "c", "a", "s", "\u2581t", "\u2581th", "\u2581the", "at",
              "\u2581c", "\u2581cat"]
    return tokens + pieces, [0.0] * 259 + [-float(i) for i in range(len(pieces))]


def write_gguf(path, cfg, params, qtype=Q.F32, arch="llama", tokenizer=True, extra=None):
    """A GGUF file of ``params`` (Meta names, interleaved RoPE rows): matrices stored as
    ``qtype``, norms and biases float32. Returns the arrays as the file holds them, dequantised
    by the gguf package (what minillama must reproduce)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if tokenizer:
        tokens, scores = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    held = {}
    for name, a in params.items():
        a = np.asarray(a, dtype=np.float32)
        if arch == "qwen2" and (".wq." in name or ".wk." in name):  # half-split rows, as HF
            a = interleaved_to_hf(a, cfg.n_heads if ".wq." in name else cfg.n_kv_heads)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), a)
            held[name] = a
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
            held[name] = a.astype(np.float16).astype(np.float32)
        else:
            raw = gguf.quants.quantize(a, qtype)
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(raw, qtype).reshape(a.shape).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
def test_dequantize_matches_the_gguf_package(qtype):
    rng = np.random.default_rng(0)
    a = rng.normal(0, 1, (8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(a, qtype) if qtype != Q.F16 else a.astype(np.float16)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(a.shape)
    got = dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), qtype.name,
                     a.size).reshape(a.shape)
    np.testing.assert_array_equal(got, ref)
    assert np.abs(got - a).max() < {Q.F16: 1e-2, Q.BF16: 2e-2, Q.Q8_0: 5e-2, Q.Q4_0: 0.5}[qtype]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
def test_gguf_logits_equal_the_same_weights_loaded_directly(qtype, tmp_path):
    params = init_params(CFG, seed=3)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    held = write_gguf(path, CFG, params, qtype)
    assert detect_format(path) == "gguf"
    model, tok = load_model(path, backend="numpy")
    want = {**CFG.to_dict(), "norm_eps": float(np.float32(CFG.norm_eps))}  # stored as float32
    assert model.cfg.to_dict() == want
    if qtype == Q.F32:
        for k, v in params.items():
            np.testing.assert_array_equal(model.params[k], v)
    float_model = Transformer(CFG, held, backend="numpy")
    ref = float_model.forward(np.array([TOKENS]))
    got = model.forward(np.array([TOKENS]))
    assert np.abs(got - ref).max() <= logits_bound(float_model, len(TOKENS))
    # the tokenizer from the metadata: byte fallback, the word pieces merge, BOS/EOS ids
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == 272
    ids = tok.encode("the cat sat \u00e9", bos=True)
    pieces = spm_vocab()[0]
    assert [pieces[i] for i in ids[:3]] == ["<s>", "\u2581the", "\u2581cat"]
    assert [pieces[i] for i in ids[-2:]] == ["<0xC3>", "<0xA9>"]  # byte fallback for U+00E9
    assert tok.decode(ids) == "the cat sat \u00e9"


def test_qwen2_gguf_matches_transformers(tmp_path):
    """A transformers Qwen2 model (q/k/v biases, half-split RoPE rows) as a GGUF file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from minillama.io.hf import load_hf

    hf_cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    write_gguf(tmp_path / "q.gguf", cfg, params, Q.F32, arch="qwen2", tokenizer=False)
    model, tok = load_model(tmp_path / "q.gguf", backend="numpy")
    assert tok is None and model.cfg.qkv_bias and model.cfg.tie_embeddings
    ids = [t % 97 for t in TOKENS]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = model.forward(np.array([ids]))[0]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_unsupported_and_corrupt_gguf_are_one_line(tmp_path):
    params = init_params(CFG, seed=0)
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, CFG, params, Q.MXFP4)
    with pytest.raises(MinillamaError, match="GGML type MXFP4, which is not supported") as e:
        load_model(path)
    assert "\n" not in str(e.value)
    good = tmp_path / "good.gguf"
    write_gguf(good, CFG, params, Q.F32)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(MinillamaError, match="cut.gguf"):
        load_model(cut)
    arch = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(arch), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MinillamaError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(arch)


def test_gguf_gpt2_tokenizer_matches_the_tokenizers_library(tmp_path):
    """A byte-level BPE tokenizer (Llama 3 / GPT-2 kind) stored the GGUF way (tokens, merges,
    token types, pre-tokenizer name) gives the ids of the tokenizers library."""
    import json

    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    lib = tokenizers.Tokenizer(models.BPE())
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.decoder = decoders.ByteLevel()
    lib.train_from_iterator(["the cat sat on the mat, didn't it? 42 caf\u00e9s"] * 40,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    lib.save(str(tmp_path / "tokenizer.json"))
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=len(tokens), hidden_dim=48,
                      max_seq_len=16)
    path = tmp_path / "bpe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 16), ("embedding_length", 32), ("block_count", 1),
                       ("feed_forward_length", 48), ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    for name, a in init_params(cfg, seed=0).items():
        w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, tok = load_model(path)
    assert (tok.bos_id, tok.eos_id) == (vocab["<s>"], vocab["</s>"])
    rng = np.random.default_rng(0)
    for _ in range(40):
        text = "".join(chr(int(c)) for c in rng.integers(0x20, 0x2000, rng.integers(1, 20)))
        text += " the cat sat, didn't it? 1234 <s>"
        assert tok.encode(text) == lib.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == text.replace("<s>", "")


def test_rope_freqs_tensor_is_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1's RoPE bands as a rope_freqs tensor f (theta_i / f_i): loading
    it gives the logits of the same weights under the llama3 rope_scaling."""
    from minillama.core.ops import rope_frequencies

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = ModelConfig(**{**CFG.to_dict(), "rope_scaling": llama3})
    params = init_params(cfg, seed=5)
    plain = rope_frequencies(cfg.head_dim, cfg.rope_theta)[0]
    factors = (plain / rope_frequencies(cfg.head_dim, cfg.rope_theta, llama3)[0])
    assert factors.min() == 1.0 and factors.max() == 8.0  # every band is present
    assert ((factors > 1) & (factors < 8)).any()
    write_gguf(tmp_path / "l3.gguf", CFG, params,
               extra={"rope_freqs.weight": factors.astype(np.float32)})
    model, _ = load_model(tmp_path / "l3.gguf", backend="numpy")
    assert model.cfg.rope_scaling["rope_type"] == "freq_factors"
    float_model = Transformer(cfg, params, backend="numpy")
    ref = float_model.forward(np.array([TOKENS]))
    got = model.forward(np.array([TOKENS]))
    assert np.abs(got - ref).max() <= logits_bound(float_model, len(TOKENS))
    # and back out through the exporter
    from minillama.io.gguf import save_gguf
    save_gguf(tmp_path / "again.gguf", model.cfg,
              {k: np.asarray(v) for k, v in model.params.items()})
    again, _ = load_model(tmp_path / "again.gguf", backend="numpy")
    np.testing.assert_array_equal(again.forward(np.array([TOKENS])), got)
