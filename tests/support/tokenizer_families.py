"""Small tokenizer folders built like real ones of several families (the tokenizer.json pipeline,
post-processor and tokenizer_config.json of Llama 2, Llama 3, SmolLM2 and Qwen2), for tests that
compare minillama with transformers' AutoTokenizer on the same folder. Needs `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

from minillama.io.bpe import LLAMA3_PATTERN

CORPUS = ["the cat sat on the mat", "def fibonacci(n): return n", "héllo wörld, 1234!"] * 20

#: special tokens of each family, in id order from 0
SPECIALS = {"llama2": ["<unk>", "<s>", "</s>"],
            "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                       "<|end_header_id|>", "<|eot_id|>"],
            "smollm2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]}

#: split patterns of the byte-level families that have their own (digits one by one in Qwen2)
SPLIT = {"llama3": LLAMA3_PATTERN, "qwen2": LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")}


def build_family(folder, family: str, config_extra: dict | None = None,
                 chat_template: str | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json of ``family`` into ``folder``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    specials = SPECIALS[family]
    if family in ("llama2", "gemma"):  # SentencePiece-style BPE with byte fallback
        unk = "<unk>"
        tok = Tokenizer(models.BPE(unk_token=unk, byte_fallback=True, fuse_unk=True))
        # Llama 2 prepends SentencePiece's dummy-prefix space; Gemma does not
        prefix = [normalizers.Prepend("\u2581")] if family == "llama2" else []
        tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")])
        strip = [decoders.Strip(" ", 1, 0)] if family == "llama2" else []
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()] + strip)
        alphabet = specials + [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=alphabet)
    else:  # byte-level BPE
        tok = Tokenizer(models.BPE())
        if family in SPLIT:  # the family's own split pattern, then bytes
            from tokenizers import Regex
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(SPLIT[family]), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    ids = {s: tok.token_to_id(s) for s in specials}
    if family == "llama2":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])])
        cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
               "legacy": False}
    elif family == "gemma":
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", ids["<bos>"])])
        cfg = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
               "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
               "add_eos_token": False}
    elif family == "llama3":
        bot = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bot} $A", pair=f"{bot} $A {bot} $B:1",
                                          special_tokens=[(bot, ids[bot])])])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bot,
               "eos_token": "<|eot_id|>"}
    elif family == "smollm2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>",
               "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|im_end|>", "add_prefix_space": False}
    else:  # qwen2
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "errors": "replace",
               "split_special_tokens": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(config_extra or {})
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return d
