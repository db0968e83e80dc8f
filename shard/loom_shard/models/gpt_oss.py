"""gpt-oss (GptOssForCausalLM): attention with q/k/v/o biases and a sink logit per head,
sliding-window layers alternating with global ones, YaRN rope, and a mixture of experts whose router
has a bias, keeps the top k logits before its softmax, and whose experts (with biases) use a clamped
SwiGLU. The checkpoint stacks the experts, gate and up interleaved column by column."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loom_shard.model_config import ExpertActivation, ModelConfig, MoEConfig, Routing
from loom_shard.models.decoder import DecoderModel
from loom_shard.models.weights import Shapes, fuse_hf_weights, hf_shapes


class GptOssModel(DecoderModel):
    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """mlp.router -> mlp.gate; experts' gate_up_proj [experts, hidden, 2 x inter] (gate, up
        interleaved) -> w13 [experts, 2 x inter, hidden] (gate rows, then up rows); down_proj
        [experts, inter, hidden] -> w2 [experts, hidden, inter]; biases alike."""
        own: dict[str, torch.Tensor] = {}
        for name in [n for n in weights if ".mlp.experts." in n]:
            tensor = weights.pop(name)
            prefix, _, kind = name.removeprefix("model.").rpartition(".")
            if kind == "gate_up_proj":
                own[f"{prefix}.w13"] = torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1).transpose(1, 2)
            elif kind == "gate_up_proj_bias":
                own[f"{prefix}.b13"] = torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1)
            elif kind == "down_proj":
                own[f"{prefix}.w2"] = tensor.transpose(1, 2)
            else:
                own[f"{prefix}.b2"] = tensor
        renamed = {n.replace(".mlp.router.", ".mlp.gate."): t for n, t in weights.items()}
        return {**fuse_hf_weights(renamed), **{n: t.contiguous() for n, t in own.items()}}


def config_from_hf(raw: dict[str, Any], base: ModelConfig) -> ModelConfig:
    moe = MoEConfig(num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    intermediate_size=base.intermediate_size, routing=Routing.TOPK_SOFTMAX, router_bias=True,
                    expert_bias=True, activation=ExpertActivation.CLAMPED_SWIGLU)
    bias = bool(raw.get("attention_bias", True))
    return replace(base, attention_bias=bias, o_proj_bias=bias, attention_sinks=True, moe=moe)


def checkpoint_shapes(config: ModelConfig) -> Shapes:
    moe = config.moe
    assert moe is not None
    hidden, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts

    def mlp(prefix: str, layer: int) -> Shapes:
        p = prefix + "mlp."
        return {p + "router.weight": (num_experts, hidden), p + "router.bias": (num_experts,),
                p + "experts.gate_up_proj": (num_experts, hidden, 2 * inter),
                p + "experts.gate_up_proj_bias": (num_experts, 2 * inter),
                p + "experts.down_proj": (num_experts, inter, hidden), p + "experts.down_proj_bias": (num_experts, hidden)}

    return hf_shapes(config, mlp)
