"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), GeGLU, norms around both
attention and MLP ("sandwich"), norm weights stored as w for a scale of 1 + w, sliding-window layers
interleaved with global ones (1:1 in Gemma 2, 5:1 in Gemma 3), logit softcapping (Gemma 2), QK-norm
and a local rope for the sliding layers (Gemma 3)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from loom_shard.model_config import Activation, LayerKind, ModelConfig
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, dense_mlp_shapes, fuse_hf_weights, hf_shapes

GEMMA2_PATTERN, GEMMA3_PATTERN = 2, 6  # every n-th layer is global when config.json gives no layer_types
# transformers' Gemma3TextConfig defaults: a multimodal Gemma 3's text_config leaves them out.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_local_base_freq": 10000.0, "tie_word_embeddings": True,
}


class GemmaModel(DecoderModel):
    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Llama's names; each RMSNorm's stored w becomes the scale 1 + w it applies (in float32,
        as transformers adds it, then rounded once to the weights' dtype)."""
        own = fuse_hf_weights(weights)
        for name, tensor in own.items():
            if name.endswith("norm.weight"):
                own[name] = (tensor.float() + 1.0).to(tensor.dtype)
        return own


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    gemma3 = base.architecture == "Gemma3ForCausalLM"
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                  or (GEMMA3_PATTERN if gemma3 else GEMMA2_PATTERN))
    kinds = base.layer_kinds or tuple(LayerKind.SLIDING if (i + 1) % pattern else LayerKind.FULL
                                      for i in range(base.num_layers))
    scalar = raw.get("query_pre_attn_scalar")
    config = replace(
        base,
        sandwich_norms=True,
        activation=Activation.GELU_TANH,  # Gemma's "gelu_pytorch_tanh" (older configs say "gelu" for it)
        embedding_multiplier=math.sqrt(base.hidden_size),
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attn_logit_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
        layer_kinds=kinds,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )
    if gemma3:
        config = replace(config, qk_norm=True, local_rope_theta=float(raw.get("rope_local_base_freq", 10000.0)))
    return config


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    return hf_shapes(config, dense_mlp_shapes(config))
