"""A seeded mutation fuzzer for everything minillama reads: test machinery, kept out of the
installed package (used by ``tests/io/test_fuzz_load.py`` and ``scripts/fuzz_load.py``).

Each *target* is one format: a small valid seed (files written by the project's own writers, in a
folder), the file(s) of it that mutations may hit, and a *loader* that reads the mutated copy the
way a user would (``load_model`` and a few tokens of forward pass and greedy decoding, a
tokenizer's encode/decode, a training config's validation, a data folder's batches).

A case is ``(target, index)`` under a run seed: its generator is
``numpy.random.default_rng([seed, target number, index])``, so any case can be replayed alone
(:func:`run_case`). It picks one file and one mutation:

* bytes: bit flips anywhere or in the first 4 KiB, float32 exponent flips, truncation, inserted
  random bytes, zeroed or 0xFF runs, a duplicated chunk, lying length fields (the safetensors
  header length, llama2.c header integers, tokenizer.bin lengths);
* structure: edits of a JSON document (``config.json``, ``tokenizer.json``, a shard index, a
  training config, a safetensors header: its dtype/shape/data_offsets entries and its metadata,
  including the JSON strings inside it): one value anywhere set to a negative, zero, huge,
  float, string, null, list or object value, a key dropped or an unknown one added.

Outcome of a case:

* ``error``: a clean :class:`~minillama.core.errors.MinillamaError` (good);
* ``ok``: loaded, and the logits of the few tokens run are finite (good);
* ``traceback``: any other exception; ``nonfinite``: loaded but NaN/inf logits; ``timeout``:
  longer than the time bound (all three bad; the mutation is reported).
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError

GOOD = ("error", "ok")
BAD = ("traceback", "nonfinite", "timeout", "crash")


# ---------------------------------------------------------------------------------------------
# seeds: small valid files of every format, made by the project's own writers
# ---------------------------------------------------------------------------------------------
def _small_cfg(V: int, tie: bool = False, **kw):
    from minillama.core.config import ModelConfig

    base = dict(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=V, hidden_dim=24,
                max_seq_len=24, tie_embeddings=tie)
    return ModelConfig(**{**base, **kw})


def _params(cfg, seed=0):
    from minillama.model.transformer import init_params

    return init_params(cfg, seed=seed)


def _write_tokenizer_bin(path: Path) -> Path:
    """A llama2.c tokenizer.bin: <unk>, BOS, EOS, the 256 byte pieces <0xXX>, the printable
    ASCII characters and a few merges (score = length, so longer pieces merge first)."""
    pieces = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    pieces += [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)]
    pieces += [(bytes([c]), -1.0) for c in range(32, 127)]
    for w in (" t", "he", " the", " a", "in", " in", "er", "on", " on", "at", " cat"):
        pieces.append((w.encode(), float(len(w))))
    out = bytearray(struct.pack("<i", max(len(p) for p, _ in pieces)))
    for p, s in pieces:
        out += struct.pack("<fi", s, len(p)) + p
    path.write_bytes(bytes(out))
    return path


def _write_hf_tokenizer(folder: Path) -> Path | None:
    """A tiny byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``); None without the
    ``tokenizers`` package."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa
    except ImportError:
        return None
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the fog"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "model_max_length": 24}))
    return folder / "tokenizer.json"


@dataclass
class Target:
    """One fuzzed format: its seed folder, the files mutations may hit, how to load it."""

    name: str
    folder: Path
    files: list[str]
    load: Callable[[Path], Any]
    #: relative weights of the files (default: equal)
    weights: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_targets(root, names: list[str] | None = None) -> dict[str, Target]:
    """Write the seed of every target (or of ``names``) under ``root``; returns them by name.
    Targets whose optional package is missing (``tokenizers``, ``gguf``) are left out."""
    from minillama.io.checkpoint import save_checkpoint
    from minillama.io.load import save_llama2c
    from minillama.io.tokenizer import ByteTokenizer

    root = Path(root)
    targets: dict[str, Target] = {}

    def want(n: str) -> bool:
        return names is None or n in names

    def mk(n: str) -> Path:
        d = root / n / "seed"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    if want("minillama"):
        d = mk("minillama")
        cfg = _small_cfg(ByteTokenizer.vocab_size, tie=True)
        save_checkpoint(d / "model.safetensors", cfg, _params(cfg), tokenizer=ByteTokenizer(),
                        extra_metadata={"note": {"made_by": "fuzz"}})
        targets["minillama"] = Target("minillama", d, ["model.safetensors"],
                                      lambda p: _load_and_run(p / "model.safetensors"))
    for version in (0, 1):
        n = f"llama2c_v{version}"
        if want(n):
            d = mk(n)
            cfg = _small_cfg(40, tie=bool(version))  # v0: untied (negative vocab in the header)
            save_llama2c(d / "model.bin", cfg, _params(cfg), version=version)
            targets[n] = Target(n, d, ["model.bin"], lambda p: _load_and_run(p / "model.bin"))
    for n, shard, extra in HF_SEEDS:
        if want(n):
            t = _make_hf_target(mk(n), n, shard, extra)
            if t is not None:
                targets[n] = t
    if want("hf_bpe"):  # tokenizer.json read by minillama's own BPE (no `tokenizers` package)
        d = mk("hf_bpe")
        if _write_hf_tokenizer(d) is not None:
            targets["hf_bpe"] = Target("hf_bpe", d, ["tokenizer.json", "tokenizer_config.json"],
                                       _load_own_bpe, [4.0, 1.0])
    if want("tokenizer_bin"):
        d = mk("tokenizer_bin")
        _write_tokenizer_bin(d / "tokenizer.bin")
        from minillama.io.tokenizer import Llama2cTokenizer

        V = Llama2cTokenizer(d / "tokenizer.bin").vocab_size
        cfg = _small_cfg(V)
        model_path = save_llama2c(root / "tokenizer_bin" / "model.bin", cfg, _params(cfg))
        targets["tokenizer_bin"] = Target(
            "tokenizer_bin", d, ["tokenizer.bin"],
            lambda p, m=model_path: _load_and_run(m, tokenizer=p / "tokenizer.bin"))
    if want("train_config"):
        d = mk("train_config")
        conf = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context": 16,
                "batch_size": 4, "steps": 10, "lr": 0.002, "min_lr": 0.0002, "warmup": 2,
                "tie_embeddings": True, "data": "shakespeare", "out": "runs/x",
                "time_limit": 1.5, "backend": "numpy"}
        (d / "train.json").write_text(json.dumps(conf, indent=1))
        (d / "train.toml").write_text(_to_toml(conf))
        targets["train_config"] = Target("train_config", d, ["train.json", "train.toml"],
                                         _load_train_config)
    if want("data"):
        d = mk("data")
        from minillama.io.data import prepare_text_file

        src = root / "data" / "corpus.txt"
        src.write_text("To be, or not to be, that is the question.\n" * 30, encoding="utf-8")
        prepare_text_file(src, d, val_fraction=0.3)
        targets["data"] = Target("data", d, ["train.bin", "val.bin", "meta.json"], _load_data,
                                 [2.0, 2.0, 1.0])
    if want("train_ckpt"):
        targets["train_ckpt"] = _make_train_ckpt_target(root, mk)
    targets.update(_make_gguf_targets(mk, want))
    return targets


#: the Hugging Face seeds: (name, max shard bytes, ModelConfig options). The family seeds
#: (biases, RoPE scalings, a sliding window) exist where ModelConfig has those options.
HF_SEEDS = [
    ("hf", None, {}),
    ("hf_sharded", 3000, {}),
    ("hf_qwen2", None, {"qkv_bias": True,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8}}),
    ("hf_mistral", None, {"sliding_window": 8, "head_dim": 4,
                          "rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
                                           "original_max_position_embeddings": 12}}),
]


def _make_hf_target(d: Path, name: str, shard: int | None, extra: dict) -> Target | None:
    """A HF folder: config.json, safetensors weights (sharded with an index when ``shard``),
    tokenizer.json, tokenizer_config.json, generation_config.json. None without the
    ``tokenizers`` package or when ModelConfig lacks an option of ``extra``."""
    import dataclasses

    from minillama.core.config import ModelConfig
    from minillama.io.load import save_hf
    from minillama.io.tokenizer import HFTokenizer

    if not set(extra) <= {f.name for f in dataclasses.fields(ModelConfig)}:
        return None
    tj = _write_hf_tokenizer(d)
    if tj is None:
        return None
    cfg = _small_cfg(HFTokenizer(tj).vocab_size + 4, **extra)  # a padded vocabulary (Qwen's)
    save_hf(d, cfg, _params(cfg), max_shard_bytes=shard)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "max_length": 24}))
    files = sorted(p.name for p in d.iterdir() if p.is_file())
    weights = [4.0 if f.endswith(".safetensors") or f == "config.json" else 1.0 for f in files]
    return Target(name, d, files, lambda p: _load_and_run(p), weights)


def _train_config(data: Path, out: Path):
    from minillama.train.trainer import TrainConfig

    return TrainConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, context=8, batch_size=2,
                       steps=4, warmup=1, eval_interval=2, eval_iters=1, data=str(data),
                       out=str(out), backend="numpy", plot=False)


def _make_train_ckpt_target(root: Path, mk) -> Target:
    """A training checkpoint (weights, AdamW moments, train_state) written after 2 steps; the
    loader resumes a fresh trainer from the mutated copy and takes one more step."""
    from minillama.io.data import prepare_text_file
    from minillama.train.trainer import CKPT_NAME, Trainer

    d = mk("train_ckpt")
    src = root / "train_ckpt" / "corpus.txt"
    src.write_text("Now is the winter of our discontent.\n" * 20, encoding="utf-8")
    data = prepare_text_file(src, root / "train_ckpt" / "data", val_fraction=0.3)
    Trainer(_train_config(data, d), progress=False).train(stop_at=2)
    for p in d.iterdir():
        if p.name != CKPT_NAME:
            p.unlink()

    def load(folder: Path, data=data):
        tr = Trainer(_train_config(data, folder), progress=False)
        tr.resume(folder / CKPT_NAME)
        x = np.arange(8, dtype=np.int64)[None, :]
        logits = tr.model.backend.to_numpy(tr.model.forward(x))
        if not np.isfinite(logits).all():
            raise NonFiniteLogits(f"{int((~np.isfinite(logits)).sum())} non-finite logits")
        tr.train_step()  # a diverged step is a clean TrainingDiverged
        return "ok"

    return Target("train_ckpt", d, [CKPT_NAME], load)


def _make_gguf_targets(mk, want) -> dict[str, Target]:
    """GGUF seeds written by :func:`minillama.io.gguf.save_gguf` (needs the ``gguf``
    package): ``gguf`` (llama, F32, with a SentencePiece tokenizer in the metadata),
    ``gguf_qwen2`` (q/k/v biases, F16 matrices) and ``gguf_quant`` (block-quantized matrices,
    written by :func:`_write_quant_gguf`)."""
    try:
        import gguf  # noqa: F401

        from minillama.io.gguf import save_gguf
    except ImportError:
        return {}
    from minillama.io.tokenizer import Llama2cTokenizer

    out = {}
    for name, extra, mtype in (("gguf", {}, "F32"), ("gguf_qwen2", {"qkv_bias": True}, "F16")):
        if not want(name):
            continue
        d = mk(name)
        tok = Llama2cTokenizer(_write_tokenizer_bin(d.parent / "tokenizer.bin"))
        cfg = _small_cfg(tok.vocab_size, **extra)
        save_gguf(d / "model.gguf", cfg, _params(cfg), tokenizer=tok, matrix_type=mtype)
        out[name] = Target(name, d, ["model.gguf"], lambda p: _load_and_run(p / "model.gguf"))
    if want("gguf_quant"):
        d = mk("gguf_quant")
        tok = Llama2cTokenizer(_write_tokenizer_bin(d.parent / "tokenizer.bin"))
        _write_quant_gguf(d / "model.gguf", _small_cfg(tok.vocab_size, dim=32, hidden_dim=64),
                          tok)
        out["gguf_quant"] = Target("gguf_quant", d, ["model.gguf"],
                                   lambda p: _load_and_run(p / "model.gguf"))
    return out


def _write_quant_gguf(path, cfg, tok) -> None:
    """A llama GGUF (seed ``gguf_quant``) whose matrices cycle through the block types the
    ``gguf`` package quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): they load as QuantMatrix."""
    import gguf

    from minillama.io.families import GGUF_TENSORS
    from minillama.io.gguf import _write_tokenizer

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", cfg.max_seq_len), ("embedding_length", cfg.dim),
                       ("block_count", cfg.n_layers), ("feed_forward_length", cfg.hidden_dim),
                       ("attention.head_count", cfg.n_heads),
                       ("attention.head_count_kv", cfg.n_kv_heads)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    _write_tokenizer(w, tok, cfg.vocab_size)
    types = [gguf.GGMLQuantizationType[t] for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")]
    for i, (name, a) in enumerate(_params(cfg).items()):
        gname = GGUF_TENSORS.theirs(name)
        if a.ndim == 2:
            q = types[i % len(types)]
            w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _to_toml(d: dict) -> str:
    lines = []
    for k, v in d.items():
        lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# loaders: what a user does with each format
# ---------------------------------------------------------------------------------------------
class NonFiniteLogits(Exception):
    """A mutated file loaded, but its logits hold NaN/inf."""


def _load_and_run(path, tokenizer=None):
    """load_model on the NumPy backend, encode a short text (when there is a tokenizer), check
    the logits of up to 4 tokens are finite, greedy-decode 4 tokens and decode them to text."""
    from minillama.infer.generate import generate
    from minillama.io.load import check_tokenizer, load_model
    from minillama.io.tokenizer import load_tokenizer

    model, tok = load_model(path, backend="numpy")
    if tokenizer is not None:
        tok = load_tokenizer(str(tokenizer))
        check_tokenizer(tok, model.cfg.vocab_size)
    V, S = model.cfg.vocab_size, model.cfg.max_seq_len
    ids = tok.encode("the cat", bos=True) if tok is not None else [1, 2, 3, 4]
    ids = [int(i) % V for i in ids][:min(4, S)] or [0]
    logits = model.backend.to_numpy(model.forward(np.array([ids], dtype=np.int64)))
    if not np.isfinite(logits).all():
        raise NonFiniteLogits(f"{int((~np.isfinite(logits)).sum())} non-finite logits")
    new = generate(model, ids, max_new_tokens=min(4, max(S - len(ids), 0)), temperature=0.0)
    if tok is not None:
        tok.decode(ids + new)
    return "ok"


def _load_own_bpe(folder: Path):
    """HFTokenizer as it works without the `tokenizers` package (minillama.io.bpe): load, encode,
    decode."""
    import sys

    from minillama.io.tokenizer import HFTokenizer

    saved = sys.modules.get("tokenizers")
    sys.modules["tokenizers"] = None  # `from tokenizers import ...` now raises ImportError
    try:
        tok = HFTokenizer(folder / "tokenizer.json")
        ids = tok.encode("the cat sat on the mat, 42 caf\u00e9s!", bos=True, eos=True)
        if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids if i is not None):
            raise AssertionError(f"ids outside the vocabulary of {tok.vocab_size}: {ids}")
        tok.decode(ids)
    finally:
        if saved is None:
            sys.modules.pop("tokenizers", None)
        else:
            sys.modules["tokenizers"] = saved
    return "ok"


def _load_train_config(folder: Path):
    from minillama.train.config import TrainConfig, read_config_file

    for name in ("train.json", "train.toml"):
        tc = TrainConfig.from_dict(read_config_file(folder / name))
        tc.validate()
    return "ok"


def _load_data(folder: Path):
    from minillama.io.data import TokenData
    from minillama.io.tokenizer import ByteTokenizer

    data = TokenData(folder, context=16, seed=0, vocab_size=ByteTokenizer.vocab_size)
    x, y = data.train_batch(2)
    assert x.shape == (2, 16) and y.shape == (2, 16)
    data.val_batches(2, 2)
    list(data.val_full_batches(4))
    return "ok"


# ---------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------
#: values a structured edit puts somewhere
INTERESTING = [-1, 0, 1, 2, 3, 7, -(2 ** 31), 2 ** 31 - 1, 2 ** 32, 2 ** 63, 10 ** 12, -10 ** 12,
               10 ** 30, 0.5, -0.5, 1e-30, 1e300, -1e300, float("nan"), float("inf"), "",
               "many", "F32", "I64", "BF16", "default", "yarn", None, True, False, [], {},
               [1, 2], [-1], [10 ** 12, 10 ** 12], {"a": 1}, {"rope_type": "linear"}]


def _json_paths(obj, prefix=()):
    """Every (path, value) in a JSON tree (dict keys and list indices), depth first."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            yield from _json_paths(v, prefix + (i,))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _json_edit(doc, rng) -> tuple[Any, str]:
    """One random edit of a JSON document; returns (new document, description). A string value
    that holds JSON itself (safetensors metadata such as ``config``) is edited inside."""
    paths = [p for p, _ in _json_paths(doc)]
    path = paths[int(rng.integers(len(paths)))]
    if not path:
        op = "replace"
    else:
        op = rng.choice(["set", "set", "set", "drop", "add", "inner"])
    parent_path, leaf = path[:-1], (path[-1] if path else None)
    parent = doc
    for p in parent_path:
        parent = parent[p]
    node = doc
    for p in path:
        node = node[p]
    if op == "inner" and isinstance(node, str):
        try:
            inner = json.loads(node)
        except (ValueError, RecursionError):
            inner = None
        if isinstance(inner, (dict, list)):
            new_inner, d = _json_edit(inner, rng)
            _set(doc, path, json.dumps(new_inner))
            return doc, f"inside {_show_path(path)}: {d}"
        op = "set"
    if op == "inner":
        op = "set"
    if op == "replace":
        v = INTERESTING[int(rng.integers(len(INTERESTING)))]
        return v, f"document := {v!r}"
    if op == "drop":
        del parent[leaf]
        return doc, f"drop {_show_path(path)}"
    if op == "add":
        target = node if isinstance(node, (dict, list)) else parent
        v = INTERESTING[int(rng.integers(len(INTERESTING)))]
        if isinstance(target, dict):
            target["fuzz_extra"] = v
        else:
            target.append(v)
        return doc, f"add {v!r} into {_show_path(path if target is node else parent_path)}"
    # set: an interesting value, or a neighbour / scaled / stringified form of the old number
    old = node
    r = rng.random()
    if isinstance(old, (int, float)) and not isinstance(old, bool) and r < 0.4:
        v = rng.choice(["+1", "-1", "neg", "x1000", "str", "float"])
        new = {"+1": old + 1, "-1": old - 1, "neg": -old, "x1000": old * 1000,
               "str": str(old), "float": float(old) + 0.5}[str(v)]
    else:
        new = INTERESTING[int(rng.integers(len(INTERESTING)))]
    _set(doc, path, new)
    return doc, f"set {_show_path(path)} := {new!r} (was {_short(old)})"


def _show_path(path) -> str:
    return "/" + "/".join(str(p) for p in path)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _dumps(doc) -> bytes:
    return json.dumps(doc).encode("utf-8")


def _mutate_bytes(data: bytes, rng, kind: str, name: str) -> tuple[bytes, str]:
    b = bytearray(data)
    n = len(b)
    if n == 0:
        return bytes(rng.integers(0, 256, 8, dtype=np.uint8)), "empty file := 8 random bytes"
    if kind == "flip":
        k = int(rng.integers(1, 9))
        offs = rng.integers(0, n, k)
        bits = rng.integers(0, 8, k)
        for o, t in zip(offs, bits):
            b[o] ^= 1 << int(t)
        return bytes(b), f"flip bits at {sorted(int(o) for o in offs)[:8]}"
    if kind == "flip_head":
        k = int(rng.integers(1, 5))
        offs = rng.integers(0, min(n, 4096), k)
        for o in offs:
            b[o] ^= 1 << int(rng.integers(0, 8))
        return bytes(b), f"flip bits in the first 4 KiB at {sorted(int(o) for o in offs)}"
    if kind == "exponent":
        k = int(rng.integers(1, 4))
        offs = []
        for _ in range(k):
            o = int(rng.integers(0, max(n // 4, 1))) * 4 + 3
            if o < n:
                b[o] ^= 1 << int(rng.integers(0, 7))  # bits 24..30 of a little-endian float32
                offs.append(o)
        return bytes(b), f"flip float32 exponent bits at bytes {offs}"
    if kind == "truncate":
        cut = int(rng.integers(0, n))
        return bytes(b[:cut]), f"truncate to {cut} of {n} bytes"
    if kind == "insert":
        at = int(rng.integers(0, n + 1))
        k = int(rng.integers(1, 65))
        return bytes(b[:at]) + bytes(rng.integers(0, 256, k, dtype=np.uint8)) + bytes(b[at:]), \
            f"insert {k} random bytes at {at}"
    if kind in ("zero", "ones"):
        at = int(rng.integers(0, n))
        k = int(rng.integers(1, 257))
        b[at:at + k] = (b"\0" if kind == "zero" else b"\xff") * len(b[at:at + k])
        return bytes(b), f"{'zero' if kind == 'zero' else '0xFF'} run of {k} at {at}"
    if kind == "duplicate":
        at = int(rng.integers(0, n))
        k = int(rng.integers(1, 129))
        return bytes(b[:at + k]) + bytes(b[at:]), f"duplicate {k} bytes at {at}"
    if kind == "length":
        return _lie_length(b, rng, name)
    raise ValueError(kind)


def _lie_length(b: bytearray, rng, name: str) -> tuple[bytes, str]:
    """Overwrite a length/size field with an interesting integer."""
    val = int(rng.choice([0, 1, 2, 7, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                          -1, -2, 10 ** 9]))
    if name.endswith(".safetensors") and len(b) >= 8:
        (old,) = struct.unpack("<Q", b[:8])
        new = int(rng.choice([0, 1, old - 1, old + 1, old * 2, len(b), 1 << 40, (1 << 64) - 1]))
        b[:8] = struct.pack("<Q", new % (1 << 64))
        return bytes(b), f"safetensors header length {old} := {new % (1 << 64)}"
    if name.endswith(".bin") and name != "train.bin" and name != "val.bin" and len(b) >= 36:
        if name == "tokenizer.bin":
            o = 0 if rng.random() < 0.5 else 4 + 4  # max_token_length or the first piece's length
        else:
            v1 = struct.unpack("<I", b[:4])[0] == 0x616B3432
            o = (8 if v1 else 0) + 4 * int(rng.integers(0, 7))
            if v1 and rng.random() < 0.2:
                o = 4  # the version field
        old = struct.unpack("<i", b[o:o + 4])[0]
        b[o:o + 4] = struct.pack("<i", ((val + (1 << 31)) % (1 << 32)) - (1 << 31))
        return bytes(b), f"int32 at byte {o} ({old}) := {val}"
    if name.endswith(".gguf") and len(b) >= 24:
        o = int(rng.choice([4, 8, 16]))  # version, tensor count, metadata count
        old = struct.unpack("<Q", b[o:o + 8])[0] if o != 4 else struct.unpack("<I", b[4:8])[0]
        if o == 4:
            b[4:8] = struct.pack("<I", val % (1 << 32))
        else:
            b[o:o + 8] = struct.pack("<Q", val % (1 << 64))
        return bytes(b), f"GGUF header field at {o} ({old}) := {val}"
    at = int(rng.integers(0, max(len(b) - 4, 1)))
    b[at:at + 4] = struct.pack("<i", ((val + (1 << 31)) % (1 << 32)) - (1 << 31))[:len(b) - at]
    return bytes(b), f"int32 at byte {at} := {val}"


def _mutate_structured(data: bytes, rng, name: str) -> tuple[bytes, str] | None:
    """A JSON edit of a .json file, a TOML value edit, or a safetensors header edit; None when
    the file has no structure to edit (it is already broken)."""
    if name.endswith(".json"):
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        doc, d = _json_edit(doc, rng)
        return _dumps(doc), d
    if name.endswith(".toml"):
        import tomllib

        try:
            doc = tomllib.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None
        doc, d = _json_edit(doc, rng)
        if not isinstance(doc, dict):
            return f"x = {json.dumps(doc)}\n".encode(), d
        return _to_toml_any(doc).encode(), d
    if name.endswith(".safetensors") and len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        try:
            header = json.loads(data[8:8 + n])
        except ValueError:
            return None
        header, d = _json_edit(header, rng)
        raw = _dumps(header)
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:], f"header: {d}"
    return None


def _to_toml_any(d: dict) -> str:
    """TOML for a flat table of JSON-like values (nested tables inline; null, NaN and
    non-string keys become what TOML can say)."""
    def val(v):
        if v is None:
            return '"null"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return "nan" if v != v else ("inf" if v == float("inf") else
                                         "-inf" if v == -float("inf") else repr(v))
        if isinstance(v, int):
            return str(v) if abs(v) < 2 ** 63 else f'"{v}"'
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + "}"
        return json.dumps(str(v))
    return "".join(f"{json.dumps(str(k))} = {val(v)}\n" for k, v in d.items())


BYTE_KINDS = ("flip", "flip_head", "exponent", "truncate", "insert", "zero", "ones", "duplicate",
              "length")


def mutate(data: bytes, name: str, rng) -> tuple[bytes, str]:
    """One random mutation of the file ``name`` holding ``data``: (new bytes, description)."""
    structured = name.endswith((".json", ".toml", ".safetensors"))
    if structured and rng.random() < 0.5:
        out = _mutate_structured(data, rng, name)
        if out is not None:
            return out
    kind = str(rng.choice(BYTE_KINDS))
    return _mutate_bytes(data, rng, kind, name)


# ---------------------------------------------------------------------------------------------
# running cases
# ---------------------------------------------------------------------------------------------
class CaseTimeout(BaseException):
    """Raised by the alarm when a case runs past its time bound (a BaseException, so no
    ``except Exception`` in the code under test can swallow it)."""


@dataclass
class Result:
    target: str
    index: int
    status: str  # one of GOOD + BAD
    mutation: str
    detail: str = ""
    seconds: float = 0.0


def case_rng(seed: int, target: str, index: int):
    tid = sum(ord(c) * 31 ** i for i, c in enumerate(target)) % (1 << 32)
    return np.random.default_rng([seed, tid, index])


def prepare_case(t: Target, index: int, seed: int, work: Path) -> str:
    """Copy the seed of ``t`` to ``work`` and apply case ``index``'s mutation; returns its
    description."""
    rng = case_rng(seed, t.name, index)
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(t.folder, work)
    w = np.asarray(t.weights or [1.0] * len(t.files), dtype=np.float64)
    name = t.files[int(rng.choice(len(t.files), p=w / w.sum()))]
    data = (work / name).read_bytes()
    new, desc = mutate(data, name, rng)
    if rng.random() < 0.1:  # now and then a second mutation of the same file
        new, d2 = mutate(new, name, rng)
        desc += f"; then {d2}"
    (work / name).write_bytes(new)
    return f"{name}: {desc}"


def run_case(t: Target, index: int, seed: int, work: Path, time_limit: float = 10.0) -> Result:
    """Prepare and load one case in this process under a SIGALRM time bound."""
    desc = prepare_case(t, index, seed, work)
    t0 = time.perf_counter()
    status, detail = "ok", ""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        t.load(work)
    except CaseTimeout:
        status, detail = "timeout", f"longer than {time_limit} s"
    except MinillamaError as e:
        status, detail = "error", str(e)
        if "\n" in detail.strip():
            status, detail = "traceback", f"multi-line MinillamaError: {detail!r}"
    except NonFiniteLogits as e:
        status, detail = "nonfinite", str(e)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # what we look for (Rust panics are BaseException)
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        status, detail = "traceback", f"{type(e).__name__} at {where}: {str(e)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Result(t.name, index, status, desc, detail, time.perf_counter() - t0)


def _alarm(signum, frame):
    raise CaseTimeout()
