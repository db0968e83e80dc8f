"""Maps a checkpoint's architecture name to the model class that runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from loom_shard.model_config import ModelConfig
from loom_shard.models.llama import LlamaModel


@dataclass(slots=True, frozen=True)
class ModelEntry:
    model_class: type[LlamaModel]
    adapt_config: Callable[[ModelConfig], ModelConfig]  # the family's fixed choices


def _unchanged(config: ModelConfig) -> ModelConfig:
    return config


def _qwen2(config: ModelConfig) -> ModelConfig:
    return replace(config, attention_bias=True)  # Qwen2 always has q/k/v biases


_REGISTRY: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(LlamaModel, _unchanged),
    "MistralForCausalLM": ModelEntry(LlamaModel, _unchanged),
    "Qwen2ForCausalLM": ModelEntry(LlamaModel, _qwen2),
    "SmolLM2": ModelEntry(LlamaModel, _unchanged),
    "llama": ModelEntry(LlamaModel, _unchanged),  # GGUF general.architecture
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(config: ModelConfig) -> LlamaModel:
    """An uninitialised model for `config.architecture`. Raises ValueError when unsupported."""
    entry = _REGISTRY.get(config.architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {supported_architectures()}")
    return entry.model_class(entry.adapt_config(config))
