"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (QK-norm) with a mixture of experts (softmax
over the router's logits, top k, renormalised when norm_topk_prob), dense MLPs in mlp_only_layers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loom_shard.model_config import ModelConfig, MoEConfig
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, dense_mlp_shapes, fuse_hf_weights, hf_shapes, stack_experts


class Qwen3MoeModel(DecoderModel):
    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """mlp.gate stays; experts.<e>.gate_proj, up_proj, down_proj stacked; dense layers as Llama's."""
        moe = self.config.moe
        assert moe is not None
        experts = stack_experts(weights, self.config.num_layers, moe.num_experts, self.held_experts(),
                                self.expert_names)
        return {**fuse_hf_weights(weights), **experts}


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    num_layers, step = base.num_layers, int(raw.get("decoder_sparse_step") or 1)
    only_dense = {int(i) for i in raw.get("mlp_only_layers") or []}
    dense = frozenset(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
    moe = MoEConfig(num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    intermediate_size=int(raw["moe_intermediate_size"]),
                    renormalize=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
    return replace(base, qk_norm=True, attention_bias=bool(raw.get("attention_bias", False)), moe=moe)


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    moe = config.moe
    assert moe is not None
    hidden, inter = config.hidden_size, moe.intermediate_size
    dense = dense_mlp_shapes(config)

    def mlp(prefix: str, layer: int) -> Shapes:
        if not config.is_moe_layer(layer):
            return dense(prefix, layer)
        shapes: Shapes = {prefix + "mlp.gate.weight": (moe.num_experts, hidden)}
        for e in range(moe.num_experts):
            p = f"{prefix}mlp.experts.{e}."
            shapes.update({p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
                           p + "down_proj.weight": (hidden, inter)})
        return shapes

    return hf_shapes(config, mlp)
