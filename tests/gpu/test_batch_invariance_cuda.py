"""Batch invariance on CUDA: the Triton paged-attention kernel gives a sequence's rows bit-identical
results whatever else is in the launch and however its prompt is chunked.

Why it holds by design (shard/loom_shard/attention/triton_paged.py): one program owns one query tile
of one sequence and one KV head and walks that sequence's keys from key 0 in fixed BLOCK_N
tiles; there is no split-KV whose split count follows the batch, no atomics, and the block sizes
are constants. Keys past a tile's last query are masked to exactly zero weight, so a chunk
boundary adds only exact no-ops. tl.dot computes each output row from its own query row.
"""

from __future__ import annotations

import pytest
import torch

from loom_shard.attention.backend import BackendKind, pack_step_tables, paged_metadata, select_backend
from loom_shard.attention.metadata import AttentionSpec, SeqSpan

BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
TARGET_CACHED, TARGET_QUERIES = 300, 40  # the sequence under test: 340 keys, a 40-token chunk


def _pool(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    return kv.to("cuda", dtype)


def _run(spans: list[SeqSpan], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    backend = select_backend(torch.device("cuda"))
    assert backend.kind is BackendKind.TRITON
    packed, shape = pack_step_tables(spans, BLOCK_SIZE)
    meta = paged_metadata(packed.cuda(), shape, BLOCK_SIZE, backend.kernel)
    out = meta.paged.kernel(q, kv, meta.paged, AttentionSpec.plain(q.shape[-1]))
    torch.cuda.synchronize()
    return out


def _target_span() -> SeqSpan:
    num_blocks = -(-(TARGET_CACHED + TARGET_QUERIES) // BLOCK_SIZE)
    return SeqSpan(TARGET_CACHED, TARGET_QUERIES, list(range(num_blocks)))


def _batch_with_target(batch: int, target_q: torch.Tensor, kv: torch.Tensor) -> tuple[list[SeqSpan], torch.Tensor, int]:
    """`batch` sequences (the target in the middle, the others decodes and chunks of other lengths,
    reading random blocks of the same pool); returns spans, queries and the target's first row."""
    gen = torch.Generator().manual_seed(batch)
    target = _target_span()
    spans, queries, target_row, row = [], [], 0, 0
    for i in range(batch):
        if i == batch // 2:
            spans.append(target)
            queries.append(target_q)
            target_row = row
            row += TARGET_QUERIES
            continue
        n = 1 if i % 3 else int(torch.randint(2, 70, (1,), generator=gen))
        cached = int(torch.randint(0, 900, (1,), generator=gen))
        blocks = torch.randint(0, kv.shape[1], (-(-(cached + n) // BLOCK_SIZE),), generator=gen).tolist()
        spans.append(SeqSpan(cached, n, blocks))
        queries.append(torch.randn(n, HEADS, HEAD_DIM, generator=gen).to("cuda", target_q.dtype))
        row += n
    return spans, torch.cat(queries), target_row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_identical_at_batch_1_7_64(dtype: torch.dtype) -> None:
    kv = _pool(128, dtype)
    target_q = torch.randn(TARGET_QUERIES, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    alone = _run([_target_span()], target_q, kv)
    for batch in (7, 64):
        spans, q, start = _batch_with_target(batch, target_q, kv)
        together = _run(spans, q, kv)[start : start + TARGET_QUERIES]
        assert torch.equal(together, alone), f"batch {batch} changed the target's rows"


@pytest.mark.parametrize("split", [1, 7, 16, 33])
def test_rows_identical_across_chunkings(split: int) -> None:
    kv = _pool(128, torch.bfloat16)
    target_q = torch.randn(TARGET_QUERIES, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    whole = _run([_target_span()], target_q, kv)
    blocks = _target_span().block_table
    first = _run([SeqSpan(TARGET_CACHED, split, blocks)], target_q[:split], kv)
    rest = _run([SeqSpan(TARGET_CACHED + split, TARGET_QUERIES - split, blocks)], target_q[split:], kv)
    assert torch.equal(torch.cat([first, rest]), whole)
