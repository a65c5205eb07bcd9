r"""GGUF files (llama.cpp) of the LLaMA family: the ``general.architecture`` of a family of
:data:`minillama.io.families.FAMILIES` (``llama``: Llama 1-3, Mistral, TinyLlama, SmolLM;
``qwen2``).

The container (GGUF versions 2 and 3) is parsed here (:class:`GGUFFile`): metadata, then the
tensor table, every size checked against the file before a tensor is read, the tensor bytes
viewed in place (the file is memory-mapped). Writing uses the ``gguf`` package that llama.cpp's
authors publish (optional extra ``minillama[gguf]``). Tensor types:

* F32, F16, BF16: widened to float32 (BF16 is the top half of a float32);
* the block types of :data:`minillama.core.quant.QUANT_TYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS): a matrix (every linear weight, the token
  embedding, which is also the head when tied) stays quantized, a
  :class:`~minillama.core.quant.QuantMatrix` over its rows of blocks; the backends dequantize it
  as they multiply. A 1-D tensor stored so is dequantized to float32.

Any other tensor type is refused with one line naming the tensor and the type. Names map to Meta's
by the family's rules (:data:`minillama.io.families.GGUF_TENSORS`): ``token_embd`` ->
``tok_embeddings``, ``blk.N.attn_{norm,q,k,v,output}`` -> ``layers.N.{attention_norm,
attention.wq, wk, wv, wo}``, ``blk.N.ffn_{norm,gate,down,up}`` -> ``layers.N.{ffn_norm,
feed_forward.w1, w2, w3}``, ``output_norm`` -> ``norm``, ``output`` (absent: tied). llama.cpp's
converter already put the ``llama`` q/k rows in the interleaved RoPE order minillama uses; the
files of a family with ``gguf_half_split`` (``qwen2``) keep the half-split order and are permuted
on load.

The tokenizer comes from the metadata (:func:`minillama.io.tokenizer.tokenizer_from_gguf`:
``tokenizer.ggml.model`` ``llama`` or ``gpt2``, BOS/EOS and whether to add them, the chat
template). Every size is checked against the file before anything is allocated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minillama.core import quant
from minillama.core.config import ModelConfig, param_shapes
from minillama.core.errors import MinillamaError
from minillama.core.extras import require
from minillama.core.quant import QUANT_TYPES, QuantMatrix
from minillama.core.quantize import quantize, resolve_type, supported_type
from minillama.io.bpe import BPETokenizer
from minillama.io.checkpoint import atomic_write, check_finite, check_output_file
from minillama.io.families import family_for, gguf_family, pre_tokenizer_name
from minillama.io.gguf_file import GGUFFile  # noqa: F401
from minillama.io.gguf_file import meta as _meta
from minillama.io.gguf_file import open_gguf as _open
from minillama.io.hf import hf_to_interleaved, interleaved_to_hf
from minillama.io.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Llama2cTokenizer,
    load_gguf_tokenizer,  # noqa: F401 (re-exported)
    tokenizer_from_gguf,
)
from minillama.model.transformer import check_params

#: GGML float types the loader reads: name -> (type id, bytes per value); the block types are
#: those of :data:`minillama.core.quant.QUANT_TYPES`
FLOAT_TENSOR_TYPES = {"F32": (0, 4), "F16": (1, 2), "BF16": (30, 2)}
#: every type the loader reads: name -> (values per block, bytes per block)
TENSOR_BLOCKS = {**{k: (1, size) for k, (_, size) in FLOAT_TENSOR_TYPES.items()},
                 **{k: (t.block_elems, t.block_bytes) for k, t in QUANT_TYPES.items()}}
#: GGML type id -> name, for the types of :data:`TENSOR_BLOCKS`
TYPE_NAMES = {**{i: k for k, (i, _) in FLOAT_TENSOR_TYPES.items()},
              **{t.type_id: k for k, t in QUANT_TYPES.items()}}


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
    r"""``n`` float32 values from the raw bytes (uint8) of a tensor of GGML type ``kind``: the
    float types reinterpreted and widened, the block types by :mod:`minillama.core.quant` (their
    equations are there). The caller checked ``raw.size`` against :data:`TENSOR_BLOCKS`."""
    if kind == "F32":
        return raw.view("<f4").astype(np.float32)
    if kind == "F16":
        return raw.view("<f2").astype(np.float32)
    if kind == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return quant.dequantize_rows(kind, raw.reshape(1, -1), n).reshape(n)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def config_from_gguf(reader, shapes: dict[str, tuple[int, ...]], where,
                     freq_factors: list[float] | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from the ``{arch}.*`` metadata and the tensor shapes (vocabulary
    size, tied head, which biases exist); ``freq_factors`` are the values of a ``rope_freqs``
    tensor."""
    arch = gguf_family(_meta(reader, "general.architecture"), where).gguf_arch

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


def _type_name(tid: int, name: str, where) -> str:
    """The name of GGML type ``tid`` if the loader reads it; else a one-line refusal naming the
    tensor and the type."""
    if tid in TYPE_NAMES:
        return TYPE_NAMES[tid]
    try:
        import gguf  # optional: only to name a type minillama does not read

        known = gguf.GGMLQuantizationType(tid).name
    except (ImportError, ValueError):
        raise MinillamaError(f"{where}: tensor {name} has unknown GGML type id {tid}") from None
    raise MinillamaError(f"{where}: tensor {name} has GGML type {known}, which is not supported "
                         f"(supported: {', '.join(TENSOR_BLOCKS)})")


def _tensor_table(reader, file_size: int, where) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """name -> (type name, NumPy shape, raw bytes: a uint8 view of the mapped file) for every
    tensor, each checked before any is read: a known type, positive sizes, rows of whole blocks,
    its bytes inside the file and not overlapping the next tensor's."""
    table, spans = {}, []
    for name_b, dims, type_id, offset in reader.tensor_infos:
        name = name_b.decode("utf-8", errors="replace")[:120]
        if name in table:
            raise MinillamaError(f"{where}: tensor {name} appears twice")
        kind = _type_name(type_id, name, where)
        shape = tuple(reversed(dims))  # GGUF lists the fastest axis first
        if min(shape) <= 0 or max(shape) >= 1 << 40:
            raise MinillamaError(f"{where}: tensor {name} ({kind}) has shape {list(shape)}")
        per, size = TENSOR_BLOCKS[kind]
        if shape[-1] % per:
            raise MinillamaError(f"{where}: tensor {name} ({kind}) has rows of {shape[-1]} values, "
                                 f"not a whole number of blocks of {per}")
        nbytes = int(np.prod(shape, dtype=object)) // per * size
        start = reader.tensor_start + offset
        if start + nbytes > file_size:
            raise MinillamaError(f"{where}: tensor {name} ({kind}, {list(shape)}) needs {nbytes} "
                                 f"bytes at offset {start}, beyond the end of the file "
                                 f"({file_size} bytes): truncated")
        spans.append((start, nbytes, name, kind, shape))
        table[name] = (kind, shape, start, nbytes)
    spans.sort()
    for (start, nbytes, name, kind, shape), nxt in zip(spans, spans[1:]):
        if start + nbytes > nxt[0]:
            raise MinillamaError(f"{where}: tensor {name} ({kind}, {list(shape)}) needs {nbytes} "
                                 f"bytes, but tensor {nxt[2]} starts {nxt[0] - start} bytes "
                                 f"after it")
    return {name: (kind, shape, reader.data[start:start + nbytes])
            for name, (kind, shape, start, nbytes) in table.items()}


def _tensor_value(kind: str, shape: tuple, raw: np.ndarray):
    """A matrix of a block type as a :class:`~minillama.core.quant.QuantMatrix` over the file's
    bytes (rows of blocks, not widened); anything else as float32."""
    if kind in QUANT_TYPES and len(shape) == 2:
        return quant.QuantMatrix(kind, shape, raw.reshape(shape[0], -1))
    return dequantize(raw, kind, int(np.prod(shape))).reshape(shape)


def _our_name(name: str, names, where) -> str:
    ours = names.ours(name)
    if ours is None:
        raise MinillamaError(f"{where}: unexpected GGUF tensor {name[:80]}")
    return ours


def load_gguf(path):
    """Read a LLaMA-family GGUF file: ``(cfg, params, tokenizer or None)`` with Meta names,
    interleaved RoPE rows, float32 vectors and float types, and the matrices of block types kept
    as :class:`~minillama.core.quant.QuantMatrix` (over the memory-mapped file)."""
    path = Path(path)
    reader = _open(path)
    infos = _tensor_table(reader, path.stat().st_size, path)
    factors = None
    if "rope_freqs.weight" in infos:
        kind, shape, raw = infos.pop("rope_freqs.weight")
        if len(shape) != 1 or shape[0] > 1 << 12:
            raise MinillamaError(f"{path}: rope_freqs.weight has shape {list(shape)}")
        factors = dequantize(raw, kind, shape[0]).astype(float).tolist()
    cfg = config_from_gguf(reader, {k: v[1] for k, v in infos.items()}, path, factors)
    family = gguf_family(_meta(reader, "general.architecture"), path)
    expected = param_shapes(cfg)
    params = {}
    for name, (kind, shape, raw) in infos.items():
        ours = _our_name(name, family.gguf_tensors, path)
        if expected.get(ours) != shape:
            raise MinillamaError(f"{path}: tensor {name} has shape {list(shape)}, expected "
                                 f"{list(expected.get(ours, ()))} for this config")
        params[ours] = _tensor_value(kind, shape, raw)
    check_params(cfg, params)
    check_finite({k: v for k, v in params.items() if not isinstance(v, quant.QuantMatrix)}, path)
    for k, v in params.items():
        if isinstance(v, quant.QuantMatrix) and quant.nonfinite_scales(v):
            raise MinillamaError(f"{k.removesuffix('.weight')} ({v.qtype}) holds "
                                 f"{quant.nonfinite_scales(v)} NaN/inf block scales (in {path})")
    if family.gguf_half_split:  # half-split RoPE rows, as in HF
        for key in [k for k in params if ".attention.wq." in k or ".attention.wk." in k]:
            v, heads = params[key], cfg.n_heads if ".wq." in key else cfg.n_kv_heads
            params[key] = (quant.QuantMatrix(v.qtype, v.shape, hf_to_interleaved(v.data, heads))
                           if isinstance(v, quant.QuantMatrix) else hf_to_interleaved(v, heads))
    return cfg, params, tokenizer_from_gguf(reader, cfg.vocab_size, path)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def save_gguf(path, cfg: ModelConfig, params, tokenizer=None, matrix_type: str = "F32",
              types: dict[str, str] | None = None, notes: list[str] | None = None) -> Path:
    """Write a GGUF file (the architecture of the family that claims the config,
    :func:`~minillama.io.families.family_for`: ``llama``, or ``qwen2`` for q/k/v biases without
    the others) that llama.cpp and :func:`load_gguf` read; norms and biases F32, and the tokenizer
    in the metadata (see :func:`_write_tokenizer`).

    A matrix that is a :class:`~minillama.core.quant.QuantMatrix` is written as its blocks, in its
    GGML type. A float matrix is written as ``types[name]`` when given, else ``matrix_type``:
    F32, F16 or a type of :data:`minillama.core.quantize.QUANTIZERS` (quantized here); a row length
    that is not whole blocks of that type takes llama.cpp's fallback
    (:func:`minillama.core.quantize.resolve_type`). What cannot be carried (a tokenizer without a
    GGUF form) is appended to ``notes`` as one line each. Configs GGUF cannot state (a RoPE scaling
    other than linear/yarn, MLP or output biases on qwen2) are refused. The write is atomic."""
    gguf = require("gguf", "writing GGUF files")
    types = dict(types or {})
    for t in [matrix_type, *types.values()]:
        supported_type(t)
    cfg.require_llama("GGUF llama")
    family = family_for(cfg, gguf=True)
    arch = family.gguf_arch
    sc = cfg.rope_scaling
    if sc and sc["rope_type"] not in ("linear", "yarn", "freq_factors"):
        raise MinillamaError(f"GGUF has no field for rope scaling {sc['rope_type']!r}")
    path = check_output_file(path, "GGUF file")
    host = {k: v if isinstance(v, QuantMatrix) else
            np.asarray(v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray) else v,
                       dtype=np.float32) for k, v in params.items()}

    def write(tmp) -> None:
        w = gguf.GGUFWriter(str(tmp), arch)
        _write_hparams(w, cfg, arch)
        note = _write_tokenizer(w, tokenizer, cfg.vocab_size)
        if note and notes is not None:
            notes.append(note)
        for name, a in host.items():
            gname, a = _gguf_tensor_name(name, a, cfg, family)
            data, raw = _gguf_tensor_data(gguf, a, types.get(name, matrix_type))
            w.add_tensor(gname, np.ascontiguousarray(data), raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(path, write, "GGUF file")


def _write_hparams(w, cfg: ModelConfig, arch: str) -> None:
    """The model's shape, norm epsilon, RoPE base and scaling (or its frequency factors as the
    ``rope_freqs`` tensor) and sliding window as ``<arch>.*`` metadata."""
    sc = cfg.rope_scaling
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


def _gguf_tensor_name(name: str, a, cfg: ModelConfig, family):
    """(GGUF name, array) of parameter ``name`` by the family's names (``blk.<l>.<tensor>.
    <weight|bias>`` for a block's), with q and k rows in the half-split RoPE order for a family
    with ``gguf_half_split`` (qwen2)."""
    base = name.split(".", 2)[-1].rsplit(".", 1)[0]
    if family.gguf_half_split and base in ("attention.wq", "attention.wk"):
        a = _to_half_split(a, cfg.n_heads if base == "attention.wq"
                           else cfg.n_kv_heads, interleaved_to_hf)
    return family.gguf_tensors.theirs(name), a


def _gguf_tensor_data(gguf, a, type_name: str):
    """(array to write, raw GGML type or None) of one parameter: a QuantMatrix as its blocks,
    a vector as it is, a matrix as ``type_name`` (or llama.cpp's fallback for its row length)."""
    if isinstance(a, QuantMatrix):
        return a.data, gguf.GGMLQuantizationType[a.qtype]
    if a.ndim != 2:
        return a, None
    kind, _ = resolve_type(type_name, a.shape[1], a)
    if kind == "F16":
        return a.astype(np.float16), None
    if kind == "F32":
        return a, None
    return quantize(a, kind).data, gguf.GGMLQuantizationType[kind]


def _to_half_split(a, n_heads: int, interleaved_to_hf):
    """The q/k rows of ``a`` (a float array or a QuantMatrix, whose rows are whole blocks) in
    the half-split RoPE order of qwen2's files."""
    if not isinstance(a, QuantMatrix):
        return interleaved_to_hf(a, n_heads)
    order = interleaved_to_hf(np.arange(a.shape[0])[:, None], n_heads)[:, 0]
    return QuantMatrix(a.qtype, a.shape, np.ascontiguousarray(a.data[order]))


def _write_tokenizer(w, tok, vocab_size: int) -> str | None:
    """The tokenizer's metadata (``tokenizer.*``); returns a note when it cannot be carried.

    * one read from a GGUF file (its spec names the file): that file's ``tokenizer.*`` fields,
      copied as they are (chat template, pre-tokenizer name and flags included);
    * a SentencePiece tokenizer (:class:`~minillama.io.tokenizer.Llama2cTokenizer`): pieces,
      scores, BOS/EOS/UNK;
    * a Hugging Face ``tokenizer.json`` with a byte-level BPE: model ``gpt2`` with its tokens,
      merges, token types (3 = control for special added tokens), the pre-tokenizer named after
      its split pattern, BOS/EOS and the chat template; the token list is padded to the model's
      vocabulary;
    * the byte tokenizer: a SentencePiece vocabulary of its 256 bytes as BYTE pieces (the space
      spelled U+2581, :meth:`~minillama.io.tokenizer.ByteTokenizer.gguf_pieces`) and BOS/EOS."""
    if tok is None:
        return None
    spec = tok.spec() if hasattr(tok, "spec") else {}
    if spec.get("type") == "gguf" and is_gguf(spec.get("path", "")):
        import gguf  # writing GGUF already needs it

        reader = gguf.GGUFReader(spec["path"], "r")
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
        w.add_add_bos_token(bool(tok.add_bos))
        w.add_add_eos_token(bool(tok.add_eos))
        if tok.chat_template:
            w.add_chat_template(tok.chat_template)
        return None
    if isinstance(tok, ByteTokenizer):  # its bytes as BYTE pieces (llama.cpp reads them)
        import gguf

        pieces = ByteTokenizer.gguf_pieces()
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores([0.0] * len(pieces))
        w.add_token_types([gguf.TokenType.CONTROL if i in (tok.bos_id, tok.eos_id) else
                           gguf.TokenType.NORMAL if p == "\u2581" else gguf.TokenType.BYTE
                           for i, p in enumerate(pieces)])
        w.add_bos_token_id(tok.bos_id)
        w.add_eos_token_id(tok.eos_id)
        w.add_add_bos_token(bool(tok.add_bos))
        w.add_add_eos_token(bool(tok.add_eos))
        w.add_add_space_prefix(False)
        return None
    if isinstance(tok, HFTokenizer):
        return _write_byte_level(w, tok, vocab_size)
    return f"a {type(tok).__name__} is not written to GGUF; the file has no tokenizer"


def _write_byte_level(w, tok, vocab_size: int) -> str | None:
    """A Hugging Face byte-level BPE ``tokenizer.json`` as ``tokenizer.ggml.model`` ``gpt2``."""
    try:
        bpe = BPETokenizer(tok.path)
    except MinillamaError as e:
        return f"tokenizer {tok.path} is not written to GGUF ({e})"
    pre = pre_tokenizer_name(bpe.pattern.pattern) if bpe.byte_level else None
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
    w.add_add_bos_token(bool(getattr(tok, "add_bos", False)))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    return None
