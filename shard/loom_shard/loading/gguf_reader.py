"""A lean GGUF parser: metadata and tensor directory in milliseconds (string arrays such
as the 49k-token vocabulary are skipped, only counted), tensor bytes as memory-map views.
The header and metadata are loom_proto.gguf_header's (the layout is described there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from loom_proto.gguf_header import GGUFFormatError, HeaderParser, parse_file

__all__ = ["GGUFFile", "GGUFFormatError", "TensorInfo", "read_gguf"]

_DEFAULT_ALIGNMENT = 32


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


def read_gguf(path: Path) -> GGUFFile:
    """Parses the header, metadata and tensor directory; raises GGUFFormatError or OSError."""
    return parse_file(path, lambda view, size: _Parser(view, size).parse(path))


class _Parser(HeaderParser):
    def __init__(self, data: memoryview, file_size: int) -> None:
        super().__init__(data, file_size, keep_strings=False)  # the loader only counts the vocabulary

    def parse(self, path: Path) -> GGUFFile:
        header = self.header()
        infos = [self._tensor_info() for _ in range(header.num_tensors)]
        alignment = int(header.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        tensors = {name: self._place(name, shape, kind, data_start + offset) for name, shape, kind, offset in infos}
        return GGUFFile(path, header.version, header.metadata, tensors, self.file_size)

    def numbers(self, fmt: str, length: int) -> Any:
        dtype = np.dtype("<" + fmt)
        return np.frombuffer(self.take(length * dtype.itemsize), dtype=dtype).copy()  # outlives the map

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        num_dims = self.scalar("<I")
        shape = tuple(self.scalar("<Q") for _ in range(num_dims))
        return name, shape, self.scalar("<I"), self.scalar("<Q")

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
