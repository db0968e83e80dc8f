"""PagedKVCache: block moves and the block-size independent read/write layout."""

from __future__ import annotations

import pytest
import torch

from loom_shard.runtime.kv_cache import KVCacheSpec, PagedKVCache


def _cache(block_size: int, num_blocks: int = 8, num_host_blocks: int = 4) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=3, block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks, num_host_blocks, "cpu")
    cache.device_blocks.copy_(torch.randn_like(cache.device_blocks))
    return cache


def test_read_then_write_moves_tokens_between_block_sizes() -> None:
    small, big = _cache(block_size=2), _cache(block_size=4)
    kv = small.read_blocks([5, 1, 6], num_tokens=5)
    assert kv.shape == (2, 2, 5, 2, 3)
    torch.testing.assert_close(kv[:, :, 2:4], small.device_blocks[:, :, 1])
    big_before = big.device_blocks.clone()
    big.write_blocks([3, 0], kv)
    torch.testing.assert_close(big.read_blocks([3, 0], 5), kv)
    torch.testing.assert_close(big.device_blocks[:, :, 0, 1:], big_before[:, :, 0, 1:])  # past the tokens: untouched
    with pytest.raises(ValueError, match="do not fit"):
        big.write_blocks([3], kv)


def test_swap_round_trip_and_copy() -> None:
    cache = _cache(block_size=2)
    original = cache.device_blocks.clone()
    cache.swap_out([(1, 3), (4, 0)])
    cache.device_blocks.zero_()
    cache.swap_in([(0, 7), (3, 2)])
    torch.testing.assert_close(cache.device_blocks[:, :, 7], original[:, :, 4])
    torch.testing.assert_close(cache.device_blocks[:, :, 2], original[:, :, 1])
    cache.copy([(7, 5), (2, 7)])  # all reads happen before the writes
    torch.testing.assert_close(cache.device_blocks[:, :, 5], original[:, :, 4])
    torch.testing.assert_close(cache.device_blocks[:, :, 7], original[:, :, 1])


def test_bytes_per_block_matches_the_tensor() -> None:
    cache = _cache(block_size=4)
    assert cache.spec.bytes_per_block * cache.num_blocks == cache.device_blocks.numel() * 4
