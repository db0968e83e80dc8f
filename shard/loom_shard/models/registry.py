"""Maps a checkpoint's architecture name to its family: the model class that runs it, how its
config.json turns into a ModelConfig, and the tensors its checkpoint holds.

A multimodal checkpoint whose text model is listed here is served as that text model alone
(`TEXT_PARTS`: Gemma 3's 4B-27B releases); images are not supported. An architecture not listed
is refused at start in one line naming it and the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from loom_shard.model_config import ModelConfig
from loom_shard.models import gemma, gpt_oss, llama, mixtral, phi3, qwen3_moe
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes


@dataclass(slots=True, frozen=True)
class Family:
    model_class: type[DecoderModel]
    config_from_hf: Callable[[dict[str, Any], ModelConfig], ModelConfig]  # its switches from config.json
    checkpoint_shapes: Callable[[ModelConfig], Shapes]  # Hugging Face tensor names and shapes

    @staticmethod
    def of(module: ModuleType, model_class: type[DecoderModel]) -> Family:
        return Family(model_class, module.config_from_hf, module.checkpoint_shapes)


_LLAMA = Family.of(llama, llama.LlamaModel)
_GEMMA = Family.of(gemma, gemma.GemmaModel)
_REGISTRY: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "Phi3ForCausalLM": Family.of(phi3, phi3.Phi3Model),
    "MixtralForCausalLM": Family.of(mixtral, mixtral.MixtralModel),
    "Qwen3MoeForCausalLM": Family.of(qwen3_moe, qwen3_moe.Qwen3MoeModel),
    "GptOssForCausalLM": Family.of(gpt_oss, gpt_oss.GptOssModel),
}




@dataclass(slots=True, frozen=True)
class TextPart:
    """The text model of a multimodal checkpoint: its architecture, and the defaults of its
    text_config (config.json lists only what differs from them)."""

    architecture: str
    defaults: dict[str, Any]


TEXT_PARTS: dict[str, TextPart] = {
    "Gemma3ForConditionalGeneration": TextPart("Gemma3ForCausalLM", gemma.GEMMA3_TEXT_DEFAULTS),
}


def supported_architectures() -> list[str]:
    return sorted([*_REGISTRY, *TEXT_PARTS])


def unsupported_message(architecture: str) -> str:
    """The one line that refuses an architecture: its name and the known ones."""
    return f"unsupported architecture {architecture}; supported: {', '.join(supported_architectures())}"


def family(architecture: str) -> Family:
    """The family of `architecture`. Raises ValueError (`unsupported_message`) when unknown."""
    entry = _REGISTRY.get(architecture)
    if entry is None:
        raise ValueError(unsupported_message(architecture))
    return entry


def build_model(config: ModelConfig) -> DecoderModel:
    """An uninitialised model for `config.architecture`. Raises ValueError when unsupported."""
    return family(config.architecture).model_class(config)
