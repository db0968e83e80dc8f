"""Gated feed-forward block (SwiGLU, or GeGLU for Gemma) with gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom_shard.layers import elementwise
from loom_shard.model_config import Activation


def gated(gate_up: torch.Tensor, intermediate: int, activation: Activation) -> torch.Tensor:
    """[rows, 2 * intermediate] (gate, then up) -> act(gate) * up: SiLU's in one pass of Loom's
    CPU kernel or of a Triton kernel on CUDA, else torch's ops (in place on gate's result)."""
    ops = elementwise.kernels_for(gate_up) if activation is Activation.SILU else None
    if ops is not None:
        return ops.silu_mul(gate_up, intermediate)
    gate, up = gate_up.split(intermediate, dim=-1)
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
        return self.down_proj(gated(gate_up, self.intermediate_size, self.activation))
