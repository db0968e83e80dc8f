"""The C++ paged-attention kernel against a float64 reference, and its invariances:
a row is bit-identical at any batch size and however its prompt was chunked (batch invariance)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loom_shard.attention.backend import pack_step_tables
from loom_shard.attention.metadata import SeqSpan
from loom_shard.kernels.attention import paged_attention

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per build this CPU runs


@dataclass(slots=True)
class Cache:
    kv: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim]
    tables: list[list[int]]  # per sequence
    lengths: list[int]  # keys written per sequence


def make_cache(lengths: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> Cache:
    """Random K/V for each sequence in shuffled blocks; every other slot holds NaN, so a kernel
    that reads past a sequence's last key (or through padding) poisons its output."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    blocks = list(range(1, sum(needed) + 1))  # block 0 is the padding block
    random.Random(seed).shuffle(blocks)
    kv = torch.full((2, len(blocks) + 1, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables, first = [], 0
    for n, count in zip(lengths, needed):
        table = blocks[first : first + count]
        first += count
        for pos in range(n):
            kv[:, table[pos // block_size], pos % block_size] = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
        tables.append(table)
    return Cache(kv, tables, lengths)


def run(q: torch.Tensor, cache: Cache, spans: list[tuple[int, int]], which: list[int]) -> torch.Tensor:
    """Attend `spans` (num_cached, num_compute) of sequences `which` with the kernel."""
    seq_spans = [SeqSpan(c, n, cache.tables[s]) for s, (c, n) in zip(which, spans)]
    packed, shape = pack_step_tables(seq_spans, cache.kv.shape[2])
    s = shape.num_seqs
    query_starts, num_cached = packed[: s + 1], packed[s + 1 : 2 * s + 1]
    tables = packed[2 * s + 1 :].view(s, shape.max_blocks)
    return paged_attention(q, cache.kv, tables, query_starts, num_cached)


def reference(q: torch.Tensor, cache: Cache, seq: int, num_cached: int) -> torch.Tensor:
    """float64 causal attention of q [tokens, heads, hd] (positions num_cached..) over seq's keys."""
    tokens, heads, hd = q.shape
    block_size, kv_heads = cache.kv.shape[2], cache.kv.shape[3]
    slots = [(cache.tables[seq][p // block_size], p % block_size) for p in range(num_cached + tokens)]
    kv = torch.stack([cache.kv[:, b, o] for b, o in slots], dim=1).double()  # [2, keys, kv_heads, hd]
    k = kv[0].repeat_interleave(heads // kv_heads, dim=1)
    v = kv[1].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * hd**-0.5
    keys = torch.arange(num_cached + tokens)
    visible = keys[None, :] <= (num_cached + torch.arange(tokens))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htk,khd->thd", probs, v)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 128, 4), (6, 2, 32, 8), (8, 2, 64, 5), (4, 2, 96, 16), (2, 1, 256, 8), (4, 2, 48, 16)])
def test_mixed_batch_matches_float64_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # prefill from scratch, prefill after a cached prefix, decodes at and across block boundaries
    spans = [(0, 23), (17, 40), (31, 1), (32, 1), (0, 1), (70, 1)]
    cache = make_cache([c + n for c, n in spans], kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(n for _, n in spans), heads, head_dim).to(dtype)
    out = run(q, cache, spans, list(range(len(spans))))
    assert out.dtype == dtype and out.shape == q.shape
    first = 0
    for seq, (cached, n) in enumerate(spans):
        expected = reference(q[first : first + n], cache, seq, cached)
        torch.testing.assert_close(out[first : first + n].double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        first += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32, 256, 48])
def test_a_row_is_bit_identical_at_batch_1_7_and_64(dtype: torch.dtype, head_dim: int) -> None:
    rng = random.Random(1)
    spans = [(rng.randrange(0, 300), rng.choice([1, 1, 1, 5, 40])) for _ in range(64)]
    spans[0] = (150, 1)  # the watched decode
    spans[1] = (20, 50)  # the watched prefill chunk
    cache = make_cache([c + n for c, n in spans], 3, head_dim, 16, dtype, seed=2)
    q = torch.randn(sum(n for _, n in spans), 9, head_dim).to(dtype)
    full = run(q, cache, spans, list(range(64)))
    # other batches, the watched sequences at other offsets (last, or the batch reversed)
    for order in ([0], [2, 3, 4, 5, 6, 1, 0], list(reversed(range(64)))):
        offsets = [sum(n for _, n in spans[:s]) for s in range(64)]
        sub_q = torch.cat([q[offsets[s] : offsets[s] + spans[s][1]] for s in order])
        out = run(sub_q, cache, [spans[s] for s in order], order)
        first = 0
        for s in order:
            n = spans[s][1]
            assert torch.equal(out[first : first + n], full[offsets[s] : offsets[s] + n]), (len(order), s)
            first += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_gives_the_same_rows_however_it_is_chunked(dtype: torch.dtype) -> None:
    length = 100
    cache = make_cache([length], 3, 64, 16, dtype, seed=3)
    q = torch.randn(length, 9, 64).to(dtype)
    whole = run(q, cache, [(0, length)], [0])
    for chunks in ([37, 63], [1] * length, [16, 5, 79]):
        rows, first = [], 0
        for n in chunks:
            rows.append(run(q[first : first + n], cache, [(first, n)], [0]))
            first += n
        assert torch.equal(torch.cat(rows), whole), chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_sliced_from_a_wider_projection_are_read_in_place(dtype: torch.dtype) -> None:
    """q as the decoder passes it: the first 9 heads of each token's 15 (q, k and v side by side),
    read through their token stride: the same bits as a contiguous copy, in a contiguous output."""
    spans = [(0, 23), (31, 1), (70, 1)]
    cache = make_cache([c + n for c, n in spans], 3, 64, 16, dtype, seed=4)
    qkv = torch.randn(sum(n for _, n in spans), 15, 64).to(dtype)
    q = qkv[:, :9]
    assert not q.is_contiguous()
    out = run(q, cache, spans, [0, 1, 2])
    assert out.is_contiguous() and out.shape == q.shape
    assert torch.equal(out, run(q.contiguous(), cache, spans, [0, 1, 2]))
    single = qkv[:1, :9]  # one token: its stride still that of the wider rows
    assert torch.equal(run(single, cache, [(70, 1)], [2]), run(single.contiguous(), cache, [(70, 1)], [2]))


def test_rejects_mismatched_dtypes() -> None:
    cache = make_cache([4], 1, 64, 4, torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        run(torch.randn(4, 1, 64, dtype=torch.bfloat16), cache, [(0, 4)], [0])
