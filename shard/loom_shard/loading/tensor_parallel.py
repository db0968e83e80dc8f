"""Tensor parallelism applied to a model (gpt-fast style): shard, then all-reduce.

q/k/v and gate/up are split column-wise by heads (each rank keeps whole heads), o and down
row-wise; o and down outputs are summed over ranks (a replicated bias is added once, after the
sum). Attention sinks go with their heads. Mixture-of-experts layers split their experts: each rank
holds a contiguous range of them, computes every token's picks among its own, and the partial sums
are added; the router stays replicated. The embedding and the LM head are vocabulary-parallel
(each rank holds vocab / N rows; embeddings are summed, logits gathered, so every rank samples from
the same full rows); norms stay replicated. A vocabulary that N does not divide stays replicated.

Loading (`build_rank_model`): the model is built and sharded on the `meta` device; the loader reads
only this rank's part of each tensor where a contiguous part is enough (`rank_part`: safetensors
slices, GGUF rows or blocks before dequantizing), and each parallel layer's parameters carry a
`weight_loader` that cuts the rank's share from a whole tensor (a checkpoint's fused q/k/v, Phi-3's
gate/up) or takes the rank's part as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom_shard.layers.attention import Attention
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.moe import MoE
from loom_shard.loading.common import Part
from loom_shard.model_config import ModelConfig
from loom_shard.models import build_model
from loom_shard.models.decoder import DecoderModel

_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})  # output rows split
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # input columns split
_VOCAB_PARALLEL = frozenset({"model.embed_tokens.weight", "lm_head.weight"})  # vocabulary rows split
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor (Mixtral, Qwen3-MoE)

WeightLoader = Callable[[torch.Tensor], torch.Tensor]  # a whole (or already cut) tensor -> this rank's share


def rank_part(name: str, shape: tuple[int, ...], rank: int, world_size: int, num_experts: int = 0) -> Part | None:
    """This rank's part of one Hugging Face tensor (None: read it whole): the same cuts the parallel
    layers make (fusing the column-parallel parts afterwards gives each part's chunk, in order).
    Experts (num_experts: the model's): a stacked tensor's rank range of experts, nothing of
    another rank's expert; with num_experts 0 they are read whole and cut after."""
    if ".experts." in name:
        return _expert_part(name, shape, rank, world_size, num_experts) if num_experts else None
    module = name.split(".")[-2]
    if module in _COLUMN_PARALLEL or name.endswith(".sinks") or (
            name in _VOCAB_PARALLEL and shape[0] % world_size == 0):
        dim = 0
    elif module in _ROW_PARALLEL and name.endswith(".weight"):  # its bias is replicated
        dim = 1
    else:
        return None
    size = shape[dim] // world_size
    return Part(dim, rank * size, (rank + 1) * size)


def _expert_part(name: str, shape: tuple[int, ...], rank: int, world_size: int, num_experts: int) -> Part:
    held = expert_range(num_experts, rank, world_size)
    match = _EXPERT.search(name)
    if match is None:  # stacked [experts, ...] (gpt-oss)
        return Part(0, held.start, held.stop)
    return Part(0, 0, shape[0]) if int(match.group(1)) in held else Part(0, 0, 0)


def expert_range(num_experts: int, rank: int, world_size: int) -> range:
    size = num_experts // world_size
    return range(rank * size, (rank + 1) * size)


def build_rank_model(config: ModelConfig, rank_weights: dict[str, torch.Tensor], rank: int,
                     world_size: int) -> DecoderModel:
    """The rank's model from weights read with `rank_part`: built and sharded on `meta` (no
    memory, no random init), then the parts are assigned in place."""
    with torch.device("meta"):
        model = apply_tensor_parallel(build_model(config), rank, world_size)
    model.load_weights(rank_weights, assign=True)
    return model


def apply_tensor_parallel(model: DecoderModel, rank: int, world_size: int) -> DecoderModel:
    """Keep this rank's share of every layer in place; needs an initialised process group to run."""
    if world_size == 1:
        return model
    check_divisible(model.config, world_size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, rank, world_size)
        if isinstance(layer.mlp, MoE):
            layer.mlp = _shard_moe(layer.mlp, rank, world_size)
        else:
            _shard_mlp(layer.mlp, rank, world_size)
    if model.config.vocab_size % world_size == 0:
        _shard_vocab(model, rank, world_size)
    return model


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError unless every dimension that is split over the ranks divides evenly."""
    counts = {"num_kv_heads": config.num_kv_heads}
    if config.moe is None or config.moe.dense_layers:
        counts["intermediate_size"] = config.intermediate_size
    if config.moe is not None:
        counts["num_experts"] = config.moe.num_experts
    bad = {name: n for name, n in counts.items() if n % world_size}
    if bad:
        raise ValueError(f"world size {world_size} must divide " + " and ".join(f"{k} {v}" for k, v in bad.items()))


def _with_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # read by DecoderModel.load_weights
    return param


def _cut(dim: int, start: int, stop: int) -> WeightLoader:
    """A loader keeping [start, stop) along dim of a whole tensor; an already cut one passes."""
    def load(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.shape[dim] == stop - start else tensor.narrow(dim, start, stop - start).contiguous()

    return load


class _VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding; ids outside give zeros,
    and the sum over ranks is the full lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * inside.unsqueeze(-1)
        dist.all_reduce(out)
        return out


class _VocabParallelHead(nn.Linear):
    """This rank's vocabulary slice of the logits, gathered into full rows on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()  # [rows, vocab / world_size]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)


def _shard_vocab(model: DecoderModel, rank: int, world_size: int) -> None:
    embed, head = model.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    rows = embed.num_embeddings // world_size
    loader = _cut(0, rank * rows, (rank + 1) * rows)
    new_embed = _VocabParallelEmbedding(rows, embed.embedding_dim, rank * rows)
    new_embed = new_embed.to(device=embed.weight.device, dtype=embed.weight.dtype)
    new_head = _VocabParallelHead(head.in_features, rows, bias=False)
    new_head = new_head.to(device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new_embed.weight = _with_loader(nn.Parameter(loader(embed.weight.detach())), loader)
        if tied:
            new_head.weight = new_embed.weight
        else:
            new_head.weight = _with_loader(nn.Parameter(loader(head.weight.detach())), loader)
    model.embed_tokens, model.lm_head = new_embed, new_head


def _shard_attention(attn: Attention, rank: int, world_size: int) -> None:
    d = attn.head_dim
    sizes = [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d]
    attn.qkv_proj = _column_parallel(attn.qkv_proj, sizes, rank, world_size)
    attn.o_proj = _row_parallel(attn.o_proj, rank, world_size)
    if attn.sinks is not None:
        heads = attn.num_heads // world_size
        loader = _cut(0, rank * heads, (rank + 1) * heads)
        attn.sinks = _with_loader(nn.Parameter(loader(attn.sinks.detach())), loader)
    attn.num_heads //= world_size
    attn.num_kv_heads //= world_size


def _shard_mlp(mlp: GatedMLP, rank: int, world_size: int) -> None:
    size = mlp.intermediate_size
    mlp.gate_up_proj = _column_parallel(mlp.gate_up_proj, [size, size], rank, world_size)
    mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size)
    mlp.intermediate_size //= world_size


class _ExpertParallelMoE(MoE):
    """This rank's experts: each token's picks among them, summed over ranks (the router's picks
    are the same on every rank, it is replicated)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


def _shard_moe(moe: MoE, rank: int, world_size: int) -> MoE:
    experts = moe.experts
    held = expert_range(experts.num_experts, rank, world_size)
    loader = _cut(0, held.start, held.stop)
    for name in ("w13", "w2", "b13", "b2"):
        param = getattr(experts, name)
        if param is not None:
            setattr(experts, name, _with_loader(nn.Parameter(loader(param.detach())), loader))
    experts.expert_start = held.start
    # The same module and parameter names (the checkpoint's map onto them), its output reduced.
    moe.__class__ = _ExpertParallelMoE
    return moe


def _column_parallel(linear: nn.Linear, part_sizes: list[int], rank: int, world_size: int) -> nn.Linear:
    """Keep this rank's slice of each fused part's output features (rows of the weight)."""
    local_sizes = [size // world_size for size in part_sizes]

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == sum(local_sizes):
            return t  # already this rank's parts (read with rank_part, then fused)
        return torch.cat([p.chunk(world_size)[rank] for p in t.split(part_sizes)]).contiguous()

    out = nn.Linear(linear.in_features, sum(local_sizes), bias=linear.bias is not None)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight = _with_loader(nn.Parameter(take(linear.weight.detach())), take)
        if linear.bias is not None:
            out.bias = _with_loader(nn.Parameter(take(linear.bias.detach())), take)
    return out


class _RowParallelLinear(nn.Linear):
    """A slice of the input features; the partial outputs are summed over ranks, then the
    (replicated) bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _row_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    columns = linear.in_features // world_size
    loader = _cut(1, rank * columns, (rank + 1) * columns)
    out = _RowParallelLinear(columns, linear.out_features, bias=linear.bias is not None)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight = _with_loader(nn.Parameter(loader(linear.weight.detach())), loader)
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.detach().clone())
    return out
