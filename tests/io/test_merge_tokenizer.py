"""`minillama merge` writes a folder that the other commands take with no flag: the base's
tokenizer and chat template come along (a Hugging Face base's files, a GGUF base's byte-level BPE
written as tokenizer.json); `quantize` carries the tokenizer into the GGUF file or refuses in one
line."""

from __future__ import annotations

import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.hf import save_hf
from minillama.io.load import load_model, load_params
from minillama.io.peft import save_peft
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer, load_gguf_tokenizer
from minillama.model.lora import LoRA, LoRAConfig
from minillama.model.transformer import init_params

TEXTS = ["The capital of France is", "<|im_start|>user\nwörld 123\t tabs<|im_end|>\n", " ok!!"]


def test_merge_of_a_gguf_base_keeps_its_tokenizer_and_quantize_carries_it(smollm2_gguf,
                                                                          tmp_path, capsys):
    pytest.importorskip("gguf")
    model, tok = load_model(smollm2_gguf, backend="reference")
    lora = LoRA(model, LoRAConfig(rank=2, alpha=4, targets=("q",)), seed=0)
    save_peft(lora, tmp_path / "ad")
    out = tmp_path / "merged"
    assert cli.main(["merge", str(smollm2_gguf), str(tmp_path / "ad"), "--out", str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        assert (out / name).is_file(), name
    got = load_params(out)[3]
    assert isinstance(got, HFTokenizer)
    for text in TEXTS:
        assert got.encode(text) == tok.encode(text), text
        assert got.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert got.chat_template == tok.chat_template and got.stop_ids == tok.stop_ids
    assert (got.bos_id, got.eos_id, got.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
    # quantize keeps it: the GGUF file's tokenizer encodes alike, and generate needs no flag
    q = tmp_path / "m.gguf"
    assert cli.main(["quantize", str(out), str(q), "--type", "Q8_0"]) == 0
    back = load_gguf_tokenizer(str(q))
    assert [back.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert back.chat_template == tok.chat_template
    capsys.readouterr()
    assert cli.main(["generate", "-c", str(out), "--prompt", "Hi", "-n", "2", "--backend",
                     "numpy"]) == 0


def test_quantize_refuses_a_checkpoint_without_a_tokenizer(tmp_path, capsys):
    pytest.importorskip("gguf")
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96,
                      max_seq_len=32)
    src = save_hf(tmp_path / "bare", cfg, init_params(cfg, seed=0))
    out = tmp_path / "q.gguf"
    assert cli.main(["quantize", str(src), str(out), "--type", "Q8_0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minillama: error: ")
    assert "no tokenizer" in err and "GGUF file" in err  # the accepted kinds, GGUF included
    assert not out.exists()
    # with --tokenizer it writes, and the file carries it
    assert cli.main(["quantize", str(src), str(out), "--type", "Q8_0", "--tokenizer", "byte"]) \
        == 2  # the byte tokenizer's 258 ids do not fit a vocabulary of 96
    cfg = ModelConfig(**{**cfg.to_dict(), "vocab_size": 258})
    src = save_hf(tmp_path / "bare258", cfg, init_params(cfg, seed=0))
    assert cli.main(["quantize", str(src), str(out), "--type", "Q8_0", "--tokenizer", "byte"]) \
        == 0
    back = load_gguf_tokenizer(str(out))
    assert isinstance(back, ByteTokenizer) and back.encode("hi!") == ByteTokenizer().encode("hi!")
