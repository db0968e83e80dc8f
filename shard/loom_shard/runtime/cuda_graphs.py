"""Steps replayed as CUDA graphs, one graph per bucketed token count, captured at warmup.

A small model's step is launch-bound: hundreds of kernels of a few microseconds. A graph
replays them with one launch. Every kind of step replays one (decodes, prefill chunks beside
decodes, speculative drafts) when its tokens fit the largest bucket and its sequences the
graph's sequence slots; wider steps and steps with LoRA adapters run eagerly. Each graph owns
static inputs that a step refills:

    input_ids [tokens] int64 | packed tables [seqs + 1 | seqs | seqs * max_blocks] int32

with seqs = min(tokens, MAX_GRAPH_SEQS) + 1. Positions, slots and the attention kernel's tiles
are derived on the device from the packed tables inside the graph
(`attention.backend.paged_metadata`): the paged kernel's grid follows the token and sequence
counts only, so one graph serves any mix of query lengths. A step smaller than its graph is
padded: empty sequences fill the unused sequence slots and the last slot takes the spare
tokens, which write into the cache's scratch block and read nothing else.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from loom_shard.attention.backend import StepShape, pack_step_tables, paged_metadata
from loom_shard.attention.metadata import PagedKernel, SeqSpan
from loom_shard.models.decoder import DecoderModel
from loom_shard.runtime.staging import PinnedStaging
from loom_shard.transfers import host_ints

# Token counts captured: dense where decode batches are common, coarser above (prefill chunks).
GRAPH_TOKEN_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256,
                     320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
MAX_GRAPH_SEQS = 256  # sequences one graph step takes (a decode batch of 256 fills the 256 bucket)


class Replayable(Protocol):
    def replay(self) -> None: ...


@dataclass(slots=True)
class _CapturedStep:
    graph: Replayable  # a torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [tokens] int64, static
    packed: torch.Tensor  # [packed_len] int32, static
    hidden: torch.Tensor  # [tokens, hidden_size], written by each replay

    @property
    def num_seqs(self) -> int:
        return _num_seqs(self.input_ids.shape[0])

    @property
    def block_tables(self) -> torch.Tensor:
        """The packed buffer's block-table part, [seqs, max_blocks] (a view)."""
        return self.packed[2 * self.num_seqs + 1 :].view(self.num_seqs, -1)


@dataclass(slots=True, frozen=True)
class GraphSpec:
    block_size: int
    max_blocks: int  # block-table width: the longest sequence a graph can serve
    max_position: int  # rotary table size known at capture
    scratch_block: int
    token_sizes: tuple[int, ...] = GRAPH_TOKEN_SIZES


class StepGraphs:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, kernel: PagedKernel, spec: GraphSpec) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.spec = spec
        self.steps: dict[int, _CapturedStep] = {}
        self.num_replays = 0
        # The step's inputs on their way to the device (CUDA): the widest int32 tables, the most int64 ids
        seqs = _num_seqs(self.max_tokens)
        self.staging = (PinnedStaging([4 * (2 * seqs + 1 + seqs * spec.max_blocks), 8 * self.max_tokens])
                        if kv_cache.is_cuda else None)

    @property
    def max_tokens(self) -> int:
        return max(self.spec.token_sizes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        cuda = self.kv_cache.is_cuda  # elsewhere only a stand-in for the graphs (tests, benches) records
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for tokens in sorted(self.spec.token_sizes, reverse=True):
            self.steps[tokens] = self._capture_one(tokens, pool)
        if cuda:
            torch.cuda.synchronize()

    def _capture_one(self, tokens: int, pool: tuple[int, int] | None) -> _CapturedStep:
        input_ids = torch.zeros(tokens, dtype=torch.long, device=self.kv_cache.device)
        packed, _ = pack_step_tables(self._padding([], 0, tokens), self.spec.block_size, self.spec.max_blocks)
        packed = packed.to(self.kv_cache.device)
        shape = StepShape(_num_seqs(tokens), self.spec.max_blocks, tokens, self.spec.max_position)
        graph, hidden = self._record(lambda: self._forward(input_ids, packed, shape), pool)
        return _CapturedStep(graph, input_ids, packed, hidden)

    def _record(self, forward: Callable[[], torch.Tensor],
                pool: tuple[int, int] | None) -> tuple[Replayable, torch.Tensor]:
        """One eager run first (compiles the Triton kernels, builds the rotary table), then the capture."""
        device = self.kv_cache.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = forward()
        return graph, hidden

    def _forward(self, input_ids: torch.Tensor, packed: torch.Tensor, shape: StepShape) -> torch.Tensor:
        meta = paged_metadata(packed, shape, self.spec.block_size, self.kernel)
        return self.model(input_ids, self.kv_cache, meta)

    def _padding(self, spans: list[SeqSpan], num_tokens: int, bucket: int) -> list[SeqSpan]:
        """`spans` (num_tokens in all) filled out to the bucket's sequence slots and tokens: empty
        sequences, then one that takes the spare tokens into the scratch block (every position
        of it on that block: its keys are its own, written in the same layer before they are read)."""
        spare = bucket - num_tokens
        empty = [SeqSpan(0, 0, []) for _ in range(_num_seqs(bucket) - 1 - len(spans))]
        scratch = SeqSpan(0, spare, [self.spec.scratch_block] * -(-spare // self.spec.block_size))
        return spans + empty + [scratch]

    def can_run(self, spans: list[SeqSpan], num_tokens: int) -> bool:
        """Few enough tokens and sequences for the largest graph, each within the table width."""
        if not spans or num_tokens > self.max_tokens or len(spans) > min(num_tokens, MAX_GRAPH_SEQS):
            return False
        bs, width = self.spec.block_size, self.spec.max_blocks
        return all((s.num_cached + s.num_compute - 1) // bs < width for s in spans)

    def run(self, input_ids: list[int], spans: list[SeqSpan],
            patch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Replay the smallest graph that fits; returns hidden states [len(input_ids), hidden_size].
        `patch` writes, on the device, the inputs still computed by an earlier step."""
        num_tokens = len(input_ids)
        bucket = self.spec.token_sizes[bisect.bisect_left(self.spec.token_sizes, num_tokens)]
        step = self.steps[bucket]
        # Tables as wide as this step needs, not the graph's full width: the host builds and
        # sends seqs * width entries, and the kernel never reads past a sequence's last block.
        packed, shape = pack_step_tables(self._padding(spans, num_tokens, bucket), self.spec.block_size)
        head = 2 * step.num_seqs + 1  # query_starts and num_cached
        ids = host_ints(input_ids + [0] * (bucket - num_tokens))
        packed, ids = self.staging.stage(packed, ids) if self.staging is not None else (packed, ids)
        # Three small host-to-device copies from pinned memory, then one launch for the whole step.
        step.packed[:head].copy_(packed[:head], non_blocking=True)
        step.block_tables[:, : shape.max_blocks].copy_(packed[head:].view(step.num_seqs, -1), non_blocking=True)
        step.input_ids.copy_(ids, non_blocking=True)
        if self.staging is not None:
            self.staging.done_reading()
        if patch is not None:
            patch(step.input_ids)
        step.graph.replay()
        self.num_replays += 1
        return step.hidden[:num_tokens]


def _num_seqs(tokens: int) -> int:
    """A bucket's sequence slots: every step of that many tokens has at most that many sequences
    (MAX_GRAPH_SEQS at most), and one more slot takes a smaller step's spare tokens."""
    return min(tokens, MAX_GRAPH_SEQS) + 1


def graph_token_sizes(max_step_tokens: int, max_blocks: int, block_size: int) -> tuple[int, ...]:
    """The buckets a shard captures: every decode batch up to MAX_GRAPH_SEQS, and prefill steps up
    to the largest the router schedules, none longer than the model's context (a bucket's spare
    tokens take positions from 0 in the scratch sequence)."""
    limit = min(max(max_step_tokens, MAX_GRAPH_SEQS), max_blocks * block_size)
    return tuple(t for t in GRAPH_TOKEN_SIZES if t <= limit)


def capture_step_graphs(model: DecoderModel, kv_cache: torch.Tensor, kernel: PagedKernel, scratch_block: int,
                        block_size: int, max_step_tokens: int) -> StepGraphs:
    """Graphs for sequences up to the model's context length, padding into `scratch_block`."""
    max_blocks = -(-model.config.max_position_embeddings // block_size)
    sizes = graph_token_sizes(max_step_tokens, max_blocks, block_size)
    spec = GraphSpec(block_size, max_blocks, max_blocks * block_size - 1, scratch_block, sizes)
    graphs = StepGraphs(model, kv_cache, kernel, spec)
    graphs.capture()
    return graphs
