"""The C++ paged-attention kernel (`loom_shard.attention.cpu`): correct against a float64
reference, and a query row's output bit-identical at any batch and under any prompt chunking."""

from __future__ import annotations

import random

import pytest
import torch

from loom_shard.attention.backend import BackendKind, PagedBackend, select_backend
from loom_shard.attention.cpu import paged_attention_cpu
from loom_shard.attention.metadata import AttentionSpec, SeqSpan

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs

HEADS, KV_HEADS = 9, 3  # SmolLM2-135M's grouped-query shape (group of 3)
BACKEND = PagedBackend(torch.device("cpu"), paged_attention_cpu, BackendKind.CPU_PAGED)


def make_cache(num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, KV_HEADS, head_dim, generator=gen).to(dtype)


def make_spans(lengths: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int = 0) -> list[SeqSpan]:
    """(num_cached, num_compute) per sequence; block tables drawn without overlap, shuffled."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    spans = []
    for cached, compute in lengths:
        need = -(-(cached + compute) // block_size)
        spans.append(SeqSpan(cached, compute, [free.pop() for _ in range(need)]))
    return spans


def run(q: torch.Tensor, cache: torch.Tensor, spans: list[SeqSpan]) -> torch.Tensor:
    meta = BACKEND.build_metadata(spans, cache.shape[2])
    return paged_attention_cpu(q, cache, meta.paged, AttentionSpec.plain(q.shape[-1]))


def reference(q: torch.Tensor, cache: torch.Tensor, spans: list[SeqSpan]) -> torch.Tensor:
    """float64 causal attention of each sequence over its keys, gathered through its block table."""
    block_size, head_dim = cache.shape[2], cache.shape[4]
    out, start = [], 0
    for span in spans:
        keys = span.num_cached + span.num_compute
        slots = torch.tensor([span.block_table[p // block_size] * block_size + p % block_size for p in range(keys)])
        kv = cache.double().flatten(1, 2)[:, slots]  # [2, keys, kv_heads, head_dim]
        k = kv[0].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [heads, keys, head_dim]
        v = kv[1].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        query = q[start : start + span.num_compute].double().transpose(0, 1)  # [heads, compute, head_dim]
        scores = query @ k.transpose(1, 2) * head_dim**-0.5
        pos = torch.arange(span.num_cached, keys).unsqueeze(1)
        scores.masked_fill_(torch.arange(keys).unsqueeze(0) > pos, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += span.num_compute
    return torch.cat(out)


def queries(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, HEADS, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = {
    "decode": [(40, 1)],
    "prefill": [(0, 50)],
    "prefill after cached prefix": [(33, 20)],
    "mixed batch": [(0, 37), (16, 5), (70, 1), (15, 1), (0, 1), (47, 1)],
    "block boundaries": [(15, 1), (16, 1), (31, 2), (0, 16), (0, 17), (32, 32)],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: the portable (non-vector) path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_reference(case: str, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    cache = make_cache(64, block_size, head_dim, dtype)
    spans = make_spans(CASES[case], block_size, 64)
    q = queries(sum(s.num_compute for s in spans), head_dim, dtype)
    out = run(q, cache, spans)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), reference(q, cache, spans), atol=tolerance, rtol=tolerance)


def test_query_strides_are_honoured() -> None:
    """q arrives as a view of the fused qkv projection: token stride > heads * head_dim."""
    cache = make_cache(16, 16, 64, torch.float32)
    spans = make_spans([(5, 4), (9, 1)], 16, 16)
    fused = queries(5, 64, torch.float32).reshape(5, -1).repeat(1, 2)[:, : HEADS * 64].view(5, HEADS, 64)
    assert not fused.is_contiguous()
    assert torch.equal(run(fused, cache, spans), run(fused.contiguous(), cache, spans))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_is_bit_identical_at_batch_1_7_and_64(dtype: torch.dtype) -> None:
    rng = random.Random(3)
    # A prefill chunk and a decode under test, then others of every kind and length.
    lengths = [(20, 30), (300, 1)] + [(rng.randrange(0, 400), rng.choice([1, 1, 1, 9])) for _ in range(62)]
    cache = make_cache(2048, 16, 64, dtype)
    spans = make_spans(lengths, 16, 2048)
    q = queries(sum(s.num_compute for s in spans), 64, dtype)
    outputs = {}
    for batch in (1, 2, 7, 64):
        tokens = sum(s.num_compute for s in spans[:batch])
        outputs[batch] = run(q[:tokens], cache, spans[:batch])
    assert torch.equal(outputs[1], outputs[64][:30])
    assert torch.equal(outputs[2][30:31], outputs[7][30:31])
    assert torch.equal(outputs[7], outputs[64][: outputs[7].shape[0]])
    alone = run(q[30:31], cache, spans[1:2])  # the decode alone
    assert torch.equal(alone, outputs[64][30:31])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_bit_identical_however_the_prompt_is_chunked(dtype: torch.dtype) -> None:
    cache = make_cache(16, 16, 64, dtype)
    table = make_spans([(0, 100)], 16, 16)[0].block_table
    q = queries(100, 64, dtype)
    whole = run(q, cache, [SeqSpan(0, 100, table)])
    chunked = [(0, 37), (37, 63)]
    by_chunks = torch.cat([run(q[a : a + n], cache, [SeqSpan(a, n, table)]) for a, n in chunked])
    one_by_one = torch.cat([run(q[p : p + 1], cache, [SeqSpan(p, 1, table)]) for p in range(100)])
    assert torch.equal(whole, by_chunks)
    assert torch.equal(whole, one_by_one)
    # ... and in a mixed step, a chunk beside decodes of other sequences
    other = make_spans([(0, 8), (50, 1)], 16, 16, seed=5)
    mixed = run(torch.cat([q[37:], queries(9, 64, dtype, seed=9)]), cache,
                [SeqSpan(37, 63, table), SeqSpan(0, 8, [table[0]]), SeqSpan(50, 1, other[1].block_table)])
    assert torch.equal(mixed[:63], whole[37:])


def test_cpu_selects_the_paged_kernel_and_falls_back_for_other_dtypes() -> None:
    assert select_backend(torch.device("cpu"), torch.bfloat16).kind is BackendKind.CPU_PAGED
    assert select_backend(torch.device("cpu"), torch.float16).kind is BackendKind.TORCH


def test_rejects_a_block_outside_the_cache() -> None:
    cache = make_cache(4, 16, 64, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        run(queries(1, 64, torch.float32), cache, [SeqSpan(3, 1, [9])])
