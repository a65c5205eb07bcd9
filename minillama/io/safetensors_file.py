"""The one safetensors reader: every byte of the header checked before any array is allocated.

Layout: a little-endian uint64 N, N bytes of UTF-8 JSON

    {"NAME": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
     "__metadata__": {"key": "value", ...}}

then the data block; ``begin``/``end`` are byte offsets into the data block. Checks, in order:
the file exists and holds at least the 8-byte length; N fits the file (and a 100 MiB bound);
the header is a JSON object; ``__metadata__`` (optional) maps strings to strings; every entry
is an object with exactly ``dtype`` (a supported name), ``shape`` (at most 8 non-negative
integers) and ``data_offsets`` (two integers 0 <= begin <= end); ``end - begin`` equals
prod(shape) * itemsize; ``end`` lies inside the file; no two tensors overlap. Only then is each
tensor read (one ``fromfile`` per tensor, no whole-file copy).

Both the project's own checkpoints (:mod:`minillama.io.checkpoint`) and Hugging Face weights
(:mod:`minillama.io.hf`) come through here. Nothing is unpickled.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError

#: safetensors dtype name -> how it is stored on disk
DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"),
          "BF16": np.dtype("<u2")}
MAX_HEADER = 100 * 1024 * 1024
MAX_NDIM = 8
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict[str, str],
                                int, int]:
    """Parse and check the header: ``(entries, metadata, data start, file size)``, entries mapping
    a name to ``(dtype, shape, begin, end)``. Any inconsistency is a :class:`MinillamaError`."""
    path = Path(path)
    raw, size = _header_bytes(path)
    header, meta = _header_json(raw, path)
    base = 8 + len(raw)
    entries = {name: _header_entry(name, info, path, base, size) for name, info in header.items()}
    _check_no_overlap(entries, path)
    return entries, {str(k): v for k, v in meta.items()}, base, size


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """The header's n bytes (after its 8-byte length, which must fit the file) and the file size."""
    if not path.exists():
        raise MinillamaError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise MinillamaError(f"{path} is not a file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MinillamaError(f"truncated safetensors file {path} ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > min(size - 8, MAX_HEADER):
                raise MinillamaError(f"corrupt safetensors file {path}: a header of {n} bytes "
                                     f"overruns the file of {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise MinillamaError(f"cannot read {path}: {e.strerror or e}") from None
    return raw, size


def _header_json(raw: bytes, path: Path) -> tuple[dict, dict]:
    """The header as a JSON object without ``__metadata__``, and that metadata (str -> str)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise MinillamaError(f"corrupt safetensors header in {path}: {msg}") from None
    if not isinstance(header, dict):
        raise MinillamaError(f"corrupt safetensors header in {path}: not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise MinillamaError(f"corrupt safetensors header in {path}: __metadata__ must map "
                             f"strings to strings")
    return header, meta


def _header_entry(name: str, info, path: Path, base: int,
                  size: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor's checked ``(dtype, shape, begin, end)``: a known dtype, a shape of at most
    MAX_NDIM sizes, a byte range that fits the shape and lies inside the file."""
    where = f"safetensors file {path}: tensor {name[:80]!r}"
    if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
        raise MinillamaError(f"corrupt {where}: an entry needs exactly dtype, shape and "
                             f"data_offsets")
    dt, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dt, str) or dt not in DTYPES:
        raise MinillamaError(f"{where} has unsupported dtype {str(dt)[:20]} (supported: "
                             f"{', '.join(DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise MinillamaError(f"corrupt {where}: shape must be a list of at most {MAX_NDIM} "
                             f"non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise MinillamaError(f"corrupt {where}: data_offsets must be two integers "
                             f"0 <= begin <= end")
    begin, end = offsets
    count = 1
    for d in shape:
        count *= d
    if end - begin != count * DTYPES[dt].itemsize:
        raise MinillamaError(f"corrupt {where}: byte range {begin}..{end} does not fit its "
                             f"shape {shape} and dtype {dt}")
    if end > size - base:
        raise MinillamaError(f"corrupt or truncated {where} ends at byte {base + end}, "
                             f"the file has {size}")
    return dt, tuple(shape), begin, end


def _check_no_overlap(entries, path: Path) -> None:
    """No two tensors' non-empty byte ranges overlap."""
    spans = sorted((b, e, k) for k, (_, _, b, e) in entries.items() if e > b)
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise MinillamaError(f"corrupt safetensors file {path}: tensors {k0[:80]!r} and "
                                 f"{k1[:80]!r} overlap")


def read_safetensors_file(path, native: bool = False
                          ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a safetensors file and its metadata, after :func:`read_header`'s checks.

    F32 and F16 come back as float32 (F16 stays float16 with ``native``), F64 as float64, BF16
    widened to float32 exactly (its bits are the top half of a float32)."""
    entries, meta, base, _ = read_header(path)
    tensors: dict[str, np.ndarray] = {}
    try:
        with open(path, "rb") as f:
            for name, (dt, shape, begin, end) in entries.items():
                count = (end - begin) // DTYPES[dt].itemsize
                f.seek(base + begin)
                raw = np.fromfile(f, dtype=DTYPES[dt], count=count)
                if raw.size != count:  # the file shrank while we read it
                    raise MinillamaError(f"truncated safetensors file {path} at tensor {name}")
                if dt == "BF16":
                    arr = (raw.astype(np.uint32) << 16).view(np.float32)
                elif dt == "F64" or (native and dt == "F16"):
                    arr = raw.astype(raw.dtype.newbyteorder("="))
                else:
                    arr = raw.astype(np.float32)
                tensors[name] = arr.reshape(shape)
    except OSError as e:
        raise MinillamaError(f"cannot read {path}: {e.strerror or e}") from None
    return tensors, meta
