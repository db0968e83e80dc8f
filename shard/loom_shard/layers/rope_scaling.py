"""Rotary frequencies for each rope scaling a config may ask for, as transformers computes them.

A position's angles are `position * inv_freq`, one table row per position: a token's rotation never
depends on the batch or on how long its sequence has grown, so cached keys stay valid. Where
transformers changes frequencies with the sequence's length, Loom fixes them: dynamic NTK grows its
base only for positions past the trained context (transformers' choice within it), and LongRoPE
uses its long factors everywhere when the model's context exceeds the trained one (vLLM's choice;
transformers' too for any sequence longer than the trained context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loom_shard.model_config import (
    DynamicScaling,
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    RopeScaling,
    YarnScaling,
)


@dataclass(slots=True, frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor  # float64 [rotary_dim // 2]
    attention_factor: float = 1.0  # cos and sin are multiplied by it (YaRN, LongRoPE)
    long_inv_freq: torch.Tensor | None = None  # used from position `switch_position` on (dynamic NTK)
    switch_position: int | None = None

    def angles(self, length: int) -> torch.Tensor:
        """float32 [length, rotary_dim // 2]: each position's rotation angles, a float32 product of
        the position and the float32 frequency as transformers computes them."""
        positions = torch.arange(length, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.float())
        if self.long_inv_freq is not None and self.switch_position is not None and length > self.switch_position:
            angles[self.switch_position :] = torch.outer(positions[self.switch_position :], self.long_inv_freq.float())
        return angles


def base_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def rope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> RopeFrequencies:
    inv_freq = base_frequencies(rotary_dim, theta)
    if scaling is None:
        return RopeFrequencies(inv_freq)
    if isinstance(scaling, Llama3Scaling):
        return RopeFrequencies(_llama3(inv_freq, scaling))
    if isinstance(scaling, LinearScaling):
        return RopeFrequencies(inv_freq / scaling.factor)
    if isinstance(scaling, DynamicScaling):
        return _dynamic(rotary_dim, theta, inv_freq, scaling)
    if isinstance(scaling, YarnScaling):
        return _yarn(rotary_dim, theta, scaling)
    assert isinstance(scaling, LongRopeScaling)
    return _longrope(rotary_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
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


def _dynamic(rotary_dim: int, theta: float, inv_freq: torch.Tensor, s: DynamicScaling) -> RopeFrequencies:
    # Past the trained context the base grows as for a sequence of factor x that length (vLLM's
    # fixed choice); within it the frequencies are the plain ones, as transformers computes them.
    grown = theta * (s.factor * s.factor - (s.factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return RopeFrequencies(inv_freq, 1.0, base_frequencies(rotary_dim, grown), s.original_max_position_embeddings)


def _yarn(rotary_dim: int, theta: float, s: YarnScaling) -> RopeFrequencies:
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    low, high = _correction_range(s.beta_fast, s.beta_slow, rotary_dim, theta, s.original_max_position_embeddings,
                                  s.truncate)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = base_frequencies(rotary_dim, theta)
    interpolation = extrapolation / s.factor
    keep = 1 - ramp  # share of the unscaled frequency
    return RopeFrequencies(interpolation * (1 - keep) + extrapolation * keep, attention_factor)


def _correction_range(low_rot: float, high_rot: float, dim: int, base: float, original: int,
                      truncate: bool) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(low_rot), correction_dim(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope(rotary_dim: int, theta: float, s: LongRopeScaling) -> RopeFrequencies:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    factors = s.long_factor if s.uses_long_factors else s.short_factor
    return RopeFrequencies(1.0 / (torch.tensor(factors, dtype=torch.float64) * theta**exponents), s.attention_factor)
