"""The Triton grouped GEMM for mixture-of-experts layers (`loom_shard.layers.moe_triton`) on CUDA:
the same picks as the per-expert loop, rows batch-invariant, another rank's experts skipped, and
a forward captured in a CUDA graph (nothing read back to the host)."""

from __future__ import annotations

import os

import pytest
import torch

from loom_shard.layers import moe as moe_layer
from loom_shard.layers.moe import MoE
from loom_shard.model_config import ExpertActivation, MoEConfig, Routing

pytest.importorskip("triton")
pytestmark = pytest.mark.interpretable
# TRITON_INTERPRET=1 runs these on the CPU too (float32/float16: the interpreter has no bfloat16).
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
LOW = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _moe(dtype: torch.dtype, activation: ExpertActivation = ExpertActivation.SILU, bias: bool = False,
         num_experts: int = 8, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    config = MoEConfig(num_experts=num_experts, num_experts_per_tok=2, intermediate_size=96,
                       routing=Routing.SOFTMAX_TOPK, renormalize=True, router_bias=bias, expert_bias=bias,
                       activation=activation)
    moe = MoE(64, config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
    return moe.to(DEVICE, dtype)


def _both(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grouped, per-expert loop) picks of x, [num_tokens * k, hidden] each."""
    _, ids = moe_layer.route(moe.gate(x), moe.config)
    return moe_layer._grouped_picks(moe.experts, x, ids), moe._sorted_picks(x, ids)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (LOW, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize(("activation", "bias"), [(ExpertActivation.SILU, False), (ExpertActivation.CLAMPED_SWIGLU, True)])
def test_grouped_matches_per_expert_loop(dtype, tolerance, num_tokens, activation, bias) -> None:
    moe = _moe(dtype, activation, bias)
    x = torch.randn(num_tokens, 64, device=DEVICE).to(dtype)
    grouped, loop = _both(moe, x)
    assert (grouped.float() - loop.float()).abs().max().item() <= tolerance * loop.float().abs().max().item()


def test_another_ranks_experts_are_skipped() -> None:
    moe = _moe(torch.float32)
    experts = moe.experts
    with torch.no_grad():  # this "rank" holds experts 2..5 of 8
        experts.w13 = torch.nn.Parameter(experts.w13[2:6].clone())
        experts.w2 = torch.nn.Parameter(experts.w2[2:6].clone())
    experts.expert_start = 2
    x = torch.randn(30, 64, device=DEVICE)
    grouped, loop = _both(moe, x)
    _, ids = moe_layer.route(moe.gate(x), moe.config)
    other = ((ids.flatten() < 2) | (ids.flatten() >= 6))
    assert bool(other.any()) and bool((~other).any())
    assert bool((grouped[other] == 0).all())
    assert torch.allclose(grouped, loop, rtol=1e-5, atol=1e-6)


def test_rows_are_batch_invariant() -> None:
    moe = _moe(LOW)
    x = torch.randn(33, 64, device=DEVICE).to(LOW)
    batched = moe(x)
    for i in (0, 17, 32):
        assert torch.equal(moe(x[i : i + 1])[0], batched[i])


def test_expert_tiles_cover_each_experts_rows_once() -> None:
    from loom_shard.layers.moe_triton import BLOCK_M, expert_tiles

    local = torch.tensor([0] * 3 + [2] * (BLOCK_M + 2) + [5] + [6] * 4, device=DEVICE)  # 6: another rank's
    tiles = expert_tiles(local, num_experts=6)
    live = tiles.expert >= 0
    assert tiles.expert[live].tolist() == [0, 2, 2, 5]
    assert tiles.start[live].tolist() == [0, 3, 3 + BLOCK_M, 3 + BLOCK_M + 2]
    assert tiles.end[live].tolist() == [3, 3 + BLOCK_M, 3 + BLOCK_M + 2, 3 + BLOCK_M + 3]
    assert tiles.expert.shape[0] == -(-local.shape[0] // BLOCK_M) + 6


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_forward_captures_in_a_cuda_graph() -> None:
    moe = _moe(torch.bfloat16)
    static_x = torch.randn(8, 64, device=DEVICE).to(torch.bfloat16)
    moe(static_x)  # compile the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
    fresh = torch.randn(8, 64, device=DEVICE).to(torch.bfloat16)
    static_x.copy_(fresh)
    graph.replay()
    assert torch.equal(static_out, moe(fresh))
