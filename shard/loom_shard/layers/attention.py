"""A decoder layer's self-attention: fused q/k/v projection, optional QK-norm, rotary, paged
attention (with the layer's window, softcap and sinks) and the output projection.

Head counts are read from the module, so tensor parallelism can shrink them afterwards.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loom_shard.attention.metadata import AttentionMetadata, AttentionSpec
from loom_shard.attention.torch_paged import paged_attention
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.rotary import Rope
from loom_shard.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        # A learnt logit per head joining each softmax (gpt-oss); split with the heads.
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        self.scale = config.attention_scale if config.attention_scale is not None else 1.0 / math.sqrt(config.head_dim)
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcap

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.scale, self.window, self.softcap, self.sinks)

    @property
    def is_plain(self) -> bool:
        """Llama's attention: no QK-norm, window, softcap, sinks or output bias, the usual scale."""
        return (not self.qk_norm and self.spec.is_plain_causal and self.o_proj.bias is None
                and self.scale == 1.0 / math.sqrt(self.head_dim))

    def forward(self, x: torch.Tensor, rope: Rope, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.num_heads])  # [num_tokens, heads, head_dim]
            k = self.k_norm(qkv[:, self.num_heads : num_qk_heads])  # [num_tokens, kv_heads, head_dim]
            qk = rope.apply(torch.cat([q, k], dim=1))
        else:
            qk = rope.apply(qkv[:, :num_qk_heads])  # [num_tokens, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, num_qk_heads:]
        return self.o_proj(paged_attention(q, k, v, kv_layer, meta, self.spec))
