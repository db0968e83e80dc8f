"""One pre-norm decoder layer, shared by every family: attention and a feed-forward (dense or
mixture-of-experts), each with a residual; Gemma's "sandwich" norms also normalise each one's output.

    plain:    x += attn(norm_in(x));              x += ffn(norm_post_attn(x))
    sandwich: x += norm_post_attn(attn(norm_in(x)));  x += norm_post_ffn(ffn(norm_pre_ffn(x)))

The norms keep their Hugging Face names, so "post_attention_layernorm" is the pre-MLP norm of a
plain layer and the attention output's norm of a sandwich one.
"""

from __future__ import annotations

import torch
from torch import nn

from loom_shard.attention.metadata import AttentionMetadata
from loom_shard.layers.attention import Attention
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.moe import MoE
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.rotary import Rope
from loom_shard.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        if config.is_moe_layer(layer):
            assert config.moe is not None
            self.mlp: nn.Module = MoE(hidden, config.moe)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, config.activation)
        # Gemma 3's sliding layers rotate with their own (local) rope.
        self.uses_local_rope = config.local_rope_theta is not None and self.self_attn.window is not None

    @property
    def is_plain(self) -> bool:
        """Llama's layer: plain attention, no extra norms, a SiLU gated MLP."""
        return self.self_attn.is_plain and not self.sandwich and type(self.mlp) is GatedMLP

    def forward(self, x: torch.Tensor, rope: Rope, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), rope, kv_layer, meta)
        if not self.sandwich:
            x, normed = self.post_attention_layernorm.add_forward(x, attended)
            return x + self.mlp(normed)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
