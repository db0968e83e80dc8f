"""RMS normalisation, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Low precision: normalise in float32, round, then scale (as transformers does).
        normed = torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return normed * self.weight
