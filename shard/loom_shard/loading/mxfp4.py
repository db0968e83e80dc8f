"""MXFP4 (the OCP microscaling format: blocks of 32 FP4 e2m1 values sharing one power-of-two
scale), as gpt-oss checkpoints store their experts: dequantized at load into the layout of the
checkpoint's unquantized tensors."""

from __future__ import annotations

import torch

# e2m1: sign, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [experts, rows, groups, 16] (two values a byte, the low nibble first),
    scales uint8 [experts, rows, groups] (exponents, biased by 127) -> float32
    [experts, groups * 32, rows]: each expert's matrix transposed, as the unquantized checkpoint
    holds it (gpt-oss's gate_up_proj [experts, hidden, 2 x intermediate], down_proj
    [experts, intermediate, hidden])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., groups, 16, 2]
    values = values.flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS)
    return values.flatten(-2).transpose(1, 2).contiguous()
