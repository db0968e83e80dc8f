"""Which kernels do a tensor's elementwise work (RMSNorm alone or with the residual add before it,
SiLU·mul, rotary): Loom's C++ kernels (`loom_shard.kernels`) for CPU tensors of their dtypes where
a build is loaded, the Triton kernels (`triton_elementwise`) for CUDA tensors where triton imports,
else none, and the layers use torch's ops. Both modules offer these functions with the same
signatures: rms_norm, add_rms_norm, silu_mul, rotary."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from loom_shard import kernels

TRITON = True  # False: torch's ops on CUDA too (A/B benches)


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_for(x: torch.Tensor, dtype: torch.dtype | None = None) -> ModuleType | None:
    """The kernels for x (or for tensors of `dtype` on x's device), or None: torch's ops."""
    if x.is_cpu:
        return kernels if (dtype or x.dtype) in kernels.DTYPES and kernels.available() else None
    if x.is_cuda and TRITON and _triton_imports():
        from loom_shard.layers import triton_elementwise

        return triton_elementwise
    return None
