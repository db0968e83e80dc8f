"""Which kernels do a tensor's elementwise work (RMSNorm alone or with the residual add before it,
SiLU·mul, rotary, the sampler's greedy log-softmax terms): Loom's C++ kernels (`loom_shard.kernels`)
for CPU tensors of their dtypes where a build is loaded, the Triton kernels (`triton_elementwise`)
for CUDA tensors where triton imports, else none, and the layers use torch's ops. Both modules offer
these functions with the same signatures: rms_norm, add_rms_norm, silu_mul, rotary, greedy_logprob_terms."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from loom_shard import kernels

log = logging.getLogger(__name__)

TRITON = True  # False: torch's ops on CUDA too (A/B benches)


@functools.cache
def _triton_kernels(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The Triton kernels where triton imports and they pass their self-check on this device in
    this dtype (once per process), else None with one log line: torch's ops run the model rather
    than a kernel this Triton or GPU cannot compile failing its warmup."""
    try:
        from loom_shard.layers import triton_elementwise
    except ImportError:
        return None
    try:
        triton_elementwise.self_check(device, dtype)
    except Exception as error:  # a compile error is any exception type Triton raises
        log.warning("Triton elementwise kernels failed their check on %s in %s (%s); torch's ops run "
                    "the norms, SiLU·mul and rotary instead", device, dtype, f"{type(error).__name__}: {error}"[:500])
        return None
    log.info("Triton elementwise kernels on %s in %s: checked against torch's ops", device, dtype)
    return triton_elementwise


def kernels_for(x: torch.Tensor, dtype: torch.dtype | None = None) -> ModuleType | None:
    """The kernels for x (or for tensors of `dtype` on x's device), or None: torch's ops."""
    if x.is_cpu:
        return kernels if (dtype or x.dtype) in kernels.DTYPES and kernels.available() else None
    if x.is_cuda and TRITON:
        return _triton_kernels(x.device, dtype or x.dtype)
    return None
