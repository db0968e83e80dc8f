"""Model implementations (one file per family, on the shared decoder) and the registry that picks one
per architecture."""

from loom_shard.models.registry import (
    TEXT_PARTS,
    TextPart,
    build_model,
    family,
    supported_architectures,
    unsupported_message,
)

__all__ = ["TEXT_PARTS", "TextPart", "build_model", "family", "supported_architectures", "unsupported_message"]
