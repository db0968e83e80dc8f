"""Whether a tensor's elementwise work (norms, SiLU·mul, rotary) goes to the Triton kernels of
`triton_elementwise`: CUDA tensors, where triton imports. Elsewhere the layers use Loom's CPU
kernels or torch's ops."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

ENABLED = True  # False: torch's ops on CUDA too (A/B benches)


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs(x: torch.Tensor) -> bool:
    """True when x's elementwise work runs in the Triton kernels."""
    return ENABLED and x.is_cuda and _triton_imports()


def ops() -> ModuleType:
    from loom_shard.layers import triton_elementwise

    return triton_elementwise
