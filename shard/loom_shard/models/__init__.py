"""Model implementations and the registry that picks one per architecture."""

from loom_shard.models.registry import build_model, supported_architectures

__all__ = ["build_model", "supported_architectures"]
