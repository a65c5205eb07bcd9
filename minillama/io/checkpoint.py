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

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError, OutputError
from minillama.io.safetensors_file import read_safetensors_file
from minillama.model.transformer import check_params

FORMAT = "minillama"
#: the checkpoint file inside the folder that ``minillama train --out`` writes
CKPT_NAME = "ckpt.safetensors"
FORMAT_VERSION = "1"


def save_checkpoint(path, cfg: ModelConfig, params: dict[str, Any], *, tokenizer=None,
                    extra_tensors: dict[str, Any] | None = None,
                    extra_metadata: dict[str, Any] | None = None, dtype=None) -> Path:
    """Write params (and optional extra tensors/metadata) to ``path`` atomically.

    ``params`` may live on any backend (they are copied to the host). ``dtype`` (e.g. float16)
    converts the parameters for storage; loading converts them back to the compute dtype.
    """
    from safetensors.numpy import save_file

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
        meta["tokenizer"] = json.dumps(tokenizer.spec() if hasattr(tokenizer, "spec")
                                       else tokenizer)
    for k, v in (extra_metadata or {}).items():
        meta[k] = json.dumps(v)
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta), "checkpoint")


def check_output_file(path, what: str = "output file") -> Path:
    """Refuse, before any work is done, an output file path that cannot be written: an existing
    folder, a parent that is a file, or a folder we may not write into."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} is not writable")
    check_output_dir(path.parent, f"folder of the {what}")
    return path


def check_output_dir(path, what: str = "output folder") -> Path:
    """Refuse an output folder that is an existing file, sits below a file, or cannot be created
    or written into (the nearest existing ancestor decides)."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is" if probe == path else f"lies below {probe}, which is"
        raise OutputError(f"{what} {path} {where} a file, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable (no write permission on {probe})")
    return path


def atomic_write(path, write, what: str = "file") -> Path:
    """Write ``path`` through ``write(tmp_path)`` into a temporary file in the same folder, fsync,
    then ``os.replace``: a failed or interrupted write (full disk, no permission) leaves the
    previous file untouched and no temporary behind, and is one :class:`MinillamaError`."""
    path = Path(path)
    check_output_file(path, what)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        kept = " (the previous file is kept)" if path.is_file() else ""
        raise OutputError(f"cannot write {what} {path}: {e.strerror or e}{kept}") from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":  # its I/O errors (os error 28: disk full)
            raise
        kept = " (the previous file is kept)" if path.is_file() else ""
        msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise OutputError(f"cannot write {what} {path}: {msg}{kept}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors (stored float dtype; BF16 widened to float32) and the metadata of a
    safetensors file; any corruption is a one-line MinillamaError
    (:mod:`minillama.io.safetensors_file` checks the header before reading)."""
    return read_safetensors_file(path, native=True)


def load_checkpoint(path, with_extras: bool = False):
    """Read a minillama checkpoint: returns ``(cfg, params, meta)``.

    ``meta`` holds the decoded JSON metadata (``tokenizer``, ``train_state``, ...); with
    ``with_extras`` the non-parameter tensors (``optim.*``) come back in ``meta["tensors"]``.
    Parameters are checked against the config (names, shapes) and for non-finite values.
    """
    tensors, raw = read_safetensors(path)
    if raw.get("format") != FORMAT or "config" not in raw:
        raise MinillamaError(f"{path} is not a minillama checkpoint (no minillama metadata)")
    if raw.get("format_version") not in (None, FORMAT_VERSION):
        raise MinillamaError(f"{path}: unsupported minillama format_version "
                             f"{raw['format_version'][:20]!r} (this version reads "
                             f"{FORMAT_VERSION})")
    meta = {}
    for k, v in raw.items():
        if k in ("format", "format_version"):
            continue
        try:
            meta[k] = json.loads(v)
        except (ValueError, RecursionError) as e:
            msg = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
            raise MinillamaError(f"corrupt metadata {k[:40]!r} in {path}: {msg}") from None
    if not isinstance(meta.get("config"), dict):
        raise MinillamaError(f"corrupt config metadata in {path}: not a JSON object")
    if meta.get("tokenizer") is not None and not isinstance(meta["tokenizer"], dict):
        raise MinillamaError(f"corrupt tokenizer metadata in {path}: not a JSON object")
    try:
        cfg = ModelConfig.from_dict(meta.pop("config"))
    except MinillamaError as e:
        raise MinillamaError(f"{path}: {e}") from None
    params = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    check_params(cfg, params)
    check_finite(params, path)
    if with_extras:
        meta["tensors"] = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    return cfg, params, meta


#: the largest magnitude a loaded weight may have: float16's maximum. No trained LLaMA-family
#: weight comes near it, while a flipped exponent bit in a stored weight (0.02 -> 6.8e36) lands far
#: beyond it and would overflow the forward pass into NaN logits.
MAX_ABS_WEIGHT = 65504.0


def check_finite(params: dict[str, np.ndarray], path="", limit: float | None = MAX_ABS_WEIGHT
                 ) -> None:
    """Refuse, naming the tensor, NaN/inf values and (unless ``limit`` is None) magnitudes above
    ``limit``: ``layers.3.attention.wq holds 12 NaN/inf values``. One reduction per array
    (max |w|, which is NaN when any NaN is there); the count is taken only for the offender."""
    where = f" (in {path})" if str(path) else ""
    for k, v in params.items():
        if not np.issubdtype(v.dtype, np.floating):
            raise MinillamaError(f"parameter {k}{where} has non-float dtype {v.dtype}")
        if v.size == 0:
            continue
        top = float(np.max(np.abs(v)))
        name = k.removesuffix(".weight")
        if not np.isfinite(top):
            bad = int(v.size - np.count_nonzero(np.isfinite(v)))
            raise MinillamaError(f"{name} holds {bad} NaN/inf value{'s' if bad != 1 else ''}"
                                 f"{where}")
        if limit is not None and top > limit:
            bad = int(np.count_nonzero(np.abs(v) > limit))
            raise MinillamaError(f"{name} holds {bad} value{'s' if bad != 1 else ''} beyond "
                                 f"+-{limit:g} (largest {top:.3g}): not a plausible model weight"
                                 f"{where}")
