"""Keeps a CPU bfloat16 linear's rows bit-identical whatever the number of rows (issue 14).

oneDNN chooses its bfloat16 GEMM kernel, and so its reduction order over K, from the whole
problem's shape. Measured on one machine: row-invariant for every row count when K <= 1024, but
not for K = 1536 (SmolLM2's down_proj) from 4-8 rows up. Measured on this project's CI machine
(AMD EPYC, AVX-512-bf16, no AMX): row-invariant for every K tested (576..2048), 1..2048 rows,
1..16 threads (bench/BENCHMARKS.md, Determinism). So the answer depends on the CPU, and is
probed here once per weight shape: a linear with K > MAX_INVARIANT_K whose rows change with the
row count is computed as fixed K chunks of at most MAX_INVARIANT_K, each a oneDNN GEMM (row-
invariant at that K), summed in float32 in chunk order. The split costs time (about +40% for
down_proj at 32 rows here), so a CPU that needs none pays none.
"""

from __future__ import annotations

import functools

import torch

MAX_INVARIANT_K = 1024  # oneDNN bf16 measured row-invariant up to this reduction length
PROBE_ROWS = (2, 4, 7, 8, 16, 32, 64, 512)  # batch sizes a probe compares a row across


def k_chunks(in_features: int, max_k: int = MAX_INVARIANT_K) -> list[int]:
    """Widths of the fewest near-equal chunks of at most max_k that cover in_features, in order."""
    count = -(-in_features // max_k)
    width = -(-in_features // count)
    return [width] * (count - 1) + [in_features - width * (count - 1)]


def rows_invariant(linear: torch.nn.Module, in_features: int, dtype: torch.dtype) -> bool:
    """True when `linear`'s first row is bit-identical alone and under every PROBE_ROWS batch."""
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(max(PROBE_ROWS), in_features, generator=gen).to(dtype)
    with torch.inference_mode():
        alone = linear(batch[:1])
        return all(torch.equal(linear(batch[:rows])[:1], alone) for rows in PROBE_ROWS)


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
