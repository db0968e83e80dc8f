"""RMS normalisation: Loom's CPU kernel where it is built, a Triton kernel on CUDA, else torch's
fused op.

Both accumulate in float32 for low-precision inputs. In bfloat16 they round once where
transformers rounds twice (normalised x, then x * weight), which only makes them closer to
float32. The CPU kernel is one pass per row (4x faster than torch.rms_norm for a decode row)
and its reduction order does not depend on the batch (`loom_shard.kernels`).
"""

from __future__ import annotations

import torch
from torch import nn

from loom_shard.layers import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = elementwise.kernels_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): one pass over each row with the CPU kernel (the same values)
        or the Triton kernel."""
        ops = elementwise.kernels_for(x)
        if ops is not None and residual.dtype == x.dtype:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return x, self(x)
