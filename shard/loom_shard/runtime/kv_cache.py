"""The shard's paged KV memory: one device tensor of blocks plus a host-RAM pool for swap.

    device: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
    host:   [num_host_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]
            (block-major: each host block is one contiguous run of pinned memory, so a swap is
            one asynchronous copy per block on the cache's own CUDA stream)

Block ids are the router's; this class only moves bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom_proto.cgroup import memory_headroom


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
        host_shape = (num_host_blocks, *shape[:2], *shape[3:])
        cuda = self.device.type == "cuda"  # pinned pages make host<->device copies asynchronous
        self.host_blocks = torch.zeros(host_shape, dtype=spec.dtype, pin_memory=cuda)
        self.swap_stream = torch.cuda.Stream(self.device) if cuda else None

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
        return self.host_blocks.shape[0]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device_block, host_block).

        CUDA: the blocks are gathered on the compute stream (so later writes cannot race
        them), then copied to pinned memory on the swap stream while compute goes on.
        """
        if not pairs:
            return
        src, _ = self._indices(pairs, self.device)
        staged = self.device_blocks[:, :, src].permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, layers, 2, ...]
        if self.swap_stream is None:
            self.host_blocks[[h for _, h in pairs]] = staged
            return
        self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.swap_stream):
            for i, (_, host) in enumerate(pairs):
                self.host_blocks[host].copy_(staged[i], non_blocking=True)
        staged.record_stream(self.swap_stream)  # keep its memory until the copies are done

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host_block, device_block).

        CUDA: pinned-to-device copies on the swap stream; the compute stream waits for them
        on the GPU (no host sync) before scattering the blocks into place.
        """
        if not pairs:
            return
        _, dst = self._indices(pairs, self.device)
        if self.swap_stream is None:
            staged = self.host_blocks[[h for h, _ in pairs]]
        else:
            staged = torch.empty((len(pairs), *self.host_blocks.shape[1:]), dtype=self.spec.dtype, device=self.device)
            self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # staged's memory is ours
            with torch.cuda.stream(self.swap_stream):
                for i, (host, _) in enumerate(pairs):
                    staged[i].copy_(self.host_blocks[host], non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self.swap_stream)
        self.device_blocks[:, :, dst] = staged.permute(1, 2, 0, 3, 4, 5)

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
    """MemAvailable from /proc/meminfo (Linux; 8 GiB assumed elsewhere), capped by what the
    process's cgroups still allow (a container's limit, which /proc/meminfo does not show)."""
    available = 8 * 2**30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    headroom = memory_headroom()
    return available if headroom is None else min(available, headroom)


def blocks_for_bytes(pool_bytes: int, spec: KVCacheSpec) -> int:
    return max(pool_bytes // spec.bytes_per_block, 0)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
