"""A GGUF file checked before transformers reads it: its header, metadata and tensor table are walked (no
tensor data is read) and the file must hold all the tensor data they describe.

transformers' GGUF reader trusts the file: a truncated one ends in ``struct.error`` (or a reshape error deep in
the loading), an empty one in numpy's "cannot mmap an empty file". Here each of those is one ``UserError``
naming the file, what is wrong with it and the fix. Layout (little-endian, versions 2 and 3):

    b"GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata entries:  string key | u32 value type | value          (string: u64 length + bytes)
    tensor entries:    string name | u32 dims | u64 x dims | u32 ggml type | u64 offset
    padding to general.alignment (32 unless stated), then the tensor data, each tensor at its offset
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from typing import NamedTuple

from llm.utils.errors import UserError

REFETCH = "download or convert the model again, or give its converted model directory"

# metadata value types (the gguf package's GGUFValueType): the fixed-width ones by struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_VERSIONS = (2, 3)  # what transformers' reader reads


class GgufSummary(NamedTuple):
    architecture: str  # general.architecture: llama, qwen2, ...
    tensors: int
    weights: int  # elements of all tensors together


class _Corrupt(Exception):
    """The header or tensor table does not parse (the message says where and why)."""


class _Unsupported(_Corrupt):
    """A GGUF version transformers does not read."""


class _Cursor:
    """Little-endian reads from a byte buffer that stop with ``_Corrupt`` at its end instead of past it."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Corrupt(f"ends at byte {len(self.buf):,} in the middle of its header (a value at byte {self.pos:,})")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Corrupt(f"ends at byte {len(self.buf):,}, inside a header entry of {n:,} bytes at byte {self.pos:,}")
        self.pos += n

    def room(self, count: int, least: int, what: str) -> None:
        """Stops unless ``count`` ``what`` of at least ``least`` bytes each fit in the rest (a corrupt count
        would otherwise walk the whole file one entry at a time)."""
        if count * least > len(self.buf) - self.pos:
            raise _Corrupt(
                f"says {count:,} {what} follow at byte {self.pos:,}, more than its {len(self.buf):,} bytes hold"
            )

    def string(self) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos])

    def value(self, kind: int):
        """One metadata value: a scalar or a string is returned, an array walked over (None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise _Corrupt(f"holds a metadata value of unknown type {kind} at byte {self.pos - 4:,}")
        element, count = self.take("IQ")
        if element in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[element]))
            return None
        self.room(count, 8, "array elements")  # a string or a nested array takes at least 8 bytes
        for _ in range(count):
            self.value(element)
        return None


def _layout(buf) -> tuple[GgufSummary, int]:
    """The file's summary and the number of bytes it must hold, from its header and tensor table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf)
    cur.skip(4)  # the magic bytes, checked by the caller
    version, tensors, entries = cur.take("IQQ")
    if version not in _VERSIONS:
        raise _Unsupported(f"is GGUF version {version}, which transformers does not read (versions 2 and 3)")
    cur.room(entries, 13, "metadata entries")  # key (8 + 1), type (4), value
    architecture, alignment = None, 32  # llama.cpp's default alignment
    for _ in range(entries):
        key = cur.string()
        kind = cur.take("I")
        value = cur.value(kind)
        if key == b"general.architecture" and isinstance(value, bytes):
            architecture = value.decode("utf-8", "replace")
        elif key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    if architecture is None:
        raise _Corrupt("has no general.architecture in its metadata")
    cur.room(tensors, 32, "tensor entries")  # name (8 + 1), dimensions (4 + 8), type (4), offset (8)
    end = weights = 0
    for _ in range(tensors):
        name = cur.string().decode("utf-8", "replace")
        dims = cur.take("I")
        if not 1 <= dims <= _MAX_DIMS:
            raise _Corrupt(f"says tensor {name!r} has {dims} dimensions")
        count = math.prod(cur.take("Q") for _ in range(dims))
        kind, offset = cur.take("IQ")
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise _Corrupt(
                f"says tensor {name!r} is of ggml type {kind}, which the gguf package does not know"
            ) from None
        end = max(end, offset + count // block * block_bytes)
        weights += count
    data_start = -(-cur.pos // alignment) * alignment
    return GgufSummary(architecture, tensors, weights), data_start + end


@functools.lru_cache(maxsize=8)
def _checked(path: str, size: int, mtime_ns: int) -> GgufSummary:
    """``check_gguf_file`` of ``path`` as it is now (its size and time): the header is walked once per run."""
    if size == 0:
        raise UserError(f"{path} is empty (0 bytes), not a GGUF file: {REFETCH}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic = bytes(buf[:4])
        if magic != b"GGUF":
            raise UserError(
                f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): give a GGUF file (llama.cpp's "
                "format) or a Hugging Face model directory"
            )
        try:
            summary, need = _layout(buf)
        except _Unsupported as err:
            raise UserError(f"{path} {err}: convert the model again with a current llama.cpp") from None
        except _Corrupt as err:
            raise UserError(f"{path}: the GGUF file is truncated or corrupt: it {err}; {REFETCH}") from None
    if need > size:
        raise UserError(
            f"{path}: the GGUF file is truncated: its {summary.tensors} tensors end at byte {need:,} but the file "
            f"has {size:,} bytes; {REFETCH}"
        )
    return summary


def check_gguf_file(path: str) -> GgufSummary:
    """What the GGUF file ``path`` holds, once its header, metadata and tensor table parse and the file holds
    all the tensor data they describe (not read); else one UserError naming the file and the fix."""
    try:
        stat = os.stat(path)
    except OSError as err:
        raise UserError(f"{path}: cannot read the GGUF file ({err.strerror})") from None
    return _checked(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
