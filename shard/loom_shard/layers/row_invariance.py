"""Keeps a CPU bfloat16 linear's rows bit-identical whatever the number of rows (issue 14).

oneDNN chooses its bfloat16 GEMM kernel, and so its reduction order over K, from the whole
problem's shape. Measured on one machine: row-invariant for every row count when K <= 1024, but
not for K = 1536 (SmolLM2's down_proj) from 4 rows up (on this project's AMD EPYC, AVX-512-bf16:
a few of 36,864 outputs of a 64-row batch differ by one bfloat16 ulp from the same rows computed
one at a time, enough to change greedy answers of the real model; bench/BENCHMARKS.md,
Determinism). Kernel choices differ between CPUs, so each shape with K > MAX_INVARIANT_K is
probed once: where some row changes with the row count, the linear is computed as fixed K chunks
of at most MAX_INVARIANT_K, each a oneDNN GEMM (row-invariant at that K), summed in float32 in
chunk order. A CPU whose one GEMM is already invariant pays nothing.
"""

from __future__ import annotations

import functools

import torch

MAX_INVARIANT_K = 1024  # oneDNN bf16 measured row-invariant up to this reduction length
PROBE_ROWS = (2, 4, 7, 8, 16, 32, 64)  # batch sizes a probe compares every row across


def k_chunks(in_features: int, max_k: int = MAX_INVARIANT_K) -> list[int]:
    """Widths of the fewest near-equal chunks of at most max_k that cover in_features, in order."""
    count = -(-in_features // max_k)
    width = -(-in_features // count)
    return [width] * (count - 1) + [in_features - width * (count - 1)]


def rows_invariant(linear: torch.nn.Module, in_features: int, dtype: torch.dtype) -> bool:
    """True when every row of every PROBE_ROWS batch equals that row computed alone.

    Every output is compared, not one row's: a changed reduction order shows in only a few
    outputs after bfloat16 rounding (8 of 36,864 for SmolLM2's down_proj at 64 rows).
    """
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(max(PROBE_ROWS), in_features, generator=gen).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([linear(batch[i : i + 1]) for i in range(batch.shape[0])])
        return all(torch.equal(linear(batch[:rows]), alone[:rows]) for rows in PROBE_ROWS)


@functools.cache
def onednn_needs_split(in_features: int, out_features: int) -> bool:
    """Whether oneDNN's packed bfloat16 GEMM of this shape changes a row with the row count here.

    Shapes with K <= MAX_INVARIANT_K are trusted (measured); larger ones are probed with a random
    weight of the same shape (oneDNN picks its kernel from the shape, not the values).
    """
    if in_features <= MAX_INVARIANT_K:
        return False
    from loom_shard.layers.packed_linear import PackedLinear  # the probe runs the real layer

    gen = torch.Generator().manual_seed(1)
    probe = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5)
    layer = PackedLinear(probe.to(torch.bfloat16), split_k=False)
    return not rows_invariant(layer, in_features, torch.bfloat16)
