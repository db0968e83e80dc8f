"""The Llama family as Hugging Face names it: Llama 1-3.x (rope scaling "llama3", "yarn",
"linear", "dynamic"), Mistral (a sliding window on every layer), Qwen2 (q/k/v biases), Qwen3
(QK-norm) and SmolLM2. Their checkpoints fit `DecoderModel` as they are."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loom_shard.model_config import ModelConfig
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, dense_mlp_shapes, hf_shapes


class LlamaModel(DecoderModel):
    """Hugging Face's Llama names: q/k/v and gate/up are fused at load (`fuse_hf_weights`)."""


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The family's switches from config.json, on top of the common fields in `base`."""
    arch = base.architecture
    if arch == "Qwen2ForCausalLM":
        return replace(base, attention_bias=True)  # Qwen2 always has q/k/v biases
    if arch == "Qwen3ForCausalLM":
        return replace(base, qk_norm=True, attention_bias=bool(raw.get("attention_bias", False)))
    return base


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    return hf_shapes(config, dense_mlp_shapes(config))
