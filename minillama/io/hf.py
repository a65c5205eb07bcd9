r"""Hugging Face LLaMA directories: ``config.json`` + ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), optionally ``tokenizer.json``.

The families read and written (``model_type``, their own config fields, their tensor names) are
the entries of :data:`minillama.io.families.FAMILIES`; this module maps the fields every family
shares. Names map to Meta's (:data:`minillama.io.families.HF_TENSORS`):
``model.embed_tokens`` -> ``tok_embeddings``, ``model.layers.N.self_attn.{q,k,v,o}_proj`` ->
``layers.N.attention.w{q,k,v,o}``, ``mlp.gate_proj/up_proj/down_proj`` ->
``feed_forward.w1/w3/w2``, ``input_layernorm`` -> ``attention_norm``,
``post_attention_layernorm`` -> ``ffn_norm``, ``model.norm`` -> ``norm``, ``lm_head`` ->
``output`` (absent when tied).

RoPE layout. HF rotates the two halves of each head (i, i + hd/2) while Meta/llama2.c (and
:func:`minillama.core.ops.rope_forward`) rotate interleaved pairs (2i, 2i+1). HF's conversion script
permutes the rows of W_q and W_k of every head so both give the same model: within a head,

    \mathrm{row}_{HF}(c \cdot hd/2 + i) = \mathrm{row}_{Meta}(2i + c),  c \in \{0, 1\}, i < hd/2.

Loading applies the inverse (a reshape (nh, 2, hd/2, D) -> (nh, hd/2, 2, D)); writing applies it
forward. Safetensors files are parsed here directly (JSON header + raw little-endian arrays; F32,
F64, F16 and BF16) so every corruption is a one-line error and nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.bpe import byte_level_json
from minillama.io.checkpoint import atomic_write, check_finite, check_output_dir
from minillama.io.families import family_for, hf_family, pre_tokenizers
from minillama.io.gguf_file import meta, open_gguf
from minillama.io.safetensors_file import read_safetensors_file
from minillama.io.tokenizer import ByteTokenizer, HFTokenizer
from minillama.model.transformer import check_params

__all__ = ["config_from_hf", "config_to_hf", "load_hf", "save_hf", "read_safetensors_file",
           "hf_to_interleaved", "interleaved_to_hf", "is_hf_dir"]


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
#: HF config.json field -> ModelConfig field (to name both in error messages)
_HF_FIELDS = {"hidden_size": "dim", "num_hidden_layers": "n_layers",
              "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
              "vocab_size": "vocab_size", "intermediate_size": "hidden_dim",
              "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
              "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_theta",
              "head_dim": "head_dim", "sliding_window": "sliding_window"}


def config_from_hf(c: dict, where="config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a HF config dict of a family of
    :data:`~minillama.io.families.FAMILIES` (its ``model_type``); unsupported settings raise.

    Values are passed through as they are: :class:`ModelConfig` alone checks their types and
    ranges (its messages name the HF field too)."""
    if not isinstance(c, dict):
        raise MinillamaError(f"{where}: not a JSON object")
    family = hf_family(c, where)
    try:
        H = c["num_attention_heads"]
        cfg_args = dict(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=H,
                        n_kv_heads=c.get("num_key_value_heads") or H,
                        vocab_size=c["vocab_size"], hidden_dim=c["intermediate_size"],
                        norm_eps=c.get("rms_norm_eps", 1e-6),
                        max_seq_len=c.get("max_position_embeddings", 2048),
                        tie_embeddings=c.get("tie_word_embeddings", False))
    except KeyError as e:
        raise MinillamaError(f"{where}: missing field {e.args[0]!r}") from None
    if c.get("hidden_act", "silu") != "silu":
        raise MinillamaError(f"{where}: hidden_act {str(c['hidden_act'])[:40]!r} is not "
                             f"supported (silu)")
    cfg_args.update(family.hf_options(c, where))
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for key, d in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if not isinstance(d, dict):
            raise MinillamaError(f"{where}: {key} must be an object or null, got "
                                 f"{type(d).__name__}")
    merged = {**rope, **scaling}  # the older rope_scaling field, when set, names the scaling
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise MinillamaError(f"{where}: partial_rotary_factor != 1 is not supported")
    if merged.get("rope_type", merged.get("type", "default")) not in (None, "default"):
        if merged.get("rope_type", merged.get("type")) == "dynamic":
            # dynamic NTK stretches the context past max_position_embeddings by its factor
            merged["original_max_position_embeddings"] = cfg_args["max_seq_len"]
            factor, max_pos = merged.get("factor"), cfg_args["max_seq_len"]
            if (_is_number(factor) and math.isfinite(factor) and factor > 1
                    and _is_number(max_pos) and math.isfinite(max_pos)
                    and max_pos == int(max_pos)):
                cfg_args["max_seq_len"] = int(max_pos * factor)  # else ModelConfig refuses
        merged.setdefault("original_max_position_embeddings", cfg_args["max_seq_len"])
        cfg_args["rope_scaling"] = merged
    if c.get("pretraining_tp", 1) not in (1, None):
        raise MinillamaError(f"{where}: pretraining_tp != 1 is not supported")
    cfg_args["rope_theta"] = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    if c.get("head_dim") is not None:
        cfg_args["head_dim"] = c["head_dim"]
    try:
        cfg = ModelConfig(**cfg_args)
    except MinillamaError as e:
        msg = str(e)
        for hf_name, ours in _HF_FIELDS.items():
            msg = msg.replace(f"ModelConfig.{ours} ", f"{hf_name} ", 1)
        raise MinillamaError(f"{where}: bad field value: {msg}") from None
    return cfg


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF ``config.json`` dict of ``cfg`` (float32), in the class of the family that claims
    it (:func:`~minillama.io.families.family_for`: LlamaForCausalLM, or MistralForCausalLM with a
    sliding window, Qwen2ForCausalLM with q/k/v biases only), with that family's own fields. A
    config the class cannot hold (a sliding window with biases, q/k/v biases without the output
    one on llama) is an error."""
    family = family_for(cfg)
    extra = family.hf_fields(cfg)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "freq_factors":
        raise MinillamaError("a Hugging Face config cannot hold per-frequency RoPE factors "
                             "(GGUF rope_freqs); export this model as gguf")
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    max_pos = cfg.max_seq_len
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
        if cfg.rope_scaling["rope_type"] == "dynamic":
            max_pos = int(cfg.rope_scaling["original_max_position_embeddings"])
            del rope["original_max_position_embeddings"]
    out = {
        "architectures": [family.hf_class], "model_type": family.name,
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32", "torch_dtype": "float32",
    }
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------------------
# the q/k permutation
# ---------------------------------------------------------------------------------------------
def hf_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a HF q/k projection (half-split RoPE) -> interleaved-pair order. w: (nh*hd, D),
    or a bias (nh*hd,)."""
    if w.ndim == 1:
        return hf_to_interleaved(w[:, None], n_heads)[:, 0]
    out, D = w.shape
    hd = out // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, hd // 2, D).transpose(0, 2, 1, 3)
                                .reshape(out, D))


def interleaved_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`hf_to_interleaved`."""
    if w.ndim == 1:
        return interleaved_to_hf(w[:, None], n_heads)[:, 0]
    out, D = w.shape
    hd = out // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, hd // 2, 2, D).transpose(0, 2, 1, 3)
                                .reshape(out, D))


# ---------------------------------------------------------------------------------------------
# load / save
# ---------------------------------------------------------------------------------------------
def is_hf_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def _weight_files(d: Path) -> list[Path]:
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            idx = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise MinillamaError(f"corrupt {index}: {str(e).splitlines()[0][:100]}") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise MinillamaError(f"corrupt {index}: no weight_map object")
        files = set()
        for k, v in wm.items():
            if not isinstance(v, str) or not v or Path(v).name != v or v in (".", ".."):
                raise MinillamaError(f"corrupt {index}: tensor {k[:80]!r} maps to "
                                     f"{str(v)[:80]!r}, not a file name in the folder")
            files.add(v)
        return [d / f for f in sorted(files)]
    if list(d.glob("*.bin")) or list(d.glob("*.pt")) or list(d.glob("*.pth")):
        raise MinillamaError(f"{d} holds only PyTorch pickle weights; minillama never unpickles "
                             f"- save them as safetensors")
    raise MinillamaError(f"{d} has no model.safetensors nor model.safetensors.index.json")


def load_hf(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a HF LLaMA directory: returns ``(cfg, params)`` with Meta names and interleaved RoPE
    rows. Missing/extra tensors, wrong shapes and non-finite values raise."""
    d = Path(path)
    try:
        c = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MinillamaError(f"{d} has no config.json") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise MinillamaError(f"corrupt {d / 'config.json'}: "
                             f"{str(e).splitlines()[0][:100]}") from None
    except OSError as e:
        raise MinillamaError(f"cannot read {d / 'config.json'}: {e.strerror or e}") from None
    cfg = config_from_hf(c, str(d / "config.json"))
    names = hf_family(c, d / "config.json").hf_tensors
    tensors: dict[str, np.ndarray] = {}
    for f in _weight_files(d):
        t, _ = read_safetensors_file(f)
        twice = sorted(set(t) & set(tensors))
        if twice:
            raise MinillamaError(f"tensor {twice[0]} appears in more than one shard of {d}")
        tensors.update(t)
    params: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        ours = names.ours(name)
        if ours == "output.weight" and cfg.tie_embeddings:
            continue  # a tied head saved anyway
        if ours is None and name.startswith(names.block) and name.removeprefix(
                names.block).partition(".")[2].endswith("rotary_emb.inv_freq"):
            continue  # RoPE's frequencies, which older transformers saved
        if ours is None:
            raise MinillamaError(f"unexpected tensor {name} in {d}")
        params[ours] = arr
    check_params(cfg, params)
    check_finite(params, d)
    for layer in range(cfg.n_layers):
        for kind in ("weight", "bias"):
            q, k = f"layers.{layer}.attention.wq.{kind}", f"layers.{layer}.attention.wk.{kind}"
            if q in params:
                params[q] = hf_to_interleaved(params[q], cfg.n_heads)
                params[k] = hf_to_interleaved(params[k], cfg.n_kv_heads)
    return cfg, params


def save_hf(path, cfg: ModelConfig, params, max_shard_bytes: int | None = None,
            tokenizer=None) -> Path:
    """Write a HF-style LLaMA directory (``config.json`` and float32 safetensors weights, sharded
    with an index when ``max_shard_bytes`` is given) and, with ``tokenizer``, its tokenizer files
    (:func:`save_hf_tokenizer`)."""
    cfg.require_llama("HF llama")
    d = check_output_dir(path, "Hugging Face output folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MinillamaError(f"cannot create {d}: {e.strerror or e}") from None
    out = _hf_tensors(cfg, params)
    hf_config = config_to_hf(cfg)
    for key in ("bos_id", "eos_id"):
        if getattr(tokenizer, key, None) is not None:
            hf_config[f"{key[:3]}_token_id"] = int(getattr(tokenizer, key))
    atomic_write(d / "config.json",
                 lambda t: Path(t).write_text(json.dumps(hf_config, indent=2)))
    if tokenizer is not None:  # without one, tokenizer files already in ``d`` are left as they are
        save_hf_tokenizer(d, tokenizer, cfg.max_seq_len)
    _save_hf_weights(d, out, max_shard_bytes)
    return d


def _hf_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """The parameters as float32 host arrays under the HF names of the config's family, q and k
    rows in HF's half-split RoPE order."""
    host = {k: np.asarray(v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray) else v)
            for k, v in params.items()}
    names = family_for(cfg).hf_tensors
    out: dict[str, np.ndarray] = {}
    for k, v in host.items():
        v = np.ascontiguousarray(v, dtype=np.float32)
        sub = k.split(".", 2)[-1]
        if sub in ("attention.wq.weight", "attention.wq.bias"):
            v = interleaved_to_hf(v, cfg.n_heads)
        elif sub in ("attention.wk.weight", "attention.wk.bias"):
            v = interleaved_to_hf(v, cfg.n_kv_heads)
        out[names.theirs(k)] = v
    return out


def _save_hf_weights(d: Path, out: dict[str, np.ndarray], max_shard_bytes: int | None) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` with their index (and a
    single-file weights file of an earlier export removed)."""
    from safetensors.numpy import save_file

    if not max_shard_bytes:
        atomic_write(d / "model.safetensors",
                     lambda t: save_file(out, t, metadata={"format": "pt"}), "weights file")
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for k, v in out.items():
        if shards[-1] and used + v.nbytes > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][k] = v
        used += v.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(d / fname,
                     lambda t, shard=shard: save_file(shard, t, metadata={"format": "pt"}),
                     "weights file")
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in out.values())},
             "weight_map": weight_map}
    atomic_write(d / "model.safetensors.index.json",
                 lambda t: Path(t).write_text(json.dumps(index, indent=2)))
    stale = d / "model.safetensors"
    if stale.exists():
        os.unlink(stale)


#: the files of a Hugging Face folder that make its tokenizer and chat template
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json", "chat_template.jinja")


def gguf_tokenizer_files(path, tok) -> dict[str, bytes] | None:
    """A GGUF file's byte-level BPE tokenizer (``tokenizer.ggml.model`` ``gpt2``, read as
    ``tok``) as Hugging Face files: ``tokenizer.json`` (vocabulary, merges, special tokens, the
    pre-tokenizer's split pattern), ``tokenizer_config.json`` (BOS/EOS, whether encode adds
    them, the chat template) and ``generation_config.json`` (every end-of-turn id). None for
    another tokenizer model."""
    reader = open_gguf(Path(path))
    if meta(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    tokens = [str(t) for t in meta(reader, "tokenizer.ggml.tokens")]
    types = meta(reader, "tokenizer.ggml.token_type") or []
    pattern, ignore = pre_tokenizers()[meta(reader, "tokenizer.ggml.pre", "default")]
    special = [i for i, t in enumerate(types) if t == 3 and i < len(tokens)]
    tj = byte_level_json(tokens, [str(m) for m in meta(reader, "tokenizer.ggml.merges")],
                         special, pattern, ignore)
    tj["added_tokens"] = [{**t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False} for t in tj["added_tokens"]]
    split, level = tj["pre_tokenizer"]["pretokenizers"]  # the fields the tokenizers library asks
    split.update(behavior="Isolated", invert=False)
    level.update(trim_offsets=True)
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                     "use_regex": False}
    conf = {"bos_token": None if tok.bos_id is None else tokens[tok.bos_id],
            "eos_token": None if tok.eos_id is None else tokens[tok.eos_id],
            "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos)}
    files = {"tokenizer.json": tj, "tokenizer_config.json": conf,
             "generation_config.json": {"eos_token_id": sorted(tok.stop_ids)}}
    out = {name: json.dumps(obj, indent=1, ensure_ascii=False).encode("utf-8")
           for name, obj in files.items()}
    if tok.chat_template:
        out["chat_template.jinja"] = tok.chat_template.encode("utf-8")
    return out


def save_hf_tokenizer(d: Path, tokenizer, model_max_length: int) -> None:
    """The tokenizer files of a Hugging Face folder: the byte tokenizer as a byte-fallback BPE
    (:meth:`~minillama.io.tokenizer.ByteTokenizer.hf_files`), a folder's own ``tokenizer.json`` (and
    the JSON files beside it) copied; other tokenizers (llama2.c ``tokenizer.bin``) are left out,
    and a stale ``tokenizer.json`` of an earlier export is removed."""
    files: dict[str, bytes] = {}
    if isinstance(tokenizer, ByteTokenizer):
        files = {name: json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8")
                 for name, obj in ByteTokenizer.hf_files(model_max_length).items()}
    elif isinstance(tokenizer, HFTokenizer):
        for name in HF_TOKENIZER_FILES:
            src = tokenizer.path.parent / name
            if src.is_file() and src.resolve() != (d / name).resolve():
                files[name] = src.read_bytes()
    if not files and (d / "tokenizer.json").is_file():
        os.unlink(d / "tokenizer.json")
    for name, data in files.items():
        atomic_write(d / name, lambda t, data=data: Path(t).write_bytes(data))
