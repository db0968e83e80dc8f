"""The key-value metadata of a GGUF file, read straight from its header.

`gguf.GGUFReader` maps every field and every tensor as numpy views, one Python object per element:
for the embedded model's 49k-token vocabulary and merges that took 2.5-4 s of each router
process's start. The metadata section is a plain sequence (GGUF v2/v3: magic, version, tensor
count, key count, then key, type, value), so reading it in one pass is a few hundred ms; the
tensors after it are never touched. Values come back as `GGUFReader`'s `contents()` gives them:
scalars, str, and lists.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
            12: "<f8"}


class GGUFMetadataError(ValueError):
    """Not a GGUF file this reader understands (wrong magic, version 1, a cut-off header)."""


def read_metadata(path: Path, prefix: str = "") -> dict[str, Any]:
    """Every metadata key of the file that starts with `prefix`, with its value."""
    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFMetadataError("no GGUF magic")
        version, _num_tensors, num_keys = struct.unpack("<IQQ", _exactly(f, 20))
        if version < 2:
            raise GGUFMetadataError(f"GGUF version {version} is not supported (2 and 3 are)")
        out = {}
        for _ in range(num_keys):
            key = _string(f)
            value = _value(f, _u32(f))
            if key.startswith(prefix):
                out[key] = value
        return out


def _exactly(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFMetadataError("the metadata ends early")
    return data


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", _exactly(f, 4))[0]


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", _exactly(f, 8))
    return _exactly(f, length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", _exactly(f, 12))
        if item == _STRING:
            return [_string(f) for _ in range(count)]
        if item == _ARRAY:
            return [_value(f, _u32(f)) for _ in range(count)]
        dtype = _dtype(item)
        return np.frombuffer(_exactly(f, dtype.itemsize * count), dtype=dtype).tolist()
    dtype = _dtype(kind)
    return np.frombuffer(_exactly(f, dtype.itemsize), dtype=dtype)[0].item()


def _dtype(kind: int) -> np.dtype:
    if kind not in _SCALARS:
        raise GGUFMetadataError(f"unknown metadata value type {kind}")
    return np.dtype(_SCALARS[kind])
