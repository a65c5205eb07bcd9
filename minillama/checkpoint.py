"""The project's own checkpoint format: one safetensors file.

Layout of ``NAME.safetensors``:

* tensors: every model parameter under its Meta/llama2.c name (``layers.0.attention.wq.weight``...);
  training checkpoints add optimizer state under ``optim.<slot>.<name>``;
* metadata (string -> string, JSON values): ``format`` = ``"minillama"``, ``format_version``,
  ``config`` (the :class:`ModelConfig` as JSON), ``tokenizer`` (a tokenizer spec, optional) and any
  extra JSON entries a caller adds (``train_state``...).

Writing is atomic (a temporary file in the same folder, fsync, then ``os.replace``), so an
interrupted write never leaves a half-written checkpoint in place of a good one. Reading never
unpickles: safetensors is a JSON header plus raw little-endian arrays.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .errors import MinillamaError
from .model import check_params

FORMAT = "minillama"
FORMAT_VERSION = "1"


def save_checkpoint(path, cfg: ModelConfig, params: dict[str, Any], *, tokenizer=None,
                    extra_tensors: dict[str, Any] | None = None,
                    extra_metadata: dict[str, Any] | None = None, dtype=None) -> Path:
    """Write params (and optional extra tensors/metadata) to ``path`` atomically.

    ``params`` may live on any backend (they are copied to the host). ``dtype`` (e.g. float16)
    converts the parameters for storage; loading converts them back to the compute dtype.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    path = Path(path)
    tensors: dict[str, np.ndarray] = {}
    for k, v in params.items():
        a = _host(v)
        tensors[k] = np.ascontiguousarray(a.astype(dtype) if dtype is not None else a)
    for k, v in (extra_tensors or {}).items():
        if k in tensors:
            raise MinillamaError(f"extra tensor name {k!r} collides with a parameter")
        tensors[k] = np.ascontiguousarray(_host(v))
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": cfg.to_json()}
    if tokenizer is not None:
        meta["tokenizer"] = json.dumps(tokenizer.spec() if hasattr(tokenizer, "spec") else tokenizer)
    for k, v in (extra_metadata or {}).items():
        meta[k] = json.dumps(v)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors and the metadata of a safetensors file; any corruption is a MinillamaError."""
    from safetensors import safe_open  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise MinillamaError(f"checkpoint not found: {path}")
    try:
        tensors = {}
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    except MinillamaError:
        raise
    except Exception as e:  # safetensors raises its own error types for bad headers/sizes
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MinillamaError(f"corrupt or truncated safetensors file {path}: {msg}") from None
    return tensors, meta


def load_checkpoint(path, with_extras: bool = False):
    """Read a minillama checkpoint: returns ``(cfg, params, meta)``.

    ``meta`` holds the decoded JSON metadata (``tokenizer``, ``train_state``, ...); with
    ``with_extras`` the non-parameter tensors (``optim.*``) come back in ``meta["tensors"]``.
    Parameters are checked against the config (names, shapes) and for non-finite values.
    """
    tensors, raw = read_safetensors(path)
    if raw.get("format") != FORMAT or "config" not in raw:
        raise MinillamaError(f"{path} is not a minillama checkpoint (no minillama metadata)")
    try:
        meta = {k: json.loads(v) for k, v in raw.items() if k not in ("format", "format_version")}
    except json.JSONDecodeError as e:
        raise MinillamaError(f"corrupt metadata in {path}: {e}") from None
    if not isinstance(meta.get("config"), dict):
        raise MinillamaError(f"corrupt config metadata in {path}")
    cfg = ModelConfig.from_dict(meta.pop("config"))
    params = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    check_params(cfg, params)
    check_finite(params, path)
    if with_extras:
        meta["tensors"] = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    return cfg, params, meta


def check_finite(params: dict[str, np.ndarray], path="") -> None:
    """Raise a clear error naming the first parameter that holds NaN or Inf."""
    for k, v in params.items():
        if not np.issubdtype(v.dtype, np.floating):
            raise MinillamaError(f"parameter {k} in {path} has non-float dtype {v.dtype}")
        if not np.isfinite(v).all():
            raise MinillamaError(f"parameter {k} in {path} contains NaN or Inf")
