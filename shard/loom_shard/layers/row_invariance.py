"""Which GEMM a CPU linear runs, so that a row's result never depends on how many rows it is
computed with (batch invariance), chosen per shape and dtype on the machine that serves.

oneDNN picks its GEMM kernel, and so its reduction order over K, from the whole problem's shape
and from the CPU (AVX2, AVX-512, AMX). Measured on an AVX-512-bf16 EPYC: for K > 1024 (bfloat16
and float32 alike) a single row is summed in another order than the rows of any batch of 2 or
more, while every batch from 2 to 512 rows gives each row the same bits; on an AMX Xeon bfloat16
rows change at K = 576 too. Nothing measured on one machine holds on another, so every shape is
probed where it runs, once per process: a oneDNN GEMM of the shape (oneDNN picks its kernel from
the shape, not the values) must give every row of every PROBE_ROWS batch bit-identical to that
row computed alone, with random data and with rows built to reveal any change in the order of the
sum (`order_revealing_rows`). In order:

    ONEDNN           one oneDNN GEMM (AMX, AVX-512-bf16 where the CPU has them)
    ONEDNN_PAIRED    one oneDNN GEMM, a single row computed as two (the row twice), so that no
                     call has the one-row shape
    ONEDNN_K_CHUNKS  fixed K chunks of at most K_CHUNK, each a oneDNN GEMM, summed in chunk order
    LOOM             Loom's own kernel (kernels/csrc/linear.cpp): one fixed FMA chain per output,
                     invariant by construction on every CPU
    TORCH            F.linear, only where neither oneDNN nor Loom's kernels can run (not invariant)

bfloat16 on a CPU with AVX-512 BF16 and no AMX takes LOOM without a probe: there Loom's kernel
runs one fixed chain of bfloat16 dot products per output, as fast as oneDNN from 32 rows and
1.3-4x faster below (decode batches; bench/BENCHMARKS.md). On AMX, oneDNN's tiles are faster
still, and the probe decides.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable

import torch

from loom_shard import kernels

log = logging.getLogger(__name__)

K_CHUNK = 1024  # the widest K chunk tried
PROBE_ROWS = (2, 4, 7, 8, 16, 32, 64, 256)  # batch sizes whose rows are compared with rows alone
ALONE_ROWS = 64  # rows computed one at a time as the reference


class Gemm(enum.Enum):
    ONEDNN = "oneDNN"
    ONEDNN_PAIRED = "oneDNN, single rows as two"
    ONEDNN_K_CHUNKS = "oneDNN in K chunks"
    LOOM = "Loom kernel"
    TORCH = "F.linear"


def k_chunks(in_features: int, max_k: int = K_CHUNK) -> list[int]:
    """Widths of the fewest near-equal chunks of at most max_k that cover in_features, in order."""
    count = -(-in_features // max_k)
    width = -(-in_features // count)
    return [width] * (count - 1) + [in_features - width * (count - 1)]


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a linear of this dtype here (its bfloat16 path needs AVX-512 BW/VL/DQ,
    AVX-NE-CONVERT or AMX, and honours ONEDNN_MAX_CPU_ISA)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def order_revealing_rows(rows: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose sum with a weight of ones depends on every association of the reduction.

    A quarter of each row is +-2^24 in cancelling pairs, the rest 1.0: in float32 a 1 added to a
    partial sum of 2^24 is lost, so the result counts the ones added while the running sum was
    near zero, and any other order or blocking of the sum (almost surely) counts differently.
    Random data hides a changed order in the last bits, which bfloat16 rounding mostly removes.
    """
    x = torch.ones(rows, in_features)
    big = in_features // 8 * 2
    signs = torch.tensor([1.0, -1.0]).repeat(big // 2)
    for row in x:
        row[torch.randperm(in_features, generator=gen)[:big]] = signs[torch.randperm(big, generator=gen)] * 2.0**24
    return x


def rows_invariant(linear: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> bool:
    """True when every row of every PROBE_ROWS batch (the first rows of `batch`) equals that row
    computed alone. Every output is compared, not one row's."""
    with torch.inference_mode():
        alone = torch.cat([linear(batch[i : i + 1]) for i in range(ALONE_ROWS)])
        return all(torch.equal(linear(batch[:rows])[:ALONE_ROWS], alone[: min(rows, ALONE_ROWS)])
                   for rows in PROBE_ROWS)


def _probe(in_features: int, out_features: int, dtype: torch.dtype, gemm: Gemm) -> bool:
    """The GEMM keeps rows invariant with random weights and inputs (a changed rounding of the
    products) and with ones and order-revealing rows (a changed order of the sum)."""
    from loom_shard.layers.packed_linear import PackedLinear  # the probe runs the real layer

    gen = torch.Generator().manual_seed(1)
    random_weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    cases = [(random_weight, torch.randn(max(PROBE_ROWS), in_features, generator=gen)),
             (torch.ones(out_features, in_features), order_revealing_rows(max(PROBE_ROWS), in_features, gen))]
    for weight, batch in cases:
        linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        if not rows_invariant(PackedLinear(linear, gemm=gemm), batch.to(dtype)):
            return False
    return True


@functools.cache
def choose(in_features: int, out_features: int, dtype: torch.dtype) -> Gemm:
    """LOOM for bfloat16 where its dot products run (no AMX); else the first of ONEDNN,
    ONEDNN_PAIRED, ONEDNN_K_CHUNKS, LOOM that keeps rows invariant for this shape here."""
    if dtype == torch.bfloat16 and kernels.bf16_dot() and "amx_bf16" not in kernels.cpu_flags():
        log.info("linear %dx%d %s: %s (bfloat16 dot products, invariant by construction)", in_features,
                 out_features, dtype, Gemm.LOOM.value)
        return Gemm.LOOM
    candidates = [Gemm.ONEDNN, Gemm.ONEDNN_PAIRED] if onednn_packs(dtype) else []
    if candidates and in_features > K_CHUNK:
        candidates.append(Gemm.ONEDNN_K_CHUNKS)
    for gemm in candidates:
        if _probe(in_features, out_features, dtype, gemm):
            log.info("linear %dx%d %s: %s (rows probed invariant)", in_features, out_features, dtype, gemm.value)
            return gemm
    if kernels.available():
        log.info("linear %dx%d %s: %s (%s)", in_features, out_features, dtype, Gemm.LOOM.value,
                 "oneDNN changes rows with the batch here" if candidates else f"oneDNN has no {dtype} path here")
        return Gemm.LOOM
    fallback = candidates[0] if candidates else Gemm.TORCH
    log.warning("linear %dx%d %s: %s, NOT batch-invariant (Loom's CPU kernels are off)", in_features,
                out_features, dtype, fallback.value)
    return fallback
