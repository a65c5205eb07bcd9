r"""llama2.c ``.bin`` checkpoints: the legacy version-0 layout and the version-1 float32 layout.

Both are raw little-endian float32 arrays after a small header; nothing is unpickled.

Version 0 (legacy): seven int32 ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len`` (a negative ``vocab_size`` means the classifier is NOT shared with the embedding), then

    tok_embeddings (V, D); attention_norm (L, D); wq (L, H*hd, D); wk (L, KVH*hd, D);
    wv (L, KVH*hd, D); wo (L, D, H*hd); ffn_norm (L, D); w1 (L, F, D); w2 (L, D, F); w3 (L, F, D);
    norm (D,); freq_cis_real (S, hd/2); freq_cis_imag (S, hd/2); [output (V, D) if unshared]

The stored RoPE tables are skipped (the model computes its own from theta = 10000).

Version 1: a 256-byte header: uint32 magic 0x616b3432 ("ak42"), int32 version = 1, the seven
int32 above (``vocab_size`` positive), one uint8 ``shared_classifier`` flag, zero padding; then

    attention_norm (L, D); ffn_norm (L, D); norm (D,); tok_embeddings (V, D); wq; wk; wv; wo;
    w1; w2; w3 (each stacked over L as above); [output (V, D) if not shared]

RoPE in these files is the interleaved-pairs layout used by :func:`minillama.core.ops.rope_forward`;
norm epsilon is 1e-5.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.io.checkpoint import atomic_write, check_finite

MAGIC = 0x616B3432
V1_HEADER_BYTES = 256
V0_HEADER_BYTES = 7 * 4
#: a sanity bound on header fields (a header of random bytes must not look valid)
_MAX_FIELD = 1 << 24

_STACKED = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
            "attention.wo.weight")
_FFN = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def _order(cfg: ModelConfig, version: int) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) blocks of a file in storage order; ``layers.*.X`` blocks are stacked over L
    (name ``"X"`` with a leading L axis); ``"<skip>"`` blocks are read past."""
    D, F, V, L = cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.n_layers
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"attention_norm.weight": (L, D), "ffn_norm.weight": (L, D),
              "attention.wq.weight": (L, qd, D), "attention.wk.weight": (L, kvd, D),
              "attention.wv.weight": (L, kvd, D), "attention.wo.weight": (L, D, qd),
              "feed_forward.w1.weight": (L, F, D), "feed_forward.w2.weight": (L, D, F),
              "feed_forward.w3.weight": (L, F, D)}
    if version == 0:
        names = (["tok_embeddings.weight", "attention_norm.weight", *_STACKED, "ffn_norm.weight",
                  *_FFN, "norm.weight", "<skip>", "<skip>"])
    else:
        names = (["attention_norm.weight", "ffn_norm.weight", "norm.weight",
                  "tok_embeddings.weight", *_STACKED, *_FFN])
    if not cfg.tie_embeddings:
        names.append("output.weight")
    out = []
    for n in names:
        if n in ("tok_embeddings.weight", "output.weight"):
            out.append((n, (V, D)))
        elif n == "norm.weight":
            out.append((n, (D,)))
        elif n == "<skip>":
            out.append((n, (cfg.max_seq_len, cfg.head_dim // 2)))
        else:
            out.append((n, shapes[n]))
    return out


def is_llama2c(path) -> bool:
    """True when ``path`` starts with the version-1 magic or a plausible legacy header."""
    try:
        with open(path, "rb") as f:
            head = f.read(V0_HEADER_BYTES)
    except OSError:
        return False
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MAGIC:
        return True
    if len(head) < V0_HEADER_BYTES:
        return False
    dim, hidden, layers, heads, kv, vocab, seq = struct.unpack("<7i", head)
    return (all(0 < v < _MAX_FIELD for v in (dim, hidden, layers, heads, kv, seq))
            and 0 < abs(vocab) < _MAX_FIELD)


def read_header(path) -> tuple[int, ModelConfig, int]:
    """(version, config, offset of the first weight) of a llama2.c file; bad headers raise."""
    path = Path(path)
    if not path.is_file():
        raise MinillamaError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MAGIC:
        if len(head) < 4 + 4 + 28 + 1:
            raise MinillamaError(f"truncated llama2.c header in {path} ({size} bytes)")
        version = struct.unpack("<i", head[4:8])[0]
        if version != 1:
            raise MinillamaError(
                f"unsupported llama2.c file version {version} in {path} (only float32 "
                f"version 1 and the legacy version 0 are supported)")
        if len(head) < V1_HEADER_BYTES:
            raise MinillamaError(f"truncated llama2.c header in {path} ({size} bytes)")
        fields = struct.unpack("<7i", head[8:36])
        shared = head[36]
        if shared not in (0, 1):
            raise MinillamaError(f"bad shared_classifier flag {shared} in {path}")
        offset = V1_HEADER_BYTES
    else:
        if len(head) < V0_HEADER_BYTES:
            raise MinillamaError(f"not a llama2.c checkpoint (file of {size} bytes): {path}")
        version = 0
        fields = struct.unpack("<7i", head[:V0_HEADER_BYTES])
        shared = int(fields[5] > 0)
        offset = V0_HEADER_BYTES
    dim, hidden, layers, heads, kv, vocab, seq = fields
    vocab = abs(vocab)
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    for n, v in zip(names, (dim, hidden, layers, heads, kv, vocab, seq)):
        if not 0 < v < _MAX_FIELD:
            raise MinillamaError(f"bad llama2.c header in {path}: {n} = {v} (wrong magic or "
                                 f"not a llama2.c file?)")
    try:
        cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                          vocab_size=vocab, hidden_dim=hidden, norm_eps=1e-5, rope_theta=10000.0,
                          max_seq_len=seq, tie_embeddings=bool(shared))
    except MinillamaError as e:
        raise MinillamaError(f"bad llama2.c header in {path}: {e}") from None
    need = offset + 4 * sum(int(np.prod(s)) for _, s in _order(cfg, version))
    if need != size:
        what = "truncated" if size < need else "has trailing bytes"
        raise MinillamaError(
            f"llama2.c v{version} file {path} {what}: the header implies {need} bytes, the file "
            f"has {size}")
    return version, cfg, offset


def load_llama2c(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a llama2.c ``.bin`` (version 0 or 1): returns ``(cfg, params)`` (float32, host)."""
    version, cfg, offset = read_header(path)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read()
    flat = np.frombuffer(raw, dtype="<f4")
    params: dict[str, np.ndarray] = {}
    pos = 0
    for name, shape in _order(cfg, version):
        n = int(np.prod(shape))
        block = flat[pos:pos + n]
        pos += n
        if name == "<skip>":
            continue
        block = block.astype(np.float32).reshape(shape)  # a writable native-endian copy
        stacked = len(shape) == 3 or (len(shape) == 2 and name.endswith("norm.weight")
                                      and name != "norm.weight")
        if stacked:  # checked per layer, so an error names it: layers.3.attention.wq
            check_finite({f"layers.{i}.{name}": block[i] for i in range(cfg.n_layers)}, path)
        else:
            check_finite({name: block}, path)
        if stacked:
            for layer in range(cfg.n_layers):
                params[f"layers.{layer}.{name}"] = np.ascontiguousarray(block[layer])
        else:
            params[name] = block
    return cfg, params


def save_llama2c(path, cfg: ModelConfig, params, version: int = 1) -> Path:
    """Write ``params`` as a llama2.c ``.bin`` of ``version`` 0 (legacy) or 1 (float32, 256-byte
    header). Version 0 stores the RoPE tables (cos, sin) as llama2.c's export does."""
    if version not in (0, 1):
        raise MinillamaError(f"can only write llama2.c versions 0 and 1, not {version}")
    cfg.require_llama("llama2c")
    if cfg.norm_eps != 1e-5 or cfg.rope_theta != 10000.0:
        raise MinillamaError("llama2.c files fix norm_eps = 1e-5 and rope_theta = 10000; this "
                             "config differs")
    extras = [name for name, on in (
        ("head_dim != dim / n_heads", cfg.head_dim * cfg.n_heads != cfg.dim),
        ("biases", cfg.qkv_bias or cfg.attn_out_bias or cfg.mlp_bias),
        ("a sliding window", cfg.sliding_window is not None),
        ("rope scaling", bool(cfg.rope_scaling))) if on]
    if extras:
        raise MinillamaError(f"llama2.c files cannot hold {', '.join(extras)}; export this model "
                             f"as hf or gguf")
    host = {k: np.asarray(v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray) else v,
                          dtype=np.float32) for k, v in params.items()}
    path = Path(path)
    header_fields = (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                     cfg.vocab_size, cfg.max_seq_len)

    def write(tmp) -> None:
        with open(tmp, "wb") as f:
            if version == 0:
                fields = list(header_fields)
                if not cfg.tie_embeddings:
                    fields[5] = -fields[5]
                f.write(struct.pack("<7i", *fields))
            else:
                head = struct.pack("<Ii7iB", MAGIC, 1, *header_fields, int(cfg.tie_embeddings))
                f.write(head + b"\0" * (V1_HEADER_BYTES - len(head)))
            inv = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64)
                                     / cfg.head_dim)
            ang = np.outer(np.arange(cfg.max_seq_len, dtype=np.float64), inv)
            skips = [np.cos(ang), np.sin(ang)]
            for name, shape in _order(cfg, version):
                if name == "<skip>":
                    block = skips.pop(0)
                elif name in host:
                    block = host[name]
                else:
                    block = np.stack([host[f"layers.{i}.{name}"] for i in range(cfg.n_layers)])
                if block.shape != shape:
                    raise MinillamaError(f"{name} has shape {block.shape}, expected {shape}")
                f.write(np.ascontiguousarray(block, dtype="<f4").tobytes())

    return atomic_write(path, write, "llama2.c checkpoint")

