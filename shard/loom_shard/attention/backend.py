"""The attention-backend interface: how a step's metadata is built and which kernels attend.

- `TorchBackend` (CPU, and CUDA without triton): the measured blocked-prefill and
  gather-decode paths of `loom_shard.attention`.
- `PagedBackend` with `BackendKind.CPU_PAGED` (CPU, when Loom's C++ kernels build): one C++
  kernel with the Triton kernel's contract (`loom_shard.attention.cpu`), batch- and
  chunk-invariant.
- `PagedBackend` with `BackendKind.TRITON` (CUDA): one Triton kernel for prefill chunks and decodes that reads
  K/V blocks in place through block tables (`loom_shard.attention.triton_paged`). Its step tables
  travel to the GPU as one int32 transfer; positions and slots are derived there, so the same
  code runs inside a captured CUDA graph (`loom_shard.runtime.cuda_graphs`).

The KV cache layout is the same for both ([layers, 2, blocks, block_size, kv_heads, head_dim]),
so swaps and snapshots do not depend on the backend.
"""

from __future__ import annotations

import array
import enum
import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from loom_shard import kernels
from loom_shard.attention.metadata import (
    AttentionMetadata,
    AttentionSpec,
    PagedKernel,
    PagedTables,
    SeqSpan,
    build_metadata,
)
from loom_shard.transfers import host_ints

log = logging.getLogger(__name__)


class BackendKind(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"
    CPU_PAGED = "cpu_paged"


class AttentionBackend(Protocol):
    kind: BackendKind

    def build_metadata(self, spans: list[SeqSpan], block_size: int) -> AttentionMetadata:
        """The step's metadata; spans with num_compute > 1 come before decodes."""
        ...


@dataclass(slots=True)
class TorchBackend:
    device: torch.device
    kind: BackendKind = BackendKind.TORCH

    def build_metadata(self, spans: list[SeqSpan], block_size: int) -> AttentionMetadata:
        return build_metadata(spans, block_size, self.device)


@dataclass(slots=True, frozen=True)
class StepShape:
    """What the host knows of a step's tables without looking at the device."""

    num_seqs: int
    max_blocks: int  # block-table width
    num_tokens: int
    max_position: int


def pack_step_tables(spans: list[SeqSpan], block_size: int, max_blocks: int | None = None) -> tuple[torch.Tensor, StepShape]:
    """One int32 host tensor: [query_starts (S + 1) | num_cached (S) | block_tables (S * max_blocks)].

    Block tables are cut to the blocks each span reaches and padded with block 0 (never read:
    the kernel stops at the sequence's last key). Built in an `array` (its C conversion of Python
    ints is ~3x torch.tensor's on a list: at 256 sequences this is on every step's host path).
    """
    num_blocks = [-(-(s.num_cached + s.num_compute) // block_size) for s in spans]
    width = max_blocks if max_blocks is not None else max(num_blocks, default=1)
    flat = [0, *accumulate(s.num_compute for s in spans)]
    flat += [s.num_cached for s in spans]
    padding = [0] * width
    for s, n in zip(spans, num_blocks):  # a list grows ~1.7x faster than an array from slices
        flat += s.block_table[:n]
        flat += padding[n:]
    packed = array.array("i", flat)
    shape = StepShape(
        num_seqs=len(spans),
        max_blocks=width,
        num_tokens=packed[len(spans)],
        max_position=max((s.num_cached + s.num_compute - 1 for s in spans), default=0),
    )
    return host_ints(packed, torch.int32), shape


def paged_metadata(packed: torch.Tensor, shape: StepShape, block_size: int, kernel: PagedKernel) -> AttentionMetadata:
    """Metadata from packed tables already on the device; device ops only (graph-capturable)."""
    s = shape.num_seqs
    query_starts = packed[: s + 1]
    num_cached = packed[s + 1 : 2 * s + 1]
    block_tables = packed[2 * s + 1 : 2 * s + 1 + s * shape.max_blocks].view(s, shape.max_blocks)
    tokens = torch.arange(shape.num_tokens, device=packed.device, dtype=torch.int32)
    seq_of_token = torch.searchsorted(query_starts[1:], tokens, right=True)  # [num_tokens]
    positions = (num_cached[seq_of_token] + tokens - query_starts[seq_of_token]).long()
    pages = block_tables[seq_of_token, positions // block_size].long()
    tables = PagedTables(block_tables, query_starts, num_cached, kernel)
    return AttentionMetadata(
        positions=positions,
        max_position=shape.max_position,
        slot_mapping=pages * block_size + positions % block_size,
        prefills=[],
        decode=None,
        block_size=block_size,
        paged=tables,
    )


@dataclass(slots=True)
class PagedBackend:
    """One paged kernel (Triton on CUDA, Loom's C++ on CPU) for prefill chunks and decodes,
    reading K/V blocks in place through the packed step tables."""

    device: torch.device
    kernel: PagedKernel
    kind: BackendKind

    def build_metadata(self, spans: list[SeqSpan], block_size: int) -> AttentionMetadata:
        packed, shape = pack_step_tables(spans, block_size)
        if self.device.type == "cuda":
            # Pinned, so the single copy is asynchronous and the host goes on launching kernels.
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        return paged_metadata(packed, shape, block_size, self.kernel)


def select_backend(device: torch.device, dtype: torch.dtype | None = None) -> AttentionBackend:
    """On CPU, the C++ paged kernel when it builds and takes `dtype`; on CUDA, Triton's paged
    kernel when triton imports; otherwise the torch paths (one log line)."""
    if device.type == "cpu":
        return _cpu_backend(device, dtype)
    if device.type != "cuda":
        return TorchBackend(device)
    try:
        from loom_shard.attention import triton_paged
    except ImportError as error:
        log.warning("triton unavailable (%s): CUDA attention falls back to the torch gather path", error)
        return TorchBackend(device)
    return PagedBackend(device, _triton_kernel(triton_paged), BackendKind.TRITON)


def _triton_kernel(module) -> PagedKernel:  # noqa: ANN001 - loom_shard.attention.triton_paged
    def attend(q: torch.Tensor, kv_layer: torch.Tensor, tables: PagedTables, spec: AttentionSpec) -> torch.Tensor:
        group = q.shape[1] // kv_layer.shape[3]
        tiles = tables.derived.get(group)
        if tiles is None:
            tiles = tables.derived[group] = module.tile_seqs(tables.query_starts, q.shape[0], group)
        return module.paged_attention_triton(q, kv_layer, tables.block_tables, tables.query_starts, tables.num_cached,
                                             tiles, scale=spec.scale, window=spec.window, softcap=spec.softcap,
                                             sinks=spec.sinks)

    return attend


def _cpu_backend(device: torch.device, dtype: torch.dtype | None) -> AttentionBackend:
    from loom_shard.attention import cpu as cpu_attention

    if dtype is not None and dtype not in kernels.DTYPES:
        log.warning("the C++ paged attention takes bfloat16/float32, not %s: CPU attention uses the torch paths", dtype)
        return TorchBackend(device)
    if not kernels.available():
        log.warning("Loom's CPU kernels are unavailable: CPU attention uses the torch gather path")
        return TorchBackend(device)
    return PagedBackend(device, cpu_attention.paged_attention_cpu, BackendKind.CPU_PAGED)
