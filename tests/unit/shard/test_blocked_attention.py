"""blocked_causal_attention against torch's SDPA (float32 reference), across tiles and cached prefixes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom_shard.attention.torch_paged import blocked_causal_attention, sdpa_causal_attention


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_cached: int) -> torch.Tensor:
    chunk_len = query.shape[0]
    visible = torch.arange(num_cached + chunk_len).unsqueeze(0) <= torch.arange(num_cached, num_cached + chunk_len).unsqueeze(1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key, value, attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("chunk_len, num_cached, tile_rows", [(7, 0, 512), (37, 0, 8), (20, 13, 6), (1, 9, 4), (30, 5, 1)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (4, 4)])
def test_matches_sdpa_in_float32(chunk_len: int, num_cached: int, tile_rows: int, num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(chunk_len * 100 + num_cached)
    context = num_cached + chunk_len
    query = torch.randn(chunk_len, num_heads, 16, generator=gen)
    key = torch.randn(num_kv_heads, context, 16, generator=gen)
    value = torch.randn(num_kv_heads, context, 16, generator=gen)
    out = blocked_causal_attention(query, key, value, num_cached, tile_rows=tile_rows)
    torch.testing.assert_close(out, _reference(query, key, value, num_cached), rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_near_the_float32_result() -> None:
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=gen) for shape in ((40, 6, 32), (2, 50, 32), (2, 50, 32)))
    out = blocked_causal_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), 10, tile_rows=24)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(query, key, value, 10), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("chunk_len, num_cached", [(9, 0), (5, 7), (1, 12)])
def test_cuda_sdpa_path_agrees_with_the_blocked_one(chunk_len: int, num_cached: int) -> None:
    # The CUDA prefill path, run here on CPU tensors: same contract, same numbers.
    torch.manual_seed(1)
    query = torch.randn(chunk_len, 4, 16)
    key, value = torch.randn(2, 2, num_cached + chunk_len, 16)
    torch.testing.assert_close(sdpa_causal_attention(query, key, value),
                               blocked_causal_attention(query, key, value, num_cached), rtol=1e-5, atol=1e-6)
