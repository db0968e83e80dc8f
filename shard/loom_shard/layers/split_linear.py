"""A fused projection whose parts a GGUF quantizes in different kinds (llama.cpp's _M mixes give
some layers' v a finer format than their q and k): one QuantLinear per run of parts of one kind,
their outputs side by side, then the bias. Every part stays quantized instead of the whole
projection being dequantized."""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from loom_shard.layers.quant_linear import QuantLinear


class SplitLinear(nn.Module):
    """y = [part_0(x), part_1(x), ...] (+ bias), the parts bias-free; loom::decoder_layers runs a
    qkv projection of this kind part by part in the same order (project_qkv)."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        if any(p.bias is not None or p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a split projection's parts share their input and carry no bias")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def starts(self) -> list[int]:
        """The first output feature of each part."""
        return list(accumulate((part.out_features for part in self.parts[:-1]), initial=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
