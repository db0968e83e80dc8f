"""Configuration of the router process, built once by the launcher (or CLI) and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RouterConfig:
    model_id: str  # as the shards load it; the router reads the tokenizer from it
    shard_uds_paths: tuple[str, ...]  # one unix socket per shard rank
    hostname: str = "0.0.0.0"
    port: int = 3000
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: the model's context length
    max_batch_prefill_tokens: int = 2048
    max_batch_total_tokens: int | None = None  # None: what Warmup reports
    max_stop_sequences: int = 4
    max_n: int = 16
    max_top_n_tokens: int = 5
    snapshot_dir: str | None = None
    served_model_name: str | None = None  # OpenAI "model"; None: derived from model_id

    def __post_init__(self) -> None:
        if not self.shard_uds_paths:
            raise ValueError("at least one shard socket is needed")
        if self.max_concurrent_requests <= 0:
            raise ValueError("max_concurrent_requests must be positive")
        if self.max_batch_prefill_tokens <= 0:
            raise ValueError("max_batch_prefill_tokens must be positive")
        if (self.max_input_tokens is not None and self.max_total_tokens is not None
                and self.max_input_tokens >= self.max_total_tokens):
            raise ValueError(f"max_input_tokens ({self.max_input_tokens}) must be below "
                             f"max_total_tokens ({self.max_total_tokens})")
