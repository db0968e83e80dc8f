"""Random paged-attention cases and a float64 reference, shared by the CUDA tests and the
Triton-interpreter check (`TRITON_INTERPRET=1` runs the kernel on the CPU)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loom_shard.attention.metadata import SeqSpan


@dataclass(slots=True)
class PagedCase:
    q: torch.Tensor  # [num_tokens, heads, head_dim]
    kv_layer: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim], every span's keys written
    spans: list[SeqSpan]
    block_size: int


def make_case(seed: int, device: str, dtype: torch.dtype, query_lens: list[int], cached: list[int],
              heads: int = 6, kv_heads: int = 2, head_dim: int = 64, block_size: int = 16) -> PagedCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in zip(cached, query_lens)]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # scattered, non-monotonic block tables
    spans, taken = [], 0
    for c, n, b in zip(cached, query_lens, needed):
        spans.append(SeqSpan(c, n, ids[taken : taken + b]))
        taken += b
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    return PagedCase(q.to(device, dtype), kv.to(device, dtype), spans, block_size)


def reference(case: PagedCase) -> torch.Tensor:
    """Causal attention per sequence over its gathered context, in float64 on the CPU."""
    q, kv, bs = case.q.double().cpu(), case.kv_layer.double().cpu(), case.block_size
    heads, kv_heads = q.shape[1], kv.shape[3]
    out, start = [], 0
    for s in case.spans:
        context = s.num_cached + s.num_compute
        slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(context)], dtype=torch.long)
        k = kv[0].flatten(0, 1)[slots].repeat_interleave(heads // kv_heads, dim=1)  # [context, heads, hd]
        v = kv[1].flatten(0, 1)[slots].repeat_interleave(heads // kv_heads, dim=1)
        query = q[start : start + s.num_compute]
        scores = torch.einsum("thd,khd->htk", query, k) * q.shape[-1] ** -0.5
        query_pos = torch.arange(s.num_cached, context).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(context).unsqueeze(0) > query_pos, float("-inf"))
        out.append(torch.einsum("htk,khd->thd", scores.softmax(-1), v))
        start += s.num_compute
    return torch.cat(out)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    assert not out.isnan().any()
    return float((out - ref).norm() / ref.norm())
