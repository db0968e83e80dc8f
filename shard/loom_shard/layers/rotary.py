"""Rotary position embedding (half-split layout), with optional Llama-3 frequency scaling.

`lookup` prepares one step's rotary inputs, shared by all layers; `apply` rotates q and k.
On CPU with Loom's kernels built, one kernel per layer reads each token's row of a float32
cos/sin table itself (`kernels/csrc/rotary.cpp`); otherwise cos/sin rows are gathered once per
step and each layer runs torch's roll + mul + addcmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float64 for an exact cache."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(slots=True, frozen=True)
class GatheredRope:
    """The torch path: cos and signed sin gathered for each token of the step."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor  # [num_tokens, 1, head_dim], first half negated

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos, self.signed_sin)


@dataclass(slots=True, frozen=True)
class KernelRope:
    """The CPU kernel's inputs: it reads each token's table row itself (no gather)."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # [table_len, head_dim // 2] float32
    sin: torch.Tensor  # [table_len, head_dim // 2] float32

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.ops().rotary(x, self.positions, self.cos, self.sin)


Rope = GatheredRope | KernelRope


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables that grow on demand; `lookup` gives one step's rotary inputs."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, initial_len: int = 4096) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling).float(), persistent=False)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._half_cos = torch.empty(0)  # float32 [length, head_dim // 2], the kernel's tables
        self._half_sin = torch.empty(0)
        self._initial_len = initial_len
        self.use_kernel = True  # False: the torch path even where the kernel is built (A/B benches)

    def _freqs(self, length: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(length, dtype=torch.float32, device=device)
        return torch.outer(positions, self.inv_freq.to(device))  # [length, head_dim // 2]

    def _build(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        freqs = self._freqs(length, device)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(dtype)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin
        sin = emb.sin()
        half = self.head_dim // 2
        self._sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)

    def _build_half(self, length: int) -> None:
        freqs = self._freqs(length, torch.device("cpu"))
        self._half_cos, self._half_sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def lookup(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> Rope:
        """One step's rotary inputs for `positions` [num_tokens], shared by every layer.

        max_position (known on the host) sizes the table without a device sync.
        """
        needed = max_position + 1
        if self.use_kernel and positions.is_cpu and dtype in kernels.DTYPES and kernels.available():
            if self._half_cos.shape[0] < needed:
                self._build_half(max(needed, self._initial_len, 2 * self._half_cos.shape[0]))
            return KernelRope(positions.long(), self._half_cos, self._half_sin)
        if self._cos.shape[0] < needed or self._cos.dtype != dtype or self._cos.device != positions.device:
            self._build(max(needed, self._initial_len, 2 * self._cos.shape[0]), dtype, positions.device)
        return GatheredRope(self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> same shape, rotated."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rotated, signed_sin)
