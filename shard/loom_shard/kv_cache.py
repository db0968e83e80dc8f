"""The shard's paged KV memory: one device tensor of blocks plus a host-RAM pool for swap.

    device: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
    host:   [num_layers, 2 (k, v), num_host_blocks, block_size, num_kv_heads, head_dim]

Block ids are the router's; this class only moves bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # heads held by this process
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


class PagedKVCache:
    """num_scratch_blocks extra device blocks follow the router's (ids num_blocks..): padding rows
    of a CUDA-graph batch write there, so they never touch a real sequence's KV."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, num_host_blocks: int, device: torch.device | str,
        num_scratch_blocks: int = 0,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.num_scratch_blocks = num_scratch_blocks
        shape = (spec.num_layers, 2, num_blocks + num_scratch_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.device_blocks = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        host_shape = (*shape[:2], num_host_blocks, *shape[3:])
        pin = self.device.type == "cuda"  # pinned pages make host<->device copies asynchronous-capable
        self.host_blocks = torch.zeros(host_shape, dtype=spec.dtype, pin_memory=pin)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_blocks(self) -> int:
        """Blocks the router may use (scratch blocks excluded)."""
        return self.device_blocks.shape[2] - self.num_scratch_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host_blocks.shape[2]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device_block, host_block)."""
        if pairs:
            src, dst = self._indices(pairs, self.device)
            self.host_blocks[:, :, dst.cpu()] = self.device_blocks[:, :, src].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host_block, device_block)."""
        if pairs:
            src, dst = self._indices(pairs, self.device)
            self.device_blocks[:, :, dst] = self.host_blocks[:, :, src.cpu()].to(self.device, non_blocking=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks: pairs of (src, dst), all read before any write."""
        if pairs:
            src, dst = self._indices(pairs, self.device)
            self.device_blocks[:, :, dst] = self.device_blocks[:, :, src]

    def read_blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The first num_tokens tokens held by block_ids, on the CPU:
        [num_layers, 2, num_tokens, num_kv_heads, head_dim] (independent of the block size)."""
        assert num_tokens <= len(block_ids) * self.block_size
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = self.device_blocks[:, :, ids].flatten(2, 3)  # [layers, 2, n_blocks * block_size, ...]
        return blocks[:, :, :num_tokens].cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write tokens laid out as `read_blocks` returns them into block_ids, in order."""
        num_tokens = kv.shape[2]
        expected = (*self.device_blocks.shape[:2], num_tokens, *self.device_blocks.shape[4:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv shape {tuple(kv.shape)} does not match {expected}")
        if num_tokens > len(block_ids) * self.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks")
        positions = torch.arange(num_tokens)
        table = torch.tensor(block_ids, dtype=torch.long)
        slots = (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(self.device)
        flat = self.device_blocks.flatten(2, 3)  # a view: [layers, 2, num_blocks * block_size, ...]
        flat[:, :, slots] = kv.to(device=self.device, dtype=self.spec.dtype)

    @staticmethod
    def _indices(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor(pairs, dtype=torch.long, device=device)
        return both[:, 0], both[:, 1]


# Shares of MemAvailable the pools take on a CPU shard when no size is configured:
# modest, because the weights, activations and other processes live in the same RAM.
CPU_POOL_SHARE = 0.10
HOST_POOL_SHARE = 0.05


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); 8 GiB assumed elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def blocks_for_bytes(pool_bytes: int, spec: KVCacheSpec) -> int:
    return max(pool_bytes // spec.bytes_per_block, 0)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
