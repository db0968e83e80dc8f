"""Mixture-of-experts feed-forward: a router picks k experts per token, tokens are grouped by
expert, and each expert runs one GEMM over all of its tokens (its weights read once per step).

    tokens x k picks --sort by expert--> [ e0 rows | e1 rows | ... ] --one GEMM each--> back in
    token order, summed over the k picks in rank order (a fixed order: a row's result does not
    depend on the batch, since each expert's GEMM is row-invariant, `PackedLinear`).

Experts' weights are stacked ([experts, rows, cols]), as checkpoints increasingly store them and
as a grouped GEMM reads them: on CUDA one Triton grouped GEMM per projection runs every expert
(`loom_shard.layers.moe_triton`), with nothing read back to the host. Under tensor parallelism each rank holds a contiguous range of the
experts (`expert_start`) and the ranks' partial sums are added (`loom_shard.loading.tensor_parallel`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from loom_shard import kernels
from loom_shard.layers.packed_linear import PACKED_DTYPES, PackedLinear
from loom_shard.layers.quant_linear import QuantLinear
from loom_shard.model_config import ExpertActivation, MoEConfig, Routing

log = logging.getLogger(__name__)

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [num_tokens, num_experts] -> (weights [num_tokens, k] float32, expert ids
    [num_tokens, k]), best first."""
    k = moe.num_experts_per_tok
    if moe.routing is Routing.TOPK_SOFTMAX:
        top, ids = torch.topk(logits, k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_activation(gate_up: torch.Tensor, intermediate: int, activation: ExpertActivation) -> torch.Tensor:
    """[rows, 2 * intermediate] (gate, then up) -> [rows, intermediate]."""
    if activation is ExpertActivation.SILU and kernels.runs(gate_up):
        return kernels.silu_mul(gate_up, intermediate)
    gate, up = gate_up.split(intermediate, dim=-1)
    if activation is ExpertActivation.SILU:
        return F.silu(gate) * up
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class FusedExperts(nn.Module):
    """The experts of one layer, stacked: w13 [experts, 2 * intermediate, hidden] (gate rows, then
    up rows), w2 [experts, hidden, intermediate], optional biases (gpt-oss)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool,
                 activation: ExpertActivation) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.expert_start = 0  # global id of the first expert held here
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self._packed: list[tuple[PackedLinear, PackedLinear]] | None = None  # CPU: per expert, from the stack
        self._packed_key: tuple[int, torch.dtype] | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted [rows, hidden] grouped by expert (counts[e] rows for local expert e, in order)
        -> [rows, hidden]: each row through its expert."""
        out = torch.empty_like(x_sorted)
        linears = self._cpu_linears()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            if linears is not None:
                up_linear, down_linear = linears[e]
                h = expert_activation(up_linear(x_sorted[rows]), self.intermediate_size, self.activation)
                out[rows] = down_linear(h)
            else:
                gate_up = F.linear(x_sorted[rows], self.w13[e], None if self.b13 is None else self.b13[e])
                h = expert_activation(gate_up, self.intermediate_size, self.activation)
                out[rows] = F.linear(h, self.w2[e], None if self.b2 is None else self.b2[e])
            start += count
        return out

    def _cpu_linears(self) -> list[tuple[PackedLinear, PackedLinear]] | None:
        """On CPU, each expert's two projections as PackedLinears over views of the stacks (a GEMM
        chosen per shape, rows batch-invariant), built once per weights; None elsewhere."""
        w13 = self.w13
        if w13.device.type != "cpu" or w13.dtype not in PACKED_DTYPES:
            return None
        key = (w13.data_ptr(), w13.dtype)
        if self._packed is None or key != self._packed_key:
            self._packed = [(_linear_view(w13[e], self.b13, e), _linear_view(self.w2[e], self.b2, e))
                            for e in range(self.num_experts)]
            self._packed_key = key
        return self._packed


def _linear_view(weight: torch.Tensor, bias: torch.Tensor | None, expert: int) -> PackedLinear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias[expert].detach(), requires_grad=False)
    return PackedLinear(linear)


class QuantExperts(nn.Module):
    """Experts whose weights stay quantized (a GGUF's experts in a format kept quantized): one
    QuantLinear pair per expert on Loom's kernels, its rows batch-invariant as every QuantLinear's."""

    def __init__(self, up: list[QuantLinear], down: list[QuantLinear], activation: ExpertActivation) -> None:
        super().__init__()
        self.up = nn.ModuleList(up)  # gate rows, then up rows: [2 * intermediate, hidden] each
        self.down = nn.ModuleList(down)
        self.intermediate_size = down[0].in_features
        self.activation = activation
        self.expert_start = 0
        self.use_fused = True  # False: the modules below even where loom::moe_experts can run

    @property
    def fused(self) -> bool:
        """Whether loom::moe_experts (kernels/csrc/moe.cpp) runs the layer's experts in one C++ call,
        bit-identical to MoE.forward's modules."""
        return self.use_fused and all(linear.uses_kernels for linear in self.up)

    def run_picks(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], ids and weights [tokens, k] -> [tokens, hidden]: loom::moe_experts."""
        args = [(lin.packed, lin.scales.view(torch.float16)) for lin in (*self.up, *self.down)]
        n = self.num_experts
        activation = 0 if self.activation is ExpertActivation.SILU else 1
        return kernels.ops().moe_experts(x, ids, weights, [a[0] for a in args[:n]], [a[1] for a in args[:n]],
                                         [a[0] for a in args[n:]], [a[1] for a in args[n:]], self.expert_start,
                                         self.intermediate_size, activation)

    @property
    def num_experts(self) -> int:
        return len(self.up)

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(x_sorted)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                h = expert_activation(self.up[e](x_sorted[rows]), self.intermediate_size, self.activation)
                out[rows] = self.down[e](h)
                start += count
        return out


class MoE(nn.Module):
    """Router (`gate`) and experts. forward: x [num_tokens, hidden] -> [num_tokens, hidden]."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.config = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size, moe.expert_bias,
                                    moe.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.config)  # [num_tokens, k] each
        experts = self.experts
        if isinstance(experts, QuantExperts) and experts.fused:
            return experts.run_picks(x, ids, weights)
        if isinstance(experts, FusedExperts) and _grouped_on(experts.w13):
            y = _grouped_picks(experts, x, ids)
        else:
            y = self._sorted_picks(x, ids)
        return _combine(y.view(*ids.shape, -1), weights.to(x.dtype))

    def _sorted_picks(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each pick through its expert, one call per expert over its rows -> [num_tokens * k, hidden]
        in pick order (zeros for another rank's experts)."""
        k = ids.shape[1]
        local = ids.flatten() - self.experts.expert_start  # [num_tokens * k]
        held = (local >= 0) & (local < self.experts.num_experts)
        picks = torch.nonzero(held).squeeze(1) if not bool(held.all()) else torch.arange(local.shape[0], device=local.device)
        order = picks[torch.argsort(local[picks], stable=True)]  # picks grouped by expert, in token order
        counts = torch.bincount(local[order], minlength=self.experts.num_experts).tolist()
        y_sorted = self.experts(x[order // k], counts)  # [picks, hidden]
        y = x.new_zeros(local.shape[0], x.shape[1])
        y[order] = y_sorted
        return y


def _combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [num_tokens, k, hidden], weights [num_tokens, k] -> [num_tokens, hidden], summed over the
    k picks in a fixed order."""
    out = y[:, 0] * weights[:, :1]
    for j in range(1, y.shape[1]):
        out = out.add_(y[:, j] * weights[:, j : j + 1])
    return out


@functools.cache
def _triton_grouped() -> ModuleType | None:
    """loom_shard.layers.moe_triton where triton imports, else None (one log line)."""
    try:
        from loom_shard.layers import moe_triton
    except ImportError as error:
        log.warning("triton unavailable (%s): CUDA experts run one GEMM call per expert", error)
        return None
    return moe_triton


def _grouped_on(weight: torch.Tensor) -> bool:
    """Whether the Triton grouped GEMM runs these experts: CUDA, with triton."""
    return weight.device.type == "cuda" and _triton_grouped() is not None


def _grouped_picks(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The picks through their experts in two grouped GEMMs, nothing read back to the host
    -> [num_tokens * k, hidden] in pick order (zeros for another rank's experts)."""
    grouped = _triton_grouped()
    k = ids.shape[1]
    local = ids.flatten() - experts.expert_start  # [picks]
    n = experts.num_experts
    local = torch.where((local >= 0) & (local < n), local, n)  # another rank's: sorted last, in no tile
    sorted_local, order = torch.sort(local, stable=True)  # [picks] each
    tiles = grouped.expert_tiles(sorted_local, n)
    gate_up = grouped.grouped_gemm(x, experts.w13, experts.b13, tiles, order.shape[0], source_rows=order // k)
    h = expert_activation(gate_up, experts.intermediate_size, experts.activation)  # [picks, intermediate]
    y_sorted = grouped.grouped_gemm(h, experts.w2, experts.b2, tiles, order.shape[0])  # [picks, hidden]
    return torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
