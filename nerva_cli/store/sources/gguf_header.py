"""The head of a GGUF file (format v2 and v3, little-endian): its metadata and its tensor table.

gguf-py's GGUFReader makes a NumPy view for every value it parses: on SmolLM2's GGUF (49,152
tokens, 48,900 merges) it took 2.7 s, and `nerva pull smollm2-135m` 3.9 s, of which 0.3 s is
the conversion itself. Read here with `struct` from a memory map, the same header takes 0.05 s
and the pull 0.9-1.0 s (Zen 3, 2 cores). gguf-py still dequantises and names the GGML types.
Tensor data is not touched here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nerva_cli.errors import BadInput

# GGUF value types (gguf's GGUFValueType): struct formats of the scalars; 8 is a string, 9 an array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: the contiguous dimension first
    type: GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (NumPy) shape: rows first."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]  # key -> int, float, bool, str, or a list of those
    tensors: list[TensorInfo]
    data_offset: int  # where tensor data begins


class _Cut(Exception):
    """The header runs past the end of the file."""


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Cut

    def u32(self) -> int:
        self._need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        self._need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self._need(n)
        start, self.pos = self.pos, self.pos + n
        try:
            return self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{self.path}: a GGUF string at byte {start} is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            self._need(struct.calcsize(fmt))
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += struct.calcsize(fmt)
            return v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(key)
        raise BadInput(f"{self.path}: GGUF key '{key}' has unknown value type {vtype}")

    def array(self, key: str) -> list:
        etype, count = self.u32(), self.u64()
        if etype in _SCALAR:
            dtype = np.dtype(_SCALAR[etype])
            self._need(count * dtype.itemsize)
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if etype == _STRING:
            # the vocabulary: one loop with the unpacking bound locally, no method call per item
            self._need(count * 8)  # every string has its length; a corrupt count fails here
            buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
            out = []
            try:
                for _ in range(count):
                    (n,) = unpack(buf, pos)
                    end = pos + 8 + n
                    if end > size:  # else a cut through a character would read as bad UTF-8
                        raise _Cut
                    out.append(buf[pos + 8:end].decode("utf-8"))
                    pos = end
            except struct.error:
                raise _Cut from None
            except UnicodeDecodeError as e:
                raise BadInput(f"{self.path}: an item of GGUF key '{key}' is not UTF-8 ({e.reason})") from None
            self.pos = pos
            return out
        if etype == _ARRAY:
            return [self.array(key) for _ in range(count)]
        raise BadInput(f"{self.path}: GGUF key '{key}' is an array of unknown value type {etype}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF at `path`; BadInput, naming the file, for a file
    that is not GGUF, is cut short in its header, or has a version or layout nerva cannot read."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise BadInput(f"{path}: not a GGUF file (bad magic {magic!r})")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cursor = _Cursor(buf, path)
            try:
                return _parse(cursor)
            except _Cut:
                raise BadInput(f"{path}: cut short in its GGUF header (at byte {cursor.pos} of "
                               f"{len(buf)}); download it again") from None


def _parse(c: _Cursor) -> GGUFHeader:
    path = c.path
    c.pos = 4
    version = c.u32()
    if version & 0xFFFF == 0:
        raise BadInput(f"{path}: a big-endian GGUF; nerva reads little-endian GGUF files only")
    if version not in (2, 3):
        raise BadInput(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_fields = c.u64(), c.u64()
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string()
        if key in fields:
            raise BadInput(f"{path}: GGUF key '{key}' appears twice")
        fields[key] = c.value(c.u32(), key)

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise BadInput(f"{path}: general.alignment is {alignment!r}, not a power of two")

    table = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.u32()
        dims = tuple(c.u64() for _ in range(n_dims))
        raw_type, offset = c.u32(), c.u64()
        table.append((name, dims, raw_type, offset))
    data_offset = -(-c.pos // alignment) * alignment

    tensors, seen = [], set()
    for name, dims, raw_type, offset in table:
        if name in seen:
            raise BadInput(f"{path}: tensor '{name}' appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise BadInput(f"{path}: tensor '{name}' has unknown GGML type {raw_type}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise BadInput(f"{path}: tensor '{name}' has rows of {dims[0]}, not a multiple of "
                           f"{qtype.name}'s {block}-value blocks")
        tensors.append(TensorInfo(name, dims, qtype, data_offset + offset, n_elements // block * block_bytes))
    return GGUFHeader(version, fields, tensors, data_offset)
