"""Loom's C++ paged-attention kernel on CPU (`kernels/csrc/attention.cpp`), the contract of
`loom_shard.attention.triton_paged`: prefill chunks and decodes of one step in one call, reading K/V
blocks in place through block tables. Every query row reduces over its visible keys (0..p, or its
sliding window) in 16-key chunks on a grid fixed from key 0, with a float32 online softmax, so its output is bit-identical whatever else
is in the batch and however its prompt was chunked.
"""

from __future__ import annotations

import torch

from loom_shard.attention.metadata import AttentionSpec, PagedTables
from loom_shard.kernels.attention import paged_attention


def paged_attention_cpu(q: torch.Tensor, kv_layer: torch.Tensor, tables: PagedTables, spec: AttentionSpec) -> torch.Tensor:
    """q [num_tokens, heads, head_dim], kv_layer [2, blocks, block_size, kv_heads, head_dim]
    -> [num_tokens, heads, head_dim], q's dtype."""
    return paged_attention(q, kv_layer, tables.block_tables, tables.query_starts, tables.num_cached, spec.scale,
                           spec.window, spec.softcap, spec.sinks)
