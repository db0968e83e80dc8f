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

import pytest
import torch

from loom_shard.attention.backend import BackendKind
from loom_shard.attention.metadata import SeqSpan
from loom_shard.runtime.cuda_graphs import (
    MAX_GRAPH_SEQS,
    GraphSpec,
    StepGraphs,
    graph_token_sizes,
)
from loom_shard.runtime.kv_cache import PagedKVCache
from loom_shard.runtime.runner import ModelRunner
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
    def capture(self) -> None:
        for tokens in self.spec.token_sizes:
            self.steps[tokens] = self._capture_one(tokens, (0, 0))

    def _record(self, forward, pool):  # noqa: ANN001, ANN202
        replay = _EagerReplay(forward)
        return replay, replay.hidden


@pytest.fixture(scope="module")
def setup(llama_pair) -> tuple[ModelRunner, PagedKVCache, EagerStepGraphs]:
    runner = tiny_runner(llama_pair, BLOCK_SIZE, num_blocks=8)
    assert runner.attention.kind is BackendKind.CPU_PAGED
    cache = PagedKVCache(runner.kv_spec, NUM_BLOCKS, 0, "cpu", num_scratch_blocks=1)
    max_blocks = runner.model.config.max_position_embeddings // BLOCK_SIZE
    spec = GraphSpec(BLOCK_SIZE, max_blocks, max_blocks * BLOCK_SIZE - 1, NUM_BLOCKS, SIZES)
    graphs = EagerStepGraphs(runner.model, cache.device_blocks, runner.attention.kernel, spec)
    with torch.inference_mode():
        graphs.capture()
    return runner, cache, graphs


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
def _eager(runner: ModelRunner, cache: PagedKVCache, ids: list[int], spans: list[SeqSpan]) -> torch.Tensor:
    meta = runner.attention.build_metadata(spans, BLOCK_SIZE)
    return runner.model(torch.tensor(ids), cache.device_blocks, meta)


STEPS = {
    "decodes (5 of bucket 8)": [(9, 1), (3, 1), (17, 1), (1, 1), (30, 1)],
    "a full bucket (16 decodes)": [(i + 2, 1) for i in range(16)],
    "a chunk beside decodes": [(20, 17), (0, 9), (11, 1), (40, 1), (6, 1)],
    "speculative drafts": [(12, 4), (25, 3), (7, 1)],
    "one long prefill (bucket 64)": [(0, 61)],
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_padded_step_gives_the_eager_rows(setup, name: str) -> None:
    runner, cache, graphs = setup
    cache.device_blocks.zero_()
    steps = STEPS[name]
    seqs = _sequences([cached + compute for cached, compute in steps])
    # Each sequence's context first, eagerly, one sequence a step.
    for (tokens, table), (cached, _) in zip(seqs, steps):
        if cached:
            _eager(runner, cache, tokens[:cached], [SeqSpan(0, cached, table)])
    spans = [SeqSpan(cached, compute, table) for (_, table), (cached, compute) in zip(seqs, steps)]
    ids = [t for (tokens, _), (cached, compute) in zip(seqs, steps) for t in tokens[cached : cached + compute]]
    expected = _eager(runner, cache, ids, spans)
    before = cache.device_blocks[:, :, :NUM_BLOCKS].clone()
    assert graphs.can_run(spans, len(ids))
    replays = graphs.num_replays
    with torch.inference_mode():
        got = graphs.run(ids, spans)
    assert graphs.num_replays == replays + 1
    assert torch.equal(got, expected)
    # The step rewrote its own tokens' K/V (the same values); padding touched the scratch block only.
    assert torch.equal(cache.device_blocks[:, :, :NUM_BLOCKS], before)


def test_steps_no_graph_takes(setup) -> None:
    _, _, graphs = setup
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
