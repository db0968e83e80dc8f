"""Mixtral (MixtralForCausalLM): Mistral's attention with a mixture of experts in every layer
(softmax over the router's logits, the top k kept and renormalised)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loom_shard.model_config import ModelConfig, MoEConfig
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, fuse_hf_weights, hf_shapes, stack_experts


class MixtralModel(DecoderModel):
    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"  # gate, up, down

    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """block_sparse_moe.gate -> mlp.gate; experts.<e>.w1 (gate), w3 (up), w2 (down) stacked."""
        moe = self.config.moe
        assert moe is not None
        experts = stack_experts(weights, self.config.num_layers, moe.num_experts, self.held_experts(),
                                self.expert_names)
        renamed = {n.replace(".block_sparse_moe.gate.", ".mlp.gate."): t for n, t in weights.items()}
        return {**fuse_hf_weights(renamed), **experts}


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    moe = MoEConfig(num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    intermediate_size=base.intermediate_size)
    return replace(base, moe=moe)


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    assert config.moe is not None
    hidden, inter, num_experts = config.hidden_size, config.moe.intermediate_size, config.moe.num_experts

    def mlp(prefix: str, layer: int) -> Shapes:
        shapes: Shapes = {prefix + "block_sparse_moe.gate.weight": (num_experts, hidden)}
        for e in range(num_experts):
            p = f"{prefix}block_sparse_moe.experts.{e}."
            shapes.update({p + "w1.weight": (inter, hidden), p + "w3.weight": (inter, hidden),
                           p + "w2.weight": (hidden, inter)})
        return shapes

    return hf_shapes(config, mlp)
