r"""GGUF files (llama.cpp) of the LLaMA family: ``general.architecture`` ``llama`` (Llama 1-3,
Mistral, TinyLlama, SmolLM) or ``qwen2``.

The container is parsed by the ``gguf`` package that llama.cpp's authors publish (optional extra
``minillama[gguf]``); the tensors are dequantised here, to float32, on load:

* F32, F16, BF16: reinterpreted (BF16 is the top half of a float32);
* Q8_0: blocks of 32 values, a float16 scale d then 32 int8 q: x_j = d q_j;
* Q4_0: blocks of 32 values, a float16 scale d then 16 bytes whose low nibbles are q_0..q_15
  and high nibbles q_16..q_31: x_j = d (q_j - 8).

Any other tensor type is refused with one line naming it. Names map to Meta's:
``token_embd`` -> ``tok_embeddings``, ``blk.N.attn_{norm,q,k,v,output}`` ->
``layers.N.{attention_norm, attention.wq, wk, wv, wo}``, ``blk.N.ffn_{norm,gate,down,up}`` ->
``layers.N.{ffn_norm, feed_forward.w1, w2, w3}``, ``output_norm`` -> ``norm``, ``output``
(absent: tied). llama.cpp's converter already put the ``llama`` q/k rows in the interleaved RoPE
order minillama uses; ``qwen2`` files keep the half-split order and are permuted on load.

The tokenizer comes from the metadata: ``tokenizer.ggml.model`` ``llama`` (SentencePiece pieces
and scores, byte fallback) as a :class:`~minillama.tokenizer.Llama2cTokenizer`, or ``gpt2``
(byte-level BPE: tokens, merges, control tokens, the ``tokenizer.ggml.pre`` split pattern) as a
:class:`~minillama.bpe.BPETokenizer`, with BOS/EOS from ``tokenizer.ggml.{bos,eos}_token_id``. Every size is checked against the file before anything is
allocated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import MinillamaError

ARCHITECTURES = ("llama", "qwen2")
#: GGML type name -> (values per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18)}

_LAYER = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
          "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
          "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
          "ffn_up": "feed_forward.w3"}
_TOP = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
        "output.weight": "output.weight"}


def is_gguf(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# dequantisation
# ---------------------------------------------------------------------------------------------
def dequantize(raw: np.ndarray, kind: str, n: int) -> np.ndarray:
    r"""``n`` float32 values from the raw bytes (uint8) of a tensor of GGML type ``kind``.

    Q8_0: x = d q (d float16, q int8, 32 per block). Q4_0: x = d (q - 8), q the 4-bit nibbles
    (low nibbles first). The caller checked ``raw.size`` against :data:`BLOCKS`.
    """
    if kind == "F32":
        return raw.view("<f4").astype(np.float32)
    if kind == "F16":
        return raw.view("<f2").astype(np.float32)
    if kind == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    blocks = raw.reshape(-1, BLOCKS[kind][1])
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # (nblocks, 1)
    if kind == "Q8_0":
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
    else:  # Q4_0
        packed = blocks[:, 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32) - 8.0
    return (d * q).reshape(n)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _open(path: Path):
    try:
        import gguf  # noqa: PLC0415
    except ImportError:
        raise MinillamaError("reading GGUF files needs the optional `gguf` package: "
                             "pip install 'minillama[gguf]'") from None
    try:
        return gguf.GGUFReader(str(path), "r")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a corrupt file
        msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise MinillamaError(f"corrupt GGUF file {path}: {msg}") from None


def _meta(reader, key: str, default=None):
    """The value of metadata ``key`` (a number, a string or a list), else ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (IndexError, ValueError, UnicodeDecodeError, TypeError) as e:
        raise MinillamaError(f"corrupt GGUF metadata {key}: {e}") from None


def config_from_gguf(reader, shapes: dict[str, tuple[int, ...]], where,
                     freq_factors: list[float] | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from the ``{arch}.*`` metadata and the tensor shapes (vocabulary
    size, tied head, which biases exist); ``freq_factors`` are the values of a ``rope_freqs``
    tensor."""
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise MinillamaError(f"{where}: GGUF architecture {str(arch)[:40]!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")

    def need(key):
        v = _meta(reader, f"{arch}.{key}")
        if v is None:
            raise MinillamaError(f"{where}: GGUF metadata {arch}.{key} is missing")
        return v

    if "token_embd.weight" not in shapes:
        raise MinillamaError(f"{where}: GGUF file has no token_embd.weight tensor")
    H = need("attention.head_count")
    args = dict(dim=need("embedding_length"), n_layers=need("block_count"), n_heads=H,
                n_kv_heads=_meta(reader, f"{arch}.attention.head_count_kv", H),
                hidden_dim=need("feed_forward_length"), max_seq_len=need("context_length"),
                vocab_size=shapes["token_embd.weight"][0],
                norm_eps=need("attention.layer_norm_rms_epsilon"),
                rope_theta=_meta(reader, f"{arch}.rope.freq_base", 10000.0),
                head_dim=_meta(reader, f"{arch}.attention.key_length"),
                sliding_window=_meta(reader, f"{arch}.attention.sliding_window"),
                tie_embeddings="output.weight" not in shapes,
                qkv_bias="blk.0.attn_q.bias" in shapes,
                attn_out_bias="blk.0.attn_output.bias" in shapes,
                mlp_bias="blk.0.ffn_gate.bias" in shapes)
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    if freq_factors is not None:  # llama.cpp's form of Llama 3.1's bands: theta_i / f_i
        args["rope_scaling"] = {"rope_type": "freq_factors", "factors": freq_factors}
    elif kind not in (None, "none"):
        args["rope_scaling"] = {
            "rope_type": kind, "factor": _meta(reader, f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings":
                _meta(reader, f"{arch}.rope.scaling.original_context_length",
                      args["max_seq_len"])}
    return ModelConfig(**args)


def _tensor_bytes(t, file_size: int, where) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(type name, NumPy shape, raw bytes) of one tensor, its sizes checked against the file."""
    kind = getattr(t.tensor_type, "name", str(t.tensor_type))
    if kind not in BLOCKS:
        raise MinillamaError(f"{where}: tensor {t.name} has GGML type {kind}, which is not "
                             f"supported (supported: {', '.join(BLOCKS)})")
    shape = tuple(int(n) for n in reversed(list(t.shape)))  # GGUF lists the fastest axis first
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    per, size = BLOCKS[kind]
    if n <= 0 or n % per or shape[-1] % per:
        raise MinillamaError(f"{where}: tensor {t.name} of shape {list(shape)} does not fill "
                             f"whole {kind} blocks of {per}")
    nbytes = n // per * size
    if t.data_offset < 0 or t.data_offset + nbytes > file_size or t.data.nbytes != nbytes:
        raise MinillamaError(f"{where}: tensor {t.name} ({kind}, {list(shape)}) needs {nbytes} "
                             f"bytes at offset {t.data_offset}, beyond the file or its record")
    return kind, shape, np.asarray(t.data).reshape(-1).view(np.uint8)


def _our_name(name: str, where) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER \
            and parts[3] in ("weight", "bias"):
        return f"layers.{int(parts[1])}.{_LAYER[parts[2]]}.{parts[3]}"
    raise MinillamaError(f"{where}: unexpected GGUF tensor {name[:80]}")


def load_gguf(path):
    """Read a LLaMA-family GGUF file: ``(cfg, params, tokenizer or None)`` with Meta names,
    float32 weights and interleaved RoPE rows."""
    from ..checkpoint import check_finite  # noqa: PLC0415
    from ..model import check_params, param_shapes  # noqa: PLC0415
    from .hf import hf_to_interleaved  # noqa: PLC0415

    path = Path(path)
    reader = _open(path)
    size = path.stat().st_size
    infos = {}
    for t in reader.tensors:
        if t.name in infos:
            raise MinillamaError(f"{path}: tensor {t.name} appears twice")
        infos[t.name] = _tensor_bytes(t, size, path)
    factors = None
    if "rope_freqs.weight" in infos:
        kind, shape, raw = infos.pop("rope_freqs.weight")
        if len(shape) != 1 or shape[0] > 1 << 12:
            raise MinillamaError(f"{path}: rope_freqs.weight has shape {list(shape)}")
        factors = dequantize(raw, kind, shape[0]).astype(float).tolist()
    cfg = config_from_gguf(reader, {k: v[1] for k, v in infos.items()}, path, factors)
    expected = param_shapes(cfg)
    params = {}
    for name, (kind, shape, raw) in infos.items():
        ours = _our_name(name, path)
        if expected.get(ours) != shape:
            raise MinillamaError(f"{path}: tensor {name} has shape {list(shape)}, expected "
                                 f"{list(expected.get(ours, ()))} for this config")
        params[ours] = dequantize(raw, kind, int(np.prod(shape))).reshape(shape)
    check_params(cfg, params)
    check_finite(params, path)
    if _meta(reader, "general.architecture") == "qwen2":  # half-split RoPE rows, as in HF
        for key in [k for k in params if ".attention.wq." in k or ".attention.wk." in k]:
            params[key] = hf_to_interleaved(params[key], cfg.n_heads if ".wq." in key
                                            else cfg.n_kv_heads)
    return cfg, params, tokenizer_from_gguf(reader, cfg.vocab_size, path)


def tokenizer_from_gguf(reader, vocab_size: int, where):
    """The tokenizer of the metadata (``tokenizer.ggml.model`` ``llama``), or None when the file
    has none; another tokenizer model is refused with one line."""
    from ..tokenizer import Llama2cTokenizer  # noqa: PLC0415

    model = _meta(reader, "tokenizer.ggml.model")
    if model is None:
        return None
    if model == "gpt2":
        return _byte_level_tokenizer(reader, vocab_size, where)
    if model != "llama":
        raise MinillamaError(f"{where}: GGUF tokenizer model {str(model)[:40]!r} is not supported "
                             f"(supported: llama, gpt2); pass --tokenizer")
    tokens, scores = _meta(reader, "tokenizer.ggml.tokens"), _meta(reader, "tokenizer.ggml.scores")
    if not isinstance(tokens, list) or not isinstance(scores, list) \
            or len(tokens) != len(scores) or len(tokens) > vocab_size:
        raise MinillamaError(f"{where}: GGUF tokenizer needs tokens and scores of equal length "
                             f"<= the vocabulary of {vocab_size}")
    pieces = [str(t).replace("\u2581", " ").encode("utf-8") for t in tokens]
    tok = Llama2cTokenizer(pieces=pieces, scores=[float(s) for s in scores],
                           spec={"type": "gguf", "path": str(Path(where).resolve())})
    for attr, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"),
                      ("unk_id", "unknown_token_id")):
        v = _meta(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            if not 0 <= int(v) < len(pieces):
                raise MinillamaError(f"{where}: GGUF tokenizer.ggml.{key} {v} is outside its "
                                     f"{len(pieces)} tokens")
            setattr(tok, attr, int(v))
    return tok


#: ``tokenizer.ggml.pre`` -> (split pattern, ignore_merges) of byte-level tokenizers
def _pre_patterns():
    from ..bpe import GPT2_PATTERN, LLAMA3_PATTERN  # noqa: PLC0415

    return {"default": (GPT2_PATTERN, False), "gpt-2": (GPT2_PATTERN, False),
            "llama-bpe": (LLAMA3_PATTERN, True), "llama3": (LLAMA3_PATTERN, True),
            "smollm": (GPT2_PATTERN, False),
            "qwen2": (LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"), False)}


def _byte_level_tokenizer(reader, vocab_size: int, where):
    """A GPT-2-style (``tokenizer.ggml.model`` ``gpt2``) tokenizer: tokens, merges, token types
    (3 = control: special) and the pre-tokenizer named by ``tokenizer.ggml.pre``."""
    from ..bpe import BPETokenizer, TextBPE, byte_level_json  # noqa: PLC0415

    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = _meta(reader, "tokenizer.ggml.merges")
    types = _meta(reader, "tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not isinstance(merges, list) or len(tokens) > vocab_size:
        raise MinillamaError(f"{where}: GGUF gpt2 tokenizer needs tokens (<= the vocabulary of "
                             f"{vocab_size}) and merges")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    if pre not in _pre_patterns():
        raise MinillamaError(f"{where}: GGUF pre-tokenizer {str(pre)[:40]!r} is not supported "
                             f"(supported: {', '.join(_pre_patterns())})")
    pattern, ignore = _pre_patterns()[pre]
    special = [i for i, t in enumerate(types) if t == 3 and i < len(tokens)]
    bpe = BPETokenizer(where, byte_level_json([str(t) for t in tokens], [str(m) for m in merges],
                                              special, pattern, ignore))
    ids = []
    for key in ("bos_token_id", "eos_token_id"):
        v = _meta(reader, f"tokenizer.ggml.{key}")
        if v is not None and not 0 <= int(v) < len(tokens):
            raise MinillamaError(f"{where}: GGUF tokenizer.ggml.{key} {v} is outside its "
                                 f"{len(tokens)} tokens")
        ids.append(None if v is None else int(v))
    return TextBPE(bpe, ids[0], ids[1], {"type": "gguf", "path": str(Path(where).resolve())})


def load_gguf_tokenizer(path):
    """The tokenizer stored in the metadata of the GGUF file at ``path`` (None if it has none)."""
    if not isinstance(path, str) or not Path(path).is_file():
        raise MinillamaError(f"GGUF tokenizer file not found: {str(path)[:200]}")
    reader = _open(Path(path))
    vocab = _meta(reader, "tokenizer.ggml.tokens")
    return tokenizer_from_gguf(reader, len(vocab) if isinstance(vocab, list) else 0, path)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def save_gguf(path, cfg: ModelConfig, params, tokenizer=None, matrix_type: str = "F32",
              types: dict[str, str] | None = None, notes: list[str] | None = None) -> Path:
    """Write a GGUF file (architecture ``llama``, or ``qwen2`` for q/k/v biases without the
    others) that llama.cpp and :func:`load_gguf` read; norms and biases F32, and the tokenizer
    in the metadata (see :func:`_write_tokenizer`).

    A matrix that is a :class:`~minillama.quant.QuantMatrix` is written as its blocks, in its
    GGML type. A float matrix is written as ``types[name]`` when given, else ``matrix_type``:
    F32, F16 or a type of :data:`minillama.quantize.QUANTIZERS` (quantized here); a row length
    that is not whole blocks of that type takes llama.cpp's fallback
    (:func:`minillama.quantize.resolve_type`). What cannot be carried (a tokenizer without a GGUF
    form) is appended to ``notes`` as one line each. Configs GGUF cannot state (a RoPE scaling other
    than linear/yarn, MLP or output biases on qwen2) are refused. The write is atomic."""
    import gguf  # noqa: PLC0415

    from ..checkpoint import atomic_write, check_output_file  # noqa: PLC0415
    from ..quant import QuantMatrix  # noqa: PLC0415
    from ..quantize import quantize, resolve_type, supported_type  # noqa: PLC0415
    from .hf import interleaved_to_hf  # noqa: PLC0415

    types = dict(types or {})
    for t in [matrix_type, *types.values()]:
        supported_type(t)
    cfg.require_llama("GGUF llama")
    arch = "qwen2" if cfg.qkv_bias and not (cfg.attn_out_bias or cfg.mlp_bias) else "llama"
    sc = cfg.rope_scaling
    if sc and sc["rope_type"] not in ("linear", "yarn", "freq_factors"):
        raise MinillamaError(f"GGUF has no field for rope scaling {sc['rope_type']!r}")
    path = check_output_file(path, "GGUF file")
    host = {k: v if isinstance(v, QuantMatrix) else
            np.asarray(v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray) else v,
                       dtype=np.float32) for k, v in params.items()}
    inv_top = {v: k for k, v in _TOP.items()}
    inv_layer = {v: k for k, v in _LAYER.items()}

    def tensor(name, a):
        """(array to write, raw GGML type or None) of parameter ``name``."""
        if isinstance(a, QuantMatrix):
            return a.data, gguf.GGMLQuantizationType[a.qtype]
        if a.ndim != 2:
            return a, None
        kind, _ = resolve_type(types.get(name, matrix_type), a.shape[1], a)
        if kind == "F16":
            return a.astype(np.float16), None
        if kind == "F32":
            return a, None
        return quantize(a, kind).data, gguf.GGMLQuantizationType[kind]

    def write(tmp) -> None:
        w = gguf.GGUFWriter(str(tmp), arch)
        for key, value in (("context_length", cfg.max_seq_len), ("embedding_length", cfg.dim),
                           ("block_count", cfg.n_layers), ("feed_forward_length", cfg.hidden_dim),
                           ("attention.head_count", cfg.n_heads),
                           ("attention.head_count_kv", cfg.n_kv_heads),
                           ("attention.key_length", cfg.head_dim),
                           ("attention.value_length", cfg.head_dim)):
            w.add_uint32(f"{arch}.{key}", int(value))
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.norm_eps)
        w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
        if cfg.sliding_window is not None:
            w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        if sc and sc["rope_type"] == "freq_factors":
            w.add_tensor("rope_freqs.weight", np.asarray(sc["factors"], dtype=np.float32))
        elif sc:
            w.add_string(f"{arch}.rope.scaling.type", sc["rope_type"])
            w.add_float32(f"{arch}.rope.scaling.factor", float(sc["factor"]))
            if "original_max_position_embeddings" in sc:
                w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                             int(sc["original_max_position_embeddings"]))
        note = _write_tokenizer(w, tokenizer, cfg.vocab_size)
        if note and notes is not None:
            notes.append(note)
        for name, a in host.items():
            if name in inv_top:
                gname = inv_top[name]
            else:
                _, layer, rest = name.split(".", 2)
                base, kind = rest.rsplit(".", 1)
                gname = f"blk.{layer}.{inv_layer[base]}.{kind}"
                if arch == "qwen2" and base in ("attention.wq", "attention.wk"):
                    a = _to_half_split(a, cfg.n_heads if base == "attention.wq"
                                       else cfg.n_kv_heads, interleaved_to_hf)
            data, raw = tensor(name, a)
            w.add_tensor(gname, np.ascontiguousarray(data), raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(path, write, "GGUF file")


def _to_half_split(a, n_heads: int, interleaved_to_hf):
    """The q/k rows of ``a`` (a float array or a QuantMatrix, whose rows are whole blocks) in
    the half-split RoPE order of qwen2 files."""
    from ..quant import QuantMatrix  # noqa: PLC0415

    if not isinstance(a, QuantMatrix):
        return interleaved_to_hf(a, n_heads)
    order = interleaved_to_hf(np.arange(a.shape[0])[:, None], n_heads)[:, 0]
    return QuantMatrix(a.qtype, a.shape, np.ascontiguousarray(a.data[order]))


def _write_tokenizer(w, tok, vocab_size: int) -> str | None:
    """The tokenizer's metadata (``tokenizer.*``); returns a note when it cannot be carried.

    * one read from a GGUF file (its spec names the file): that file's ``tokenizer.*`` fields,
      copied as they are (chat template, pre-tokenizer name and flags included);
    * a SentencePiece tokenizer (:class:`~minillama.tokenizer.Llama2cTokenizer`): pieces,
      scores, BOS/EOS/UNK;
    * a Hugging Face ``tokenizer.json`` with a byte-level BPE: model ``gpt2`` with its tokens,
      merges, token types (3 = control for special added tokens), the pre-tokenizer named after
      its split pattern, BOS/EOS and the chat template; the token list is padded to the model's
      vocabulary;
    * the byte tokenizer: no ``tokenizer.ggml`` model can state it; its minillama spec is kept
      under ``minillama.tokenizer`` (pass ``--tokenizer byte`` to use the file)."""
    import json  # noqa: PLC0415

    from ..tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer  # noqa: PLC0415

    if tok is None:
        return None
    spec = tok.spec() if hasattr(tok, "spec") else {}
    if spec.get("type") == "gguf" and is_gguf(spec.get("path", "")):
        reader = _open(Path(spec["path"]))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        return None
    if isinstance(tok, Llama2cTokenizer):
        w.add_tokenizer_model("llama")
        w.add_token_list([p.decode("utf-8", errors="replace").replace(" ", "\u2581")
                          for p in tok.pieces])
        w.add_token_scores([float(s) for s in tok.scores])
        w.add_bos_token_id(tok.bos_id)
        w.add_eos_token_id(tok.eos_id)
        w.add_unk_token_id(tok.unk_id)
        return None
    if isinstance(tok, ByteTokenizer):
        w.add_string("minillama.tokenizer", json.dumps(tok.spec()))
        return "the byte tokenizer has no GGUF form; use the file with --tokenizer byte"
    if isinstance(tok, HFTokenizer):
        return _write_byte_level(w, tok, vocab_size)
    return f"a {type(tok).__name__} is not written to GGUF; the file has no tokenizer"


def _write_byte_level(w, tok, vocab_size: int) -> str | None:
    """A Hugging Face byte-level BPE ``tokenizer.json`` as ``tokenizer.ggml.model`` ``gpt2``."""
    from ..bpe import BPETokenizer  # noqa: PLC0415

    try:
        bpe = BPETokenizer(tok.path)
    except MinillamaError as e:
        return f"tokenizer {tok.path} is not written to GGUF ({e})"
    names = {pattern: name for name, (pattern, _) in _pre_patterns().items()
             if name in ("gpt-2", "llama-bpe", "qwen2")}
    pre = names.get(bpe.pattern.pattern) if bpe.byte_level else None
    if pre is None:
        return (f"tokenizer {tok.path} is not a byte-level BPE with a known split pattern; "
                f"the file has no tokenizer")
    n = max(vocab_size, max(bpe.pieces) + 1)
    tokens = [bpe.pieces.get(i, f"[PAD{i}]") for i in range(n)]
    kinds = [3 if i in bpe.special_ids else 4 if i in bpe.added.values() else
             1 if i in bpe.pieces else 5 for i in range(n)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges([" ".join(pair) for pair, _ in sorted(bpe.ranks.items(),
                                                              key=lambda kv: kv[1])])
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    if tok.eos_id is not None:
        w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    return None
