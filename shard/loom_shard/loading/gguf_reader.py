"""A lean GGUF parser: metadata and tensor directory in milliseconds (string arrays such
as the 49k-token vocabulary are skipped, only counted), tensor bytes as memory-map views.

Layout (little-endian, versions 2 and 3):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key string, value type u32, value)          string = u64 length + utf-8
    tensor_count x (name string, n_dims u32, dims u64[n_dims], type u32, offset u64)
    padding to `general.alignment` (32), then the tensor data; offsets count from there.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# value type -> struct format of one scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this parser can read (the message says why)."""


@dataclass(slots=True, frozen=True)
class StringArray:
    """A metadata array of strings, skipped when parsing: only its length is kept."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    tensor_type: GGMLQuantizationType
    offset: int  # absolute position in the file
    num_bytes: int

    @property
    def row_shape(self) -> tuple[int, int]:
        """(rows, bytes per row) of the raw data, the layout gguf's dequantize expects."""
        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return math.prod(self.shape[1:]), self.shape[0] // block_size * type_size


@dataclass(slots=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    file_size: int
    _map: np.memmap | None = field(default=None, repr=False)

    def raw_data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only memory-map view shaped [rows, bytes per row]."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._map[tensor.offset : tensor.offset + tensor.num_bytes].view(np.ndarray)  # no memmap overhead
        return data.reshape(tensor.row_shape)


_MIN_FILE_SIZE = 24  # magic, version and the two counts


def read_gguf(path: Path) -> GGUFFile:
    """Parses the header, metadata and tensor directory; raises GGUFFormatError or OSError."""
    file_size = path.stat().st_size
    if file_size < _MIN_FILE_SIZE:
        raise GGUFFormatError(f"truncated file ({file_size} bytes, shorter than a GGUF header)")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)  # pages in only the header bytes the parser touches
        try:
            return _Parser(view, file_size).parse(path)
        finally:
            view.release()


class _Parser:
    def __init__(self, data: memoryview, file_size: int) -> None:
        self.data = data
        self.file_size = file_size
        self.pos = 0

    def parse(self, path: Path) -> GGUFFile:
        if bytes(self.data[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"not a GGUF file (bad magic {bytes(self.data[:4])!r}, expected {GGUF_MAGIC!r})")
        self.pos = 4
        version = self._scalar("<I")
        if version not in _SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"unsupported GGUF version {version} (big-endian or too old/new)")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        tensors = {name: self._place(name, shape, kind, data_start + offset) for name, shape, kind, offset in infos}
        return GGUFFile(path, version, metadata, tensors, self.file_size)

    def _take(self, num_bytes: int) -> memoryview:
        end = self.pos + num_bytes
        if num_bytes < 0 or end > len(self.data):
            raise GGUFFormatError(f"truncated or damaged header (needs byte {end}, the file has {self.file_size})")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        raw = self._take(self._scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as error:
            raise GGUFFormatError(f"invalid utf-8 string at byte {self.pos}: {error}") from None

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {self.pos}")
        item_type, length = self._scalar("<I"), self._scalar("<Q")
        if item_type == _STRING:
            for _ in range(length):  # skip: only the count matters to the loader
                self._take(self._scalar("<Q"))
            return StringArray(length)
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            return np.frombuffer(self._take(length * dtype.itemsize), dtype=dtype).copy()  # outlives the map
        return [self._value(item_type) for _ in range(length)]  # nested arrays: rare, tiny

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("<I")
        shape = tuple(self._scalar("<Q") for _ in range(num_dims))
        return name, shape, self._scalar("<I"), self._scalar("<Q")

    def _place(self, name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorInfo:
        try:
            tensor_type = GGMLQuantizationType(kind)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has unknown type {kind}") from None
        if not shape or shape[0] % block_size:
            raise GGUFFormatError(f"tensor {name} has shape {list(shape)}, not whole {tensor_type.name} blocks")
        num_bytes = math.prod(shape) // block_size * type_size
        if offset + num_bytes > self.file_size:
            raise GGUFFormatError(f"truncated file: tensor {name} ends past the end of the file")
        return TensorInfo(name, shape, tensor_type, offset, num_bytes)
