"""Decode steps replayed as CUDA graphs, one graph per bucketed batch size, captured at warmup.

A small model's decode step is launch-bound: hundreds of kernels of a few microseconds.
A graph replays them with one launch. Each graph owns static inputs that a step refills:

    input_ids [batch] int64 | packed tables [batch + 1 | batch | batch * max_blocks] int32

Positions and slots are derived on the device from the packed tables inside the graph
(`attention.backend.paged_metadata`). A step smaller than its bucket is padded with one-token
sequences that write into the cache's scratch block and read nothing else. Mixed steps
(prefill chunks) and steps wider than the largest graph run eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from loom_shard.attention.backend import StepShape, host_ints, pack_step_tables, paged_metadata
from loom_shard.attention.metadata import PagedKernel, SeqSpan
from loom_shard.models.decoder import DecoderModel

# Batch sizes captured: dense where small batches are common, coarser above.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(slots=True)
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [batch] int64, static
    packed: torch.Tensor  # [packed_len] int32, static
    hidden: torch.Tensor  # [batch, hidden_size], written by each replay

    @property
    def block_tables(self) -> torch.Tensor:
        """The packed buffer's block-table part, [batch, max_blocks] (a view)."""
        batch = self.input_ids.shape[0]
        return self.packed[2 * batch + 1 :].view(batch, -1)


@dataclass(slots=True, frozen=True)
class GraphSpec:
    block_size: int
    max_blocks: int  # block-table width: the longest sequence a graph can serve
    max_position: int  # rotary table size known at capture
    scratch_block: int
    batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, kernel: PagedKernel, spec: GraphSpec) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.spec = spec
        self.steps: dict[int, _CapturedStep] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return max(self.spec.batch_sizes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for batch in sorted(self.spec.batch_sizes, reverse=True):
            self.steps[batch] = self._capture_one(batch, pool)
        torch.cuda.synchronize()

    def _shape(self, batch: int) -> StepShape:
        return StepShape(batch, self.spec.max_blocks, batch, 1, self.spec.max_position)

    def _capture_one(self, batch: int, pool: tuple[int, int]) -> _CapturedStep:
        device = self.kv_cache.device
        input_ids = torch.zeros(batch, dtype=torch.long, device=device)
        packed_host, _ = pack_step_tables(self._padding(batch), self.spec.block_size, self.spec.max_blocks)
        packed = packed_host.to(device)
        shape = self._shape(batch)
        # One eager run first: compiles the Triton kernel and builds the rotary table.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._forward(input_ids, packed, shape)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(input_ids, packed, shape)
        return _CapturedStep(graph, input_ids, packed, hidden)

    def _forward(self, input_ids: torch.Tensor, packed: torch.Tensor, shape: StepShape) -> torch.Tensor:
        meta = paged_metadata(packed, shape, self.spec.block_size, self.kernel)
        return self.model(input_ids, self.kv_cache, meta)

    def _padding(self, num: int) -> list[SeqSpan]:
        return [SeqSpan(0, 1, [self.spec.scratch_block]) for _ in range(num)]

    def can_run(self, spans: list[SeqSpan]) -> bool:
        """All decodes, few enough for the largest graph, each within the table width."""
        if not spans or len(spans) > self.max_batch:
            return False
        bs = self.spec.block_size
        return all(s.num_compute == 1 and s.num_cached // bs < self.spec.max_blocks for s in spans)

    def run(self, input_ids: list[int], spans: list[SeqSpan]) -> torch.Tensor:
        """Replay the smallest graph that fits; returns hidden states [len(spans), hidden_size]."""
        num = len(spans)
        batch = self.spec.batch_sizes[bisect.bisect_left(self.spec.batch_sizes, num)]
        step = self.steps[batch]
        padded = spans + self._padding(batch - num)
        # Tables as wide as this step needs, not the graph's full width: the host builds and
        # sends batch * width entries, and the kernel never reads past a sequence's last block.
        packed, shape = pack_step_tables(padded, self.spec.block_size)
        head = 2 * batch + 1  # query_starts and num_cached
        ids = host_ints(input_ids + [0] * (batch - num))
        # Three small host-to-device copies from pinned memory, then one launch for the whole step.
        step.packed[:head].copy_(packed[:head].pin_memory(), non_blocking=True)
        step.block_tables[:, : shape.max_blocks].copy_(packed[head:].view(batch, -1).pin_memory(), non_blocking=True)
        step.input_ids.copy_(ids.pin_memory(), non_blocking=True)
        step.graph.replay()
        self.num_replays += 1
        return step.hidden[:num]


def capture_decode_graphs(model: DecoderModel, kv_cache: torch.Tensor, kernel: PagedKernel, scratch_block: int,
                          block_size: int) -> DecodeGraphs:
    """Graphs for sequences up to the model's context length, padding into `scratch_block`."""
    max_blocks = -(-model.config.max_position_embeddings // block_size)
    spec = GraphSpec(block_size, max_blocks, max_blocks * block_size - 1, scratch_block)
    graphs = DecodeGraphs(model, kv_cache, kernel, spec)
    graphs.capture()
    return graphs
