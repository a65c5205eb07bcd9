"""The GGUF container, read by minillama itself (no ``gguf`` package needed): the header, the
metadata and the tensor table of a file, every read bounds-checked. The model reader
(:mod:`minillama.io.gguf`) and the tokenizer reader (:mod:`minillama.io.tokenizer`) both
read files through :func:`open_gguf` and :func:`meta`."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from minillama.core.errors import MinillamaError

#: GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


class GGUFFile:
    """The parsed header of a GGUF file (versions 2 and 3, little-endian): ``fields`` (metadata
    key -> int, float, bool, bytes or list of them; strings stay bytes until :func:`_meta`
    decodes them), ``tensor_infos`` [(name bytes, dims fastest first, type id, offset)],
    ``tensor_start`` (where the offsets count from) and ``data``, the whole file as a uint8 view
    of its memory map. Every read is bounds-checked; a malformed header raises
    :class:`MinillamaError` naming the byte where it went wrong."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            try:
                self.data = np.asarray(np.memmap(f, dtype=np.uint8, mode="r"))
            except ValueError:  # an empty file cannot be mapped
                self.data = np.zeros(0, np.uint8)
        self._buf, self._off = memoryview(self.data), 0
        if bytes(self._take(4)) != b"GGUF":
            self._fail("no GGUF magic")
        version = self._scalar("I")
        if version not in (2, 3):
            self._fail(f"GGUF version {version} (readable: 2, 3; big-endian files are not)")
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        self._count(n_tensors, 24, "tensors")
        self._count(n_kv, 12, "metadata entries")
        self.fields = {}
        for _ in range(n_kv):
            key = self._string().decode("utf-8", errors="replace")
            self.fields[key] = self._value(self._scalar("I"), depth=0)
        self.tensor_infos = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._scalar("I")
            if not 1 <= n_dims <= 4:
                self._fail(f"tensor {name[:80]!r} has {n_dims} dimensions")
            dims = [self._scalar("Q") for _ in range(n_dims)]
            self.tensor_infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            self._fail(f"general.alignment {align!r} is not a power of two")
        self.tensor_start = -(-self._off // align) * align

    def _fail(self, what: str):
        raise MinillamaError(f"corrupt GGUF file {self.path}: {what} (at byte {self._off})")

    def _take(self, n: int) -> memoryview:
        if n > len(self._buf) - self._off:
            self._fail(f"{n} bytes needed, the file ends first")
        self._off += n
        return self._buf[self._off - n:self._off]

    def _scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._take(size))[0]

    def _string(self) -> bytes:
        return bytes(self._take(self._scalar("Q")))

    def _count(self, n: int, least: int, what: str) -> None:
        """n items of at least ``least`` bytes each must fit in the rest of the file."""
        if n * least > len(self._buf) - self._off:
            self._fail(f"{n} {what} cannot fit in the file")

    def _value(self, vtype: int, depth: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == 8:
            return self._string()
        if vtype != 9 or depth > 2:
            self._fail(f"metadata value type {vtype}")
        itype, n = self._scalar("I"), self._scalar("Q")
        if itype in _SCALARS:  # numbers: one read for the whole array
            fmt = "<" + _SCALARS[itype]
            self._count(n, struct.calcsize(fmt), "array items")
            raw = self._take(n * struct.calcsize(fmt))
            return np.frombuffer(raw, dtype=np.dtype(fmt if itype != 7 else "?")).tolist()
        self._count(n, 8, "array items")
        return [self._value(itype, depth + 1) for _ in range(n)]


def open_gguf(path) -> GGUFFile:
    try:
        return GGUFFile(Path(path))
    except OSError as e:
        raise MinillamaError(f"cannot read GGUF file {path}: {e.strerror or e}") from None


def meta(reader, key: str, default=None):
    """The value of metadata ``key`` (a number, a string or a list), else ``default``."""
    value = reader.fields.get(key)
    if value is None:
        return default

    def text(v):  # strings are UTF-8
        if isinstance(v, bytes):
            return v.decode("utf-8")
        return [text(x) for x in v] if isinstance(v, list) and v and \
            isinstance(v[0], (bytes, list)) else v

    try:
        return text(value)
    except UnicodeDecodeError as e:
        raise MinillamaError(f"corrupt GGUF metadata {key}: {str(e)[:80]}") from None
