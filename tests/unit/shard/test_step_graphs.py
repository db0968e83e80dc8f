"""The step graphs' padding and static inputs, on the CPU: every kind of step (decodes, prefill
chunks beside decodes, speculative drafts) run through a bucket's static buffers, padded with
empty sequences and a spare-token sequence, gives the rows an eager step gives, bit for bit,
and the padding writes into the scratch block only.

No CUDA here: each "graph" replays as an eager forward over the bucket's static inputs (the CUDA
capture itself is tested in tests/gpu/test_cuda_runner.py). The CPU paged kernel shares the
Triton kernel's contract and the CPU linears are row-invariant, so the rows must be identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from loom_shard.attention.backend import AttentionBackend, BackendKind
from loom_shard.attention.metadata import PagedKernel, SeqSpan
from loom_shard.models.decoder import DecoderModel
from loom_shard.runtime.cuda_graphs import (
    MAX_GRAPH_SEQS,
    GraphSpec,
    StepGraphs,
    graph_token_sizes,
)
from loom_shard.runtime.kv_cache import KVCacheSpec, PagedKVCache
from tests.unit.shard.conftest import random_tokens, tiny_runner

BLOCK_SIZE = 4
NUM_BLOCKS = 96  # the scratch block is block 96
SIZES = (1, 2, 4, 8, 16, 48, 64)


class _EagerReplay:
    """A CUDA graph's stand-in: replay recomputes the forward over the same static inputs."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward = forward
        self.hidden = forward()

    def replay(self) -> None:
        self.hidden.copy_(self.forward())


class EagerStepGraphs(StepGraphs):
    def _record(self, forward, pool):  # noqa: ANN001, ANN202
        replay = _EagerReplay(forward)
        return replay, replay.hidden


@dataclass(slots=True)
class Setup:
    model: DecoderModel
    backend: AttentionBackend
    cache: PagedKVCache  # NUM_BLOCKS blocks, then the scratch block
    graphs: StepGraphs


def make_setup(model: DecoderModel, backend: AttentionBackend, kernel: PagedKernel, graphs_class: type[StepGraphs],
               device: str = "cpu") -> Setup:
    c = model.config
    spec = KVCacheSpec(c.num_layers, model.num_kv_heads, c.head_dim, BLOCK_SIZE, torch.float32)
    cache = PagedKVCache(spec, NUM_BLOCKS, 0, device, num_scratch_blocks=1)
    max_blocks = c.max_position_embeddings // BLOCK_SIZE
    graph_spec = GraphSpec(BLOCK_SIZE, max_blocks, max_blocks * BLOCK_SIZE - 1, NUM_BLOCKS, SIZES)
    graphs = graphs_class(model, cache.device_blocks, kernel, graph_spec)
    with torch.inference_mode():
        graphs.capture()
    return Setup(model, backend, cache, graphs)


@pytest.fixture(scope="module")
def setup(llama_pair) -> Setup:
    runner = tiny_runner(llama_pair, BLOCK_SIZE, num_blocks=8)
    assert runner.attention.kind is BackendKind.CPU_PAGED
    return make_setup(runner.model, runner.attention, runner.attention.kernel, EagerStepGraphs)


def _sequences(lengths: list[int]) -> list[tuple[list[int], list[int]]]:
    """(tokens, block table) per sequence, blocks handed out in turn from block 0."""
    seqs, first = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // BLOCK_SIZE)
        seqs.append((random_tokens(n, 100 + i), list(range(first, first + blocks))))
        first += blocks
    assert first <= NUM_BLOCKS
    return seqs


@torch.inference_mode()
def _eager(setup: Setup, ids: list[int], spans: list[SeqSpan]) -> torch.Tensor:
    meta = setup.backend.build_metadata(spans, BLOCK_SIZE)
    return setup.model(torch.tensor(ids, device=setup.cache.device), setup.cache.device_blocks, meta)


STEPS = {
    "decodes (5 of bucket 8)": [(9, 1), (3, 1), (17, 1), (1, 1), (30, 1)],
    "a full bucket (16 decodes)": [(i + 2, 1) for i in range(16)],
    "a chunk beside decodes": [(20, 17), (0, 9), (11, 1), (40, 1), (6, 1)],
    "speculative drafts": [(12, 4), (25, 3), (7, 1)],
    "one long prefill (bucket 64)": [(0, 61)],
}


def _own_slots(spans: list[SeqSpan]) -> torch.Tensor:
    """[NUM_BLOCKS, BLOCK_SIZE]: True at the slots of the tokens a step computes."""
    mask = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for span in spans:
        for position in range(span.num_cached, span.num_cached + span.num_compute):
            mask[span.block_table[position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    return mask


@torch.inference_mode()
def replay_and_eager(setup: Setup, steps: list[tuple[int, int]],
                     same_kv: Callable[[torch.Tensor, torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step `steps` ((num_cached, num_compute) per sequence, each context computed first) through
    its graph and eagerly: (graph rows, eager rows). Asserts that the graph step wrote nothing
    outside the scratch block but its own tokens' K/V, which it rewrites with the eager step's
    values as `same_kv` judges them (bit for bit where the linears are row-invariant)."""
    setup.cache.device_blocks.zero_()
    seqs = _sequences([cached + compute for cached, compute in steps])
    for (tokens, table), (cached, _) in zip(seqs, steps):
        if cached:
            _eager(setup, tokens[:cached], [SeqSpan(0, cached, table)])
    spans = [SeqSpan(cached, compute, table) for (_, table), (cached, compute) in zip(seqs, steps)]
    ids = [t for (tokens, _), (cached, compute) in zip(seqs, steps) for t in tokens[cached : cached + compute]]
    expected = _eager(setup, ids, spans)
    before = setup.cache.device_blocks[:, :, :NUM_BLOCKS].clone()
    graphs = setup.graphs
    assert graphs.can_run(spans, len(ids))
    replays = graphs.num_replays
    got = graphs.run(ids, spans).clone()
    assert graphs.num_replays == replays + 1
    after, own = setup.cache.device_blocks[:, :, :NUM_BLOCKS], _own_slots(spans).to(before.device)
    assert torch.equal(after[:, :, ~own], before[:, :, ~own])
    same_kv(after[:, :, own], before[:, :, own])
    return got, expected


@pytest.mark.parametrize("name", list(STEPS))
def test_a_padded_step_gives_the_eager_rows(setup: Setup, name: str) -> None:
    got, expected = replay_and_eager(setup, STEPS[name], same_kv=partial(torch.testing.assert_close, rtol=0, atol=0))
    assert torch.equal(got, expected)


def test_steps_no_graph_takes(setup: Setup) -> None:
    graphs = setup.graphs
    assert not graphs.can_run([], 0)
    assert not graphs.can_run([SeqSpan(0, 65, list(range(17)))], 65)  # more tokens than the largest bucket
    wide = [SeqSpan(0, 1, [0]) for _ in range(MAX_GRAPH_SEQS + 1)]
    assert not graphs.can_run(wide, len(wide))
    max_blocks = graphs.spec.max_blocks
    assert not graphs.can_run([SeqSpan(max_blocks * BLOCK_SIZE, 1, list(range(max_blocks + 1)))], 1)
    assert graphs.can_run([SeqSpan(max_blocks * BLOCK_SIZE - 1, 1, list(range(max_blocks)))], 1)


def test_buckets_reach_the_prefill_budget_within_the_context() -> None:
    sizes = graph_token_sizes(2048, max_blocks=512, block_size=16)
    assert sizes[0] == 1 and sizes[-1] == 2048 and 256 in sizes
    assert graph_token_sizes(512, max_blocks=512, block_size=16)[-1] == 512
    assert graph_token_sizes(100, max_blocks=512, block_size=16)[-1] == MAX_GRAPH_SEQS  # decode batches still
    assert graph_token_sizes(4096, max_blocks=64, block_size=16)[-1] == 1024  # a 1024-token context
