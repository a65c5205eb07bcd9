r"""The model families minillama reads and writes: one entry of :data:`FAMILIES` each.

Every family here is a LLaMA-like decoder that differs from LLaMA only in options of
:class:`~minillama.core.config.ModelConfig` (biases, a sliding window). An entry holds all that
is particular to its family, and the readers and writers read it from here:

* its names: the Hugging Face ``model_type`` (the key) and class (``architectures``), and the
  GGUF ``general.architecture`` its files carry;
* its config mapping: the ``config.json`` fields of the family -> ModelConfig options
  (:func:`minillama.io.hf.config_from_hf` maps the fields every family shares), the reverse for
  writing, and which configs are written as this family;
* its tensor-name rules: the names of its Hugging Face and GGUF tensors (-> Meta's names) and
  the RoPE row order of its GGUF q/k matrices;
* its tokenizer rules: the ``tokenizer.ggml.pre`` names of its byte-level GGUF tokenizers (their
  split patterns), and the spellings of its end-of-turn tokens (chat).

Users: :mod:`minillama.io.hf` (``model_type``, config and tensor names), :mod:`minillama.io.gguf`
(architecture, tensor names, RoPE row order, the pre-tokenizer name written),
:mod:`minillama.io.tokenizer` (pre-tokenizers read) and :mod:`minillama.io.chat_template`
(stop tokens). A new family is one entry here, plus its test in ``tests/io/test_families.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.bpe import GPT2_PATTERN, LLAMA3_PATTERN

__all__ = ["Family", "TensorNames", "FAMILIES", "HF_TENSORS", "GGUF_TENSORS", "hf_family",
           "gguf_family", "family_for", "pre_tokenizers", "pre_tokenizer_name", "stop_names"]


# ---------------------------------------------------------------------------------------------
# tensor names
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorNames:
    """The tensor names of one file format -> minillama's (Meta's)."""

    #: whole-model tensors: file name -> ours
    top: Mapping[str, str]
    #: what a block's tensor names start with (the block index and a dot follow)
    block: str
    #: a block's tensors, after ``<block><N>.``: file name -> ours (after ``layers.<N>.``)
    layer: Mapping[str, str]

    def ours(self, name: str) -> str | None:
        """Our name of the file's tensor ``name``, or None for a name outside these rules."""
        if name in self.top:
            return self.top[name]
        index, _, sub = name.removeprefix(self.block).partition(".")
        if name.startswith(self.block) and index.isdigit() and sub in self.layer:
            return f"layers.{int(index)}.{self.layer[sub]}"
        return None

    def theirs(self, ours: str) -> str:
        """The file's name of our parameter ``ours`` (one that :meth:`ours` maps)."""
        inv_top = {v: k for k, v in self.top.items()}
        if ours in inv_top:
            return inv_top[ours]
        _, index, sub = ours.split(".", 2)
        inv_layer = {v: k for k, v in self.layer.items()}
        return f"{self.block}{index}.{inv_layer[sub]}"


_HF_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_HF_LAYER.update({k.replace(".weight", ".bias"): v.replace(".weight", ".bias")
                  for k, v in _HF_LAYER.items() if "proj" in k})
#: Hugging Face LlamaForCausalLM's names (``lm_head`` is absent when tied)
HF_TENSORS = TensorNames(
    top={"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
         "lm_head.weight": "output.weight"},
    block="model.layers.", layer=_HF_LAYER)

_GGUF_LAYER = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
               "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
               "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
               "ffn_up": "feed_forward.w3"}
#: llama.cpp's names of the ``llama`` architecture (``output`` is absent when tied)
GGUF_TENSORS = TensorNames(
    top={"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
         "output.weight": "output.weight"},
    block="blk.", layer={f"{k}.{kind}": f"{v}.{kind}" for k, v in _GGUF_LAYER.items()
                         for kind in ("weight", "bias")})


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One model family: its names, config mapping, tensor-name rules and tokenizer rules."""

    #: Hugging Face ``model_type`` (the key of :data:`FAMILIES`)
    name: str
    #: Hugging Face class written as ``architectures`` (not checked on reading)
    hf_class: str
    #: GGUF ``general.architecture`` read and written as this family; None where the family's
    #: GGUF files carry another family's (Mistral's say ``llama``)
    gguf_arch: str | None
    #: ``(config.json dict, where) -> ModelConfig options`` of the family's own fields;
    #: settings it cannot run raise one line
    hf_options: Callable[[dict, str], dict]
    #: ``ModelConfig -> config.json fields`` of the family's own; a config its class cannot hold
    #: raises one line
    hf_fields: Callable[[ModelConfig], dict]
    #: whether a config is written as this family (the first that claims it, in table order);
    #: None: the family of every config that no other claims
    claims: Callable[[ModelConfig], bool] | None = None
    hf_tensors: TensorNames = HF_TENSORS
    gguf_tensors: TensorNames = GGUF_TENSORS
    #: GGUF q/k rows in HF's half-split RoPE order (permuted on load and on writing) instead of
    #: the interleaved pairs of llama.cpp's ``llama`` files
    gguf_half_split: bool = False
    #: ``tokenizer.ggml.pre`` names of its byte-level GGUF tokenizers -> (split pattern,
    #: ignore_merges); the first is the name written for its pattern
    gguf_pre: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    #: spellings of its end-of-turn / end-of-text tokens (they end a chat reply)
    stop_names: tuple[str, ...] = ()


def _llama_options(c: dict, where) -> dict:
    att = c.get("attention_bias", False)
    return {"qkv_bias": att, "attn_out_bias": att, "mlp_bias": c.get("mlp_bias", False)}


def _llama_fields(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias != cfg.attn_out_bias:
        raise MinillamaError("this model (q/k/v biases without an output bias, plus an MLP bias) "
                             "has no Hugging Face class")
    return {"attention_bias": cfg.attn_out_bias, "mlp_bias": cfg.mlp_bias}


def _mistral_options(c: dict, where) -> dict:
    return {} if c.get("sliding_window") is None else {"sliding_window": c["sliding_window"]}


def _mistral_fields(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias or cfg.attn_out_bias or cfg.mlp_bias:
        raise MinillamaError("this model (sliding window with biases) has no Hugging Face class")
    return {"sliding_window": cfg.sliding_window}


def _qwen2_options(c: dict, where) -> dict:
    if c.get("use_sliding_window"):
        raise MinillamaError(f"{where}: qwen2 use_sliding_window = true (sliding window on "
                             f"some layers only) is not supported")
    return {"qkv_bias": True}


#: Hugging Face ``model_type`` -> family; the order is that of the messages and of
#: :func:`family_for`
FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Llama 1-3, TinyLlama, SmolLM: attention_bias / mlp_bias
    Family("llama", "LlamaForCausalLM", "llama", _llama_options, _llama_fields,
           gguf_pre={"llama-bpe": (LLAMA3_PATTERN, True), "llama3": (LLAMA3_PATTERN, True),
                     "smollm": (GPT2_PATTERN, False)},
           stop_names=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")),
    # Mistral: a sliding window, no biases
    Family("mistral", "MistralForCausalLM", None, _mistral_options, _mistral_fields,
           claims=lambda cfg: cfg.sliding_window is not None),
    # Qwen2: q/k/v biases only; GGUF q/k rows as HF's
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", _qwen2_options, lambda cfg: {},
           claims=lambda cfg: cfg.qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias,
           gguf_half_split=True,
           gguf_pre={"qwen2": (LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"), False)},
           stop_names=("<|im_end|>", "<|endoftext|>")),
)}

#: byte-level pre-tokenizers of no family (``gpt-2`` is the name written for GPT-2's pattern)
GENERIC_PRE = {"default": (GPT2_PATTERN, False), "gpt-2": (GPT2_PATTERN, False)}
#: end-of-turn spellings of no family in the table that templates use (Gemma's)
GENERIC_STOP_NAMES = ("<end_of_turn>",)


# ---------------------------------------------------------------------------------------------
# look-ups
# ---------------------------------------------------------------------------------------------
def hf_family(c: dict, where) -> Family:
    """The family of a ``config.json`` dict by its ``model_type`` (``llama`` when absent)."""
    name = c.get("model_type", "llama")
    if not isinstance(name, str) or name not in FAMILIES:
        raise MinillamaError(f"{where}: model_type {str(name)[:40]!r} is not supported "
                             f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def gguf_family(arch, where) -> Family:
    """The family of a GGUF ``general.architecture``."""
    by_arch = {f.gguf_arch: f for f in reversed(FAMILIES.values()) if f.gguf_arch}
    if not isinstance(arch, str) or arch not in by_arch:
        names = [f.gguf_arch for f in FAMILIES.values() if f.gguf_arch]
        raise MinillamaError(f"{where}: GGUF architecture {str(arch)[:40]!r} is not supported "
                             f"(supported: {', '.join(names)})")
    return by_arch[arch]


def family_for(cfg: ModelConfig, gguf: bool = False) -> Family:
    """The family a config is written as: the first in table order that claims it, else the one
    that claims every other; for GGUF among the families with an architecture of their own."""
    cands = [f for f in FAMILIES.values() if f.gguf_arch or not gguf]
    return next((f for f in cands if f.claims is not None and f.claims(cfg)),
                next(f for f in cands if f.claims is None))


def pre_tokenizers() -> dict[str, tuple[str, bool]]:
    """Every ``tokenizer.ggml.pre`` name read -> (split pattern, ignore_merges)."""
    out = dict(GENERIC_PRE)
    for f in FAMILIES.values():
        out.update(f.gguf_pre)
    return out


def pre_tokenizer_name(pattern: str) -> str | None:
    """The ``tokenizer.ggml.pre`` written for a byte-level split pattern: ``gpt-2`` for GPT-2's,
    else the first name of the family whose first pre-tokenizer splits so (None: no name)."""
    if pattern == GPT2_PATTERN:
        return "gpt-2"
    for f in FAMILIES.values():
        first = next(iter(f.gguf_pre.items()), None)
        if first is not None and first[1][0] == pattern:
            return first[0]
    return None


def stop_names() -> tuple[str, ...]:
    """The end-of-turn / end-of-text spellings of every family (and :data:`GENERIC_STOP_NAMES`)."""
    names = [n for f in FAMILIES.values() for n in f.stop_names] + list(GENERIC_STOP_NAMES)
    return tuple(dict.fromkeys(names))
