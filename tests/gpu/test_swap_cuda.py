"""Swaps on CUDA: pinned, block-major host pool and copies on the cache's own stream, yet a
block overwritten right after its swap-out still comes back as it was."""

from __future__ import annotations

import torch

from loom_shard.runtime.kv_cache import KVCacheSpec, PagedKVCache


def test_swap_round_trip_survives_immediate_overwrite() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks=8, num_host_blocks=4, device="cuda")
    assert cache.host_blocks.is_pinned() and cache.swap_stream is not None
    cache.device_blocks.copy_(torch.randn_like(cache.device_blocks, dtype=torch.float32))
    before = cache.device_blocks.clone()
    cache.swap_out([(1, 3), (4, 0)])
    cache.device_blocks[:, :, [1, 4]] = 0  # the next step reuses the blocks at once
    cache.swap_in([(3, 6), (0, 7)])
    torch.testing.assert_close(cache.device_blocks[:, :, 6], before[:, :, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache.device_blocks[:, :, 7], before[:, :, 4], rtol=0, atol=0)
    torch.testing.assert_close(cache.device_blocks[:, :, :4], torch.cat([before[:, :, :1], torch.zeros_like(before[:, :, 1:2]), before[:, :, 2:4]], dim=2), rtol=0, atol=0)
