"""Rotary position embedding (half-split layout) with every scaling of `rope_scaling`, over all of
each head or its first `rotary_dim` dims (partial rotary: the rest passes through).

`lookup` prepares one step's rotary inputs, shared by all layers; `apply` rotates q and k.
On CPU with Loom's kernels built (`kernels/csrc/rotary.cpp`) and on CUDA with triton
(`triton_elementwise`), one kernel per layer reads each token's row of a float32 cos/sin table
itself; otherwise cos/sin rows are gathered once per step and each layer runs torch's roll + mul +
addcmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom_shard.layers import elementwise
from loom_shard.layers.rope_scaling import rope_frequencies
from loom_shard.model_config import RopeScaling


@dataclass(slots=True, frozen=True)
class GatheredRope:
    """The torch path: cos and signed sin gathered for each token of the step."""

    cos: torch.Tensor  # [num_tokens, 1, rotary_dim]
    signed_sin: torch.Tensor  # [num_tokens, 1, rotary_dim], first half negated

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        rotary_dim = self.cos.shape[-1]
        if rotary_dim == x.shape[-1]:
            return apply_rotary(x, self.cos, self.signed_sin)
        rotated = apply_rotary(x[..., :rotary_dim], self.cos, self.signed_sin)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


@dataclass(slots=True, frozen=True)
class KernelRope:
    """A kernel's inputs (Loom's CPU kernel, or Triton's on CUDA): it reads each token's table row
    itself (no gather)."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # [table_len, rotary_dim // 2] float32
    sin: torch.Tensor  # [table_len, rotary_dim // 2] float32

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        ops = elementwise.kernels_for(x)
        assert ops is not None, "KernelRope on a device and dtype no kernels run"
        return ops.rotary(x, self.positions, self.cos, self.sin)


Rope = GatheredRope | KernelRope


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables that grow on demand; `lookup` gives one step's rotary inputs."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, initial_len: int = 4096,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.frequencies = rope_frequencies(self.rotary_dim, theta, scaling)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._half_cos = torch.empty(0)  # float32 [length, rotary_dim // 2], the kernel's tables
        self._half_sin = torch.empty(0)
        self._initial_len = initial_len
        self.use_kernel = True  # False: the torch path even where the kernel is built (A/B benches)

    def _half_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [length, rotary_dim // 2], attention factor included."""
        angles = self.frequencies.angles(length)
        factor = self.frequencies.attention_factor
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.contiguous(), sin.contiguous()

    def _build(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        cos, sin = self._half_tables(length)
        self._cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin
        self._sin = torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype)

    def _build_half(self, length: int, device: torch.device) -> None:
        cos, sin = self._half_tables(length)
        self._half_cos, self._half_sin = cos.to(device), sin.to(device)

    def lookup(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> Rope:
        """One step's rotary inputs for `positions` [num_tokens], shared by every layer.

        max_position (known on the host) sizes the table without a device sync.
        """
        needed = max_position + 1
        if self.use_kernel and elementwise.kernels_for(positions, dtype) is not None:
            if self._half_cos.shape[0] < needed or self._half_cos.device != positions.device:
                self._build_half(max(needed, self._initial_len, 2 * self._half_cos.shape[0]), positions.device)
            return KernelRope(positions.long(), self._half_cos, self._half_sin)
        if self._cos.shape[0] < needed or self._cos.dtype != dtype or self._cos.device != positions.device:
            self._build(max(needed, self._initial_len, 2 * self._cos.shape[0]), dtype, positions.device)
        return GatheredRope(self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> same shape, rotated."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rotated, signed_sin)
