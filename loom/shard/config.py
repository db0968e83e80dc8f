"""Configuration of one shard process, built once by the launcher (or CLI) and passed down."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True, frozen=True)
class ShardConfig:
    model_id: str  # a GGUF file, a Hugging Face folder, or "" for the embedded default
    uds_path: str  # unix socket this shard serves on
    dtype: str | None = None  # None: the fastest dtype that passes parity on the device
    device: str = "cpu"  # "cpu" or "cuda"; a rank uses cuda:<rank>
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    block_size: int = 16
    max_batch_total_tokens: int | None = None  # None: size the KV pool from free memory
    memory_fraction: float = 0.9  # share of free device memory the KV pool may take (CUDA)
    cpu_kv_cache_bytes: int | None = None  # KV pool size on CPU; None: a share of free RAM
    host_kv_cache_bytes: int | None = None  # host swap pool; None: a share of free RAM
    snapshot_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
