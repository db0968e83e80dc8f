"""Gated feed-forward block (SwiGLU, or GeGLU for Gemma) with gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom_shard.model_config import Activation


def gated(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """act(gate) * up, in place on gate's result."""
    if activation is Activation.SILU:
        return F.silu(gate).mul_(up)
    return F.gelu(gate, approximate="tanh").mul_(up)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: Activation = Activation.SILU) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(gated(gate, up, self.activation))
