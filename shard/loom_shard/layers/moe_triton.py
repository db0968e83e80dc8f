"""Mixture-of-experts on CUDA: a Triton grouped GEMM over the picks sorted by expert (the layout
of vLLM's fused_moe), with no host sync.

    picks (token, expert) sorted by expert --> tiles of BLOCK_M rows, each inside one expert's rows
    grid = (max_tiles, cdiv(N, BLOCK_N)); program: its tile's rows x its expert's weight [N, K]^T

The first GEMM gathers each pick's token row from x (no copy of x per pick); the second reads
the activations in sorted order. The tile table is built on the device (searchsorted, cumsum)
for the worst case, cdiv(picks, BLOCK_M) + experts tiles, so a step's shapes depend only on its
token count: nothing is read back to the host and a decode step can be captured in a CUDA graph.
Tiles past the last one return at once. Block sizes are fixed, so a row's sums run in one order
whatever else is in the batch: rows stay batch-invariant.
Importing this module needs triton; `loom_shard.layers.moe` decides whether to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile: tl.dot's minimum, and a decode's picks of one expert fit in one
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, source_rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K,
    stride_x, stride_w_expert, stride_w_row, stride_bias, stride_out,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return  # past the last tile of this step
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)  # sorted pick rows
    row_valid = rows < end
    if GATHER:
        source = tl.load(source_rows_ptr + rows, mask=row_valid, other=0)  # each pick's token row of x
    else:
        source = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_w_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = 0
    while k0 < K:  # a while loop: the interpreter's scalars are not Python ints
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(x_ptr + source.to(tl.int64)[:, None] * stride_x + ks[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_base + cols.to(tl.int64)[None, :] * stride_w_row + ks[:, None],
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:  # float32 weights: exact float32 products (tf32 would break parity)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        k0 += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias + cols, mask=col_valid, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """Each tile's expert (-1: past the last tile) and its sorted rows [start, end), int32 [max_tiles]."""

    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor


def expert_tiles(sorted_local: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertTiles:
    """Local expert ids of the picks, sorted (num_experts for picks of another rank's experts, last)
    -> the tile table, on the device and without a host sync."""
    bounds = torch.searchsorted(sorted_local, torch.arange(num_experts + 1, device=sorted_local.device))
    starts, ends = bounds[:-1], bounds[1:]  # [experts]: each expert's sorted rows
    tiles = (ends - starts + block_m - 1) // block_m  # [experts]
    tile_ends = torch.cumsum(tiles, 0)  # [experts]
    max_tiles = -(-sorted_local.shape[0] // block_m) + num_experts
    t = torch.arange(max_tiles, device=sorted_local.device)  # [max_tiles]
    expert = torch.searchsorted(tile_ends, t, right=True)  # num_experts past the last tile
    held = expert.clamp(max=num_experts - 1)
    start = starts[held] + (t - (tile_ends[held] - tiles[held])) * block_m
    end = torch.minimum(start + block_m, ends[held])
    expert = torch.where(expert < num_experts, expert, -1)
    return ExpertTiles(expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32))


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: ExpertTiles,
                 num_rows: int, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = x[source_rows[r] or r] @ weight[expert of r]^T (+ bias[expert]) for the rows the
    tiles cover; x [*, K], weight [experts, N, K] -> out [num_rows, N] (rows no tile covers: 0)."""
    n, k = weight.shape[1:]
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_zeros(num_rows, n)
    grid = (tiles.expert.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        source_rows if source_rows is not None else tiles.start, tiles.expert, tiles.start, tiles.end,
        n, k, x.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER=source_rows is not None, HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out
