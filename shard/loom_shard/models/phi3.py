"""Phi-3 and Phi-4 (Phi3ForCausalLM): q/k/v and gate/up stored fused, LongRoPE scaling, partial
rotary (Phi-4-mini rotates 3/4 of each head), a sliding window on every layer where configured."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loom_shard.model_config import ModelConfig
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, hf_shapes


class Phi3Model(DecoderModel):
    """The checkpoint's `qkv_proj` and `gate_up_proj` are this model's own (q, k, v and gate, up
    rows in that order)."""


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    factor = float(raw.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(base.head_dim * factor)
    return replace(base, rotary_dim=rotary_dim if rotary_dim != base.head_dim else None)


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    hidden, inter = config.hidden_size, config.intermediate_size

    def mlp(prefix: str, layer: int) -> Shapes:
        return {prefix + "mlp.gate_up_proj.weight": (2 * inter, hidden), prefix + "mlp.down_proj.weight": (hidden, inter)}

    return hf_shapes(config, mlp, fused_qkv=True)
