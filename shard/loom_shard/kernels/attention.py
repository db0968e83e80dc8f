"""Typed entry to the C++ paged-attention kernel (`csrc/attention.cpp`).

Same contract as `loom_shard.attention.triton_paged.paged_attention_triton`: prefill chunks and
decodes of one step in a single call, K/V read in place through block tables. A row's output
is bit-identical whatever else is in the batch and however its prompt was chunked.
"""

from __future__ import annotations

import math

import torch

from loom_shard import kernels


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (bfloat16 or float32, kv_layer's dtype);
    kv_layer: [2, num_blocks, block_size, kv_heads, head_dim], contiguous;
    block_tables: [num_seqs, max_blocks] int32; query_starts: [num_seqs + 1] int32;
    num_cached: [num_seqs] int32 (keys before each sequence's first query);
    scale: the scores' factor (None: 1 / sqrt(head_dim)); window: keys a query sees (itself included), None for all;
    softcap: scores become softcap * tanh(score / softcap); sinks: [num_heads] logits that join
    each softmax. Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return kernels.ops().paged_attention(q, kv_layer, block_tables, query_starts, num_cached, scale, window or 0,
                                         softcap or 0.0, sinks)
