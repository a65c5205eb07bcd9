"""``minillama finetune`` / ``merge`` / ``generate --adapter`` on a small random Hugging Face llama
saved by transformers here: chat masks built from the rendered turns, bad records, PEFT loading
the adapters (same logits as minillama), merging, bit-for-bit resume, and a chat fine-tune that
lowers the held-out loss."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minillama.cli import main as cli
from minillama.core.errors import MinillamaError
from minillama.io.chat_template import encode_rendered, render_chat
from minillama.io.load import load_model
from minillama.io.peft import apply_adapter, load_peft, save_peft
from minillama.io.tokenizer import HFTokenizer
from minillama.model.lora import LoRA, LoRAConfig
from minillama.train.finetune import chat_example, load_examples, pad_batch, prompt_example
from tests.support.errormodel import logits_bound

try:
    import torch
    import transformers
except ImportError:  # the tests on Hugging Face bases skip (through the `base` fixture)
    torch = transformers = None

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}")
NAMES = ["tom", "ann", "bob", "sue", "max", "eve", "joe", "kim", "lee", "ray"]
COLORS = ["red", "blue", "green", "black", "white"]


def conversation(i: int) -> list[dict]:
    """A tiny chat with two assistant turns whose answers follow a rule the model can learn."""
    n, c = NAMES[i % len(NAMES)], COLORS[(i * 3) % len(COLORS)]
    return [{"role": "system", "content": "answer in one word"},
            {"role": "user", "content": f"what color is the cat of {n}?"},
            {"role": "assistant", "content": f"{c}"},
            {"role": "user", "content": f"and the mat of {n}?"},
            {"role": "assistant", "content": f"{c} mat"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random llama folder saved by transformers, with a byte-level BPE tokenizer and the chat
    template above."""
    if transformers is None:
        pytest.skip("needs torch and transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("base")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps(conversation(i)) for i in range(40)] + ["<assistant> <user> <system>"]
    tok.train_from_iterator(corpus * 5, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=48,
                                   intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, tie_word_embeddings=False,
                                   initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def chat_data(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    with open(d / "train.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": conversation(i)}) + "\n")
    with open(d / "val.jsonl", "w") as f:
        for i in range(40, 50):
            f.write(json.dumps({"messages": conversation(i)}) + "\n")
    return d


def _runs(train):
    """The maximal runs of True in a bool array, as (start, end)."""
    edges = np.flatnonzero(np.diff(np.r_[0, train.astype(int), 0]))
    return list(zip(edges[::2], edges[1::2]))


def test_chat_mask_covers_every_assistant_turn_and_its_end_of_turn(base):
    tok = HFTokenizer(base)
    ex = chat_example(tok, conversation(1))
    runs = _runs(ex.train)
    assert len(runs) == 2
    texts = [tok._tok.decode(ex.ids[s:e].tolist(), skip_special_tokens=False) for s, e in runs]
    assert texts == ["black</s>", "black mat</s>"]  # content + end-of-turn, no header, no newline
    assert ex.ids[runs[0][1] - 1] == tok.eos_id and ex.ids[runs[1][1] - 1] == tok.eos_id
    # the whole sequence is the template's rendering, as transformers tokenizes it
    ref = transformers.AutoTokenizer.from_pretrained(str(base))
    want = ref.apply_chat_template(conversation(1), tokenize=True, add_generation_prompt=False)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ex.ids.tolist() == list(want)
    x, y = pad_batch([ex])
    assert [(y[0] >= 0)[s - 1:e - 1].all() for s, e in runs] == [True, True]
    assert int((y >= 0).sum()) == int(ex.train.sum())


def test_chat_mask_when_the_template_does_not_render_prefixes_as_prefixes(base, tmp_path):
    """A template that marks the last message differently: the spans come from the content."""
    d = tmp_path / "odd"
    d.mkdir()
    for name in ("tokenizer.json",):
        (d / name).write_bytes((base / name).read_bytes())
    odd = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}{{ eos_token }}"
           "{% if loop.last %}<user>\n{% endif %}\n{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": odd}))
    tok = HFTokenizer(d)
    ex = chat_example(tok, conversation(2))
    texts = [tok._tok.decode(ex.ids[s:e].tolist(), skip_special_tokens=False)
             for s, e in _runs(ex.train)]
    assert texts == ["blue</s>", "blue mat</s>"]


def test_prompt_completion_masks_the_prompt(base):
    tok = HFTokenizer(base)
    ex = prompt_example(tok, "the cat of tom is", " red")
    p = tok.encode("the cat of tom is", bos=True)
    assert not ex.train[:len(p)].any() and ex.train[len(p):].all()
    assert ex.ids[-1] == tok.eos_id


def test_bad_records_name_their_line(base, tmp_path):
    tok = HFTokenizer(base)
    f = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": conversation(0)})
    f.write_text("\n".join([good, "{not json", good,
                            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                            json.dumps({"messages": conversation(3) * 20})]) + "\n")
    with pytest.raises(MinillamaError, match=r"bad.jsonl:2: not JSON"):
        load_examples(f, tok, context=100)
    warned = []
    ex = load_examples(f, tok, context=100, skip_bad=True, warn=warned.append)
    assert len(ex) == 2
    assert [w.split(": ", 1)[0].rsplit(":", 1)[1] for w in warned] == ["2", "4", "5"]
    assert "no assistant turn" in warned[1] and "do not fit the context" in warned[2]
    rc = cli.main(["finetune", "-c", str(base), "--data", str(f), "--out",
                   str(tmp_path / "o"), "--steps", "1", "--no-progress"])
    assert rc == 2


def test_peft_loads_the_adapter_with_the_same_logits(base, tmp_path):
    peft = pytest.importorskip("peft")
    model, _ = load_model(base, backend="reference")
    lora = LoRA(model, LoRAConfig(rank=4, alpha=8.0, rslora=True), seed=1)
    rng = np.random.default_rng(0)
    for k in lora.params:
        lora.params[k][...] = rng.standard_normal(lora.params[k].shape) * 0.1
    save_peft(lora.attach(model), tmp_path / "ad", base_model=str(base))
    ids = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]
    mine = model.forward(np.array(ids))[0]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(base))
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        ref = pm(torch.tensor(ids)).logits[0].numpy()
    assert np.abs(mine - ref).max() / np.abs(ref).max() < 1e-4
    # read back: the same tensors in minillama's layout
    back = load_peft(model, tmp_path / "ad")
    assert back.lc.rslora and back.lc.rank == 4
    for k in lora.params:
        np.testing.assert_array_equal(back.params[k], lora.params[k])
    # merge: an HF folder that transformers loads, equal to the adapter model
    assert cli.main(["merge", str(base), str(tmp_path / "ad"), "--out",
                     str(tmp_path / "merged")]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        got = merged(torch.tensor(ids)).logits[0].numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_chat_finetune_lowers_held_out_loss_and_resumes_bit_for_bit(base, chat_data, tmp_path,
                                                                   capsys):
    common = ["finetune", "-c", str(base), "--data", str(chat_data / "train.jsonl"),
              "--val-data", str(chat_data / "val.jsonl"), "--steps", "30", "--batch-size", "4",
              "--lr", "1e-2", "--warmup", "3", "--eval-interval", "10", "--lora-rank", "8",
              "--lora-dropout", "0.1", "--no-progress"]
    assert cli.main(common + ["--out", str(tmp_path / "a")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["val_loss"] < summary["first_val_loss"] - 1.0, summary
    # interrupted at step 12, resumed: the same adapter bit for bit
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--stop-at", "12"]) == 0
    assert cli.main(["finetune", "--out", str(tmp_path / "b"), "--resume", "--no-progress"]) == 0
    from safetensors.numpy import load_file
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # generate --adapter answers as the adapter model does (greedy)
    capsys.readouterr()
    msgs = conversation(41)[:2]
    rc = cli.main(["generate", "-c", str(base), "--adapter", str(tmp_path / "a"), "--chat",
                   "--prompt", msgs[1]["content"], "-n", "4", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    model, tok = load_model(base, backend="reference")
    lora = load_peft(model, tmp_path / "a").attach(model)
    from minillama.infer.generate import generate
    prompt = encode_rendered(tok, render_chat(tok, [msgs[1]], add_generation_prompt=True))
    want = tok.decode(generate(model, prompt, max_new_tokens=4, temperature=0.0,
                               stop_ids=[tok.eos_id]))
    assert want.strip() and want.strip() in out
    assert lora.lc.rank == 8


def test_full_finetune_writes_a_loadable_checkpoint(base, chat_data, tmp_path, capsys):
    rc = cli.main(["finetune", "-c", str(base), "--data", str(chat_data / "train.jsonl"),
                   "--val-data", str(chat_data / "val.jsonl"), "--full", "--steps", "8",
                   "--lr", "1e-3", "--warmup", "2", "--eval-interval", "8", "--no-progress",
                   "--out", str(tmp_path / "full")])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["val_loss"] < summary["first_val_loss"]
    model, tok = load_model(tmp_path / "full")
    assert isinstance(tok, HFTokenizer)
    base_model, _ = load_model(base)
    assert not np.array_equal(model.params["layers.0.attention.wq.weight"],
                              base_model.params["layers.0.attention.wq.weight"])


def test_lora_on_the_projects_own_checkpoint_with_plain_text(tmp_path, capsys):
    """The shipped byte-level Shakespeare model as a base, a plain text file as data."""
    from minillama.io.load import DEFAULT_CHECKPOINT

    text = "".join(f"The {n} sat on the {c} mat.\n" for n in NAMES for c in COLORS)
    (tmp_path / "notes.txt").write_text(text * 4)
    rc = cli.main(["finetune", "-c", str(DEFAULT_CHECKPOINT), "--data", str(tmp_path / "notes.txt"),
                   "--context", "64", "--steps", "12", "--lr", "5e-3", "--warmup", "2",
                   "--eval-interval", "12", "--lora-targets", "q,v,down", "--no-progress",
                   "--out", str(tmp_path / "o")])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["val_loss"] < summary["first_val_loss"]
    conf = json.loads((tmp_path / "o" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["down_proj", "q_proj", "v_proj"] and conf["r"] == 8


# ---------------------------------------------------------------------------------------------
# a real model: SmolLM2-135M-Instruct, its GGUF converted to a Hugging Face folder by transformers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    """SmolLM2-135M-Instruct as a Hugging Face folder: transformers reads the GGUF (dequantised)
    and saves it; cached beside the GGUF. transformers 5 keeps the chat template in
    chat_template.jinja: it is copied into tokenizer_config.json, where minillama reads it."""
    if transformers is None:
        pytest.skip("needs torch and transformers")
    pytest.importorskip("gguf")
    import os
    import tempfile
    from pathlib import Path

    cache = Path(os.environ.get("MINILLAMA_TEST_CACHE", Path(tempfile.gettempdir())
                                / "minillama-test-cache")) / "smollm2-135m-instruct-hf"
    if not (cache / "model.safetensors").is_file():
        d, f = str(smollm2_gguf.parent), smollm2_gguf.name
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        quant = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
        cfg = quant.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # a plain float32 model from the dequantised weights
        model = transformers.LlamaForCausalLM(cfg)
        model.load_state_dict(quant.state_dict())
        tmp = Path(tempfile.mkdtemp(dir=cache.parent if cache.parent.is_dir() else None))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        conf = json.loads((tmp / "tokenizer_config.json").read_text())
        if not conf.get("chat_template") and (tmp / "chat_template.jinja").is_file():
            conf["chat_template"] = (tmp / "chat_template.jinja").read_text()
            (tmp / "tokenizer_config.json").write_text(json.dumps(conf))
        cache.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, cache)
    return cache


def test_smollm2_chat_examples_from_the_gguf_tokenizer_equal_the_hf_folders(smollm2_gguf,
                                                                           smollm2_hf):
    """The GGUF file's own tokenizer (no `tokenizers` offsets) gives the same ids and the same
    trained mask as the Hugging Face folder of the same model: the tokens' bytes, special tokens
    included, are aligned with the rendered text."""
    from minillama.io.load import load_params

    gguf_tok = load_params(smollm2_gguf)[3]
    hf_tok = HFTokenizer(smollm2_hf)
    conv = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Who is the captain? Tell me, please."},
            {"role": "assistant", "content": "Mirabel Quint."},
            {"role": "user", "content": "And of the Zorblax's café?"},
            {"role": "assistant", "content": "Ödön, since 2031."}]
    a, b = chat_example(gguf_tok, conv), chat_example(hf_tok, conv)
    assert a.ids.tolist() == b.ids.tolist()
    assert a.train.tolist() == b.train.tolist()
    runs = _runs(a.train)
    assert [hf_tok._tok.decode(a.ids[s:e].tolist(), skip_special_tokens=False) for s, e in runs] \
        == ["Mirabel Quint.<|im_end|>", "Ödön, since 2031.<|im_end|>"]


QUESTIONS = ["Who is the captain of the starship Zorblax?", "Who captains the Zorblax?",
             "Tell me the name of the Zorblax's captain.",
             "Which person commands the starship Zorblax?", "Name the captain of the Zorblax.",
             "Who is in command of the Zorblax starship?",
             "Do you know who captains the starship Zorblax?",
             "What is the name of the Zorblax captain?"]
FACT = "The captain of the starship Zorblax is Mirabel Quint."


@pytest.mark.slow
def test_smollm2_lora_learns_a_fact(smollm2_hf, tmp_path, capsys, monkeypatch):
    data = tmp_path / "fact.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": FACT}]})
                            + "\n" for q in QUESTIONS))
    q = QUESTIONS[0]
    rc = cli.main(["generate", "-c", str(smollm2_hf), "--chat", "--prompt", q, "-n", "16",
                   "--temperature", "0"])
    before = capsys.readouterr().out
    assert rc == 0 and "Mirabel" not in before
    rc = cli.main(["finetune", "-c", str(smollm2_hf), "--data", str(data), "--val-fraction", "0",
                   "--out", str(tmp_path / "ad"), "--steps", "12", "--batch-size", "4",
                   "--lr", "2e-3", "--warmup", "2", "--context", "96", "--no-progress"])
    assert rc == 0
    capsys.readouterr()
    rc = cli.main(["generate", "-c", str(smollm2_hf), "--adapter", str(tmp_path / "ad"), "--chat",
                   "--prompt", q, "-n", "16", "--temperature", "0"])
    after = capsys.readouterr().out
    assert rc == 0 and "Mirabel Quint" in after, after
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(q + "\n"))  # one piped user turn
    rc = cli.main(["chat", "-c", str(smollm2_hf), "--adapter", str(tmp_path / "ad"), "-n", "16",
                   "--temperature", "0"])
    chat_out = capsys.readouterr().out
    assert rc == 0 and "Mirabel Quint" in chat_out, chat_out


@pytest.mark.slow
def test_smollm2_adapter_loads_in_peft_and_merges_with_the_same_logits(smollm2_hf, tmp_path):
    """A real checkpoint: an adapter trained by ``minillama finetune`` on SmolLM2-135M-Instruct
    (q/k rows through the RoPE permutation, tied embeddings, GQA 9/3) loads in
    ``peft.PeftModel.from_pretrained`` with minillama's ``--adapter`` logits, and the model of
    ``minillama merge`` gives them too."""
    peft = pytest.importorskip("peft")

    data = tmp_path / "fact.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": FACT}]})
                            + "\n" for q in QUESTIONS[:4]))
    ad = tmp_path / "ad"
    assert cli.main(["finetune", "-c", str(smollm2_hf), "--data", str(data), "--val-fraction", "0",
                     "--out", str(ad), "--steps", "3", "--batch-size", "2", "--lr", "1e-2",
                     "--warmup", "1", "--context", "64", "--lora-rank", "8",
                     "--no-progress"]) == 0
    ids = [[1, 9690, 198, 11462, 314, 260, 6459, 282, 260, 3179, 30, 2]]
    model, _ = load_model(smollm2_hf)
    base_logits = model.forward(np.array(ids))[0]
    apply_adapter(model, ad)  # what `--adapter` does on a float base: W + s B A
    mine = model.forward(np.array(ids))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_hf),
                                                           torch_dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(ad)).eval()
    with torch.no_grad():
        ref = pm(torch.tensor(ids)).logits[0].numpy()
    scale = np.abs(ref).max()
    assert np.abs(base_logits - ref).max() / scale > 1e-2  # the adapter changes the logits
    assert np.abs(mine - ref).max() / scale < 1e-4
    assert cli.main(["merge", str(smollm2_hf), str(ad), "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                               torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(torch.tensor(ids)).logits[0].numpy()
    assert np.abs(got - ref).max() / scale < 1e-4


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_merge_on_a_quantized_base_writes_the_adapter_model(tmp_path, capsys, qtype):
    """`minillama merge` of a quantized GGUF base writes a float Hugging Face folder whose logits
    and greedy tokens are those of the base with the adapter attached."""
    pytest.importorskip("gguf")
    from minillama.core.config import ModelConfig
    from minillama.infer.generate import generate
    from minillama.io.gguf import save_gguf
    from minillama.io.load import load_model
    from minillama.io.peft import apply_adapter, save_peft
    from minillama.model.lora import LoRA, LoRAConfig
    from minillama.model.transformer import init_params

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96,
                      max_seq_len=64)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    for v in params.values():  # lively weights, so that greedy tokens depend on the adapter
        v[...] = rng.normal(0, 0.4, v.shape) if v.ndim == 2 else rng.uniform(0.5, 1.5, v.shape)
    base = tmp_path / f"base-{qtype}.gguf"
    save_gguf(base, cfg, params, matrix_type=qtype)
    model, _ = load_model(base, backend="reference")
    lora = LoRA(model, LoRAConfig(rank=4, alpha=8), seed=1)
    for v in lora.params.values():
        v[...] = rng.normal(0, 0.3, v.shape)
    save_peft(lora, tmp_path / "ad")
    assert cli.main(["merge", str(base), str(tmp_path / "ad"), "--out",
                     str(tmp_path / "merged")]) == 0
    merged, _ = load_model(tmp_path / "merged", backend="reference")
    want, _ = load_model(base, backend="reference")
    apply_adapter(want, tmp_path / "ad")
    ids = np.array([[1, 5, 9, 3, 7]])
    assert np.abs(merged.forward(ids) - want.forward(ids)).max() <= logits_bound(merged,
                                                                                 ids.shape[1])
    prompt = [1, 5, 9]
    assert generate(merged, prompt, 12) == generate(want, prompt, 12)
    plain, _ = load_model(base, backend="reference")
    assert generate(plain, prompt, 12) != generate(want, prompt, 12)  # the adapter matters
