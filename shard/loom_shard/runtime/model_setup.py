"""Setting a shard process up: its device and dtype, the model loaded from its files (quantized
weights kept quantized where the kernels run them), and the allocator settings a CPU step needs."""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from loom_proto.config import ShardConfig
from loom_shard import kernels
from loom_shard.layers import row_invariance
from loom_shard.models import build_model
from loom_shard.models.decoder import DecoderModel

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters


def keep_freed_memory_mapped() -> bool:
    """Have glibc keep freed buffers of up to 32 MB for reuse instead of unmapping them.

    A CPU step frees and reallocates the same multi-MB temporaries in every layer and step
    (activations, logits); each one unmapped and mapped again page-faults on first write: 7-10 ms
    of system time per batch-32 decode step (bench/BENCHMARKS.md, Engine). Every thread allocates
    from the main heap, which keeps them: a thread's own arena grows by heaps of 64 MB that glibc
    unmaps as soon as they are empty, whatever the trim threshold (the worker's logits faulted
    anew every step). The arena limit holds for threads that have not allocated yet: call this
    before the worker thread starts. Process-wide; returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20))
    return all([libc.mallopt(parameter, value) for parameter, value in settings])


class ShardSetupError(Exception):
    """The shard cannot run as configured on this machine; str() is one line saying why."""


def resolve_device(device: str, rank: int) -> torch.device:
    """"auto" is cuda when a GPU is visible, else cpu; rank r uses GPU r of the visible ones.
    Raises ShardSetupError for cuda where torch sees no GPU (or not GPU r)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device("cpu")
    if rank >= torch.cuda.device_count():
        raise ShardSetupError(f"--device cuda: rank {rank} needs GPU {rank}, and torch sees "
                              f"{torch.cuda.device_count()} GPU(s) here (a CPU build of torch sees none)")
    return torch.device(f"cuda:{rank}")


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")


def cpu_summary() -> str:
    """"AMD EPYC (avx2 fma ... avx512_bf16)": the model name and the SIMD flags that matter here."""
    flags = kernels.cpu_flags()
    return f"{kernels.cpu_model()} ({' '.join(f for f in SIMD_FLAGS if f in flags) or 'no SIMD flags read'})"


def native_bfloat16() -> bool:
    """The CPU multiplies bfloat16 natively (AVX-512-bf16 or AMX) and oneDNN runs its GEMMs there."""
    return bool({"avx512_bf16", "amx_bf16"} & kernels.cpu_flags()) and row_invariance.onednn_packs(torch.bfloat16)


def choose_dtype(requested: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The shard's dtype and why. Unset: bfloat16 on CUDA, on CPUs that compute it natively, and
    wherever Loom's CPU kernels run it (they read half the bytes of float32: measured faster on an
    AVX2 path too, bench/BENCHMARKS.md, CPUs); float32 only with the kernels off on a CPU without
    native bfloat16. An explicit dtype the device cannot run raises ShardSetupError."""
    if requested is not None:
        dtype = getattr(torch, requested)
        if device.type == "cpu" and dtype not in (torch.bfloat16, torch.float32):
            raise ShardSetupError(f"--dtype {requested} is not supported on CPU: Loom's CPU kernels and "
                                  "batch-invariant linears run bfloat16 and float32")
        return dtype, "--dtype"
    if device.type == "cuda":
        return torch.bfloat16, "the CUDA default"
    if native_bfloat16():
        return torch.bfloat16, "this CPU computes bfloat16 natively"
    if kernels.available():
        return torch.bfloat16, "no native bfloat16 here, but Loom's kernels run it, reading half float32's bytes"
    return torch.float32, "no native bfloat16 here and Loom's CPU kernels are off"


def announce(device: torch.device, dtype: torch.dtype, why: str) -> None:
    """One line on stderr (which the launcher shows) saying what this shard computes on and with."""
    where = f"CPU {cpu_summary()}; kernels {kernels.selection().describe()}" if device.type == "cpu" else str(device)
    print(f"[loom_shard] {where}; dtype {str(dtype).removeprefix('torch.')} ({why})", file=sys.stderr, flush=True)


def select_cpu_kernels(choice: str) -> kernels.Selection:
    """The kernels build the shard runs (`--cpu-kernels`); one the CPU cannot run raises ShardSetupError."""
    try:
        return kernels.select(choice)
    except (OSError, RuntimeError, ImportError, ValueError) as error:
        raise ShardSetupError(f"--cpu-kernels {choice}: {' '.join(str(error).split())}") from error


def keeps_quantized(config: ShardConfig, device: torch.device) -> bool:
    """--quantize auto runs quantized weights on the CPU with one rank; otherwise they are dequantized."""
    if config.quantize == "none":
        return False
    if config.world_size > 1 or device.type != "cpu":
        log.info("--quantize auto: quantized weights are dequantized to the dtype (kept quantized only on "
                 "the CPU with one rank)")
        return False
    return True


def load_model(config: ShardConfig, dtype: torch.dtype, device: torch.device) -> tuple[DecoderModel, str]:
    from loom_shard.loading.loader import load_model_config, load_model_weights, weights_hash  # file formats stay out

    if config.world_size > 1:  # only this rank's slices are kept in host memory and reach its GPU
        from loom_shard.loading.tensor_parallel import build_rank_model, check_divisible, rank_part

        model_config = load_model_config(config.model_id)
        try:  # before any weight is read
            check_divisible(model_config, config.world_size)
        except ValueError as error:
            raise ShardSetupError(f"--num-shard {config.world_size}: {error}") from None
        moe = model_config.moe
        part = functools.partial(rank_part, rank=config.rank, world_size=config.world_size,
                                 num_experts=moe.num_experts if moe else 0)
        model_config, weights = load_model_weights(config.model_id, dtype, part=part)
        model = build_rank_model(model_config, weights, config.rank, config.world_size)
    else:
        quantized: dict = {} if keeps_quantized(config, device) else None
        model_config, weights = load_model_weights(config.model_id, dtype, quantized=quantized)
        if quantized:  # built on meta: the dense projections it replaces are never allocated
            from loom_shard.loading.quantize import install_quant_linears

            with torch.device("meta"):
                model = build_model(model_config)
            install_quant_linears(model, quantized, weights, dtype)
            model.load_weights(weights, assign=True)
        else:
            model = build_model(model_config)
            model.load_weights(weights)
    del weights
    return model.to(device=device, dtype=dtype), weights_hash(config.model_id)
