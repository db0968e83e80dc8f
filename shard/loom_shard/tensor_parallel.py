"""Tensor parallelism applied to a model (gpt-fast style): shard, then all-reduce.

q/k/v and gate/up are split column-wise by heads (each rank keeps whole heads),
o and down row-wise; o and down outputs are summed over ranks. The embedding and the LM
head are vocabulary-parallel (each rank holds vocab / N rows; embeddings are summed, logits
gathered, so every rank samples from the same full rows); norms stay replicated. A vocabulary
that N does not divide stays replicated.

Loading (`build_rank_model`): the model is built and sharded on the `meta` device, the
loader reads only this rank's slice of each tensor from the file (`rank_part`: safetensors
slices, GGUF rows or blocks before dequantizing), and only those slices reach the rank's device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom_shard.layers.attention import Attention
from loom_shard.layers.mlp import GatedMLP
from loom_shard.loader_common import Part
from loom_shard.model_config import ModelConfig
from loom_shard.models import build_model
from loom_shard.models.decoder import DecoderModel

_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})  # output rows split
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # input columns split
_VOCAB_PARALLEL = frozenset({"model.embed_tokens.weight", "lm_head.weight"})  # vocabulary rows split


def rank_part(name: str, shape: tuple[int, ...], rank: int, world_size: int) -> Part | None:
    """This rank's part of one Hugging Face tensor (None: replicated): the same cuts
    `apply_tensor_parallel` makes (fusing the column-parallel parts afterwards gives each
    part's chunk, in order)."""
    module = name.split(".")[-2]
    if module in _COLUMN_PARALLEL or (name in _VOCAB_PARALLEL and shape[0] % world_size == 0):
        dim = 0
    elif module in _ROW_PARALLEL:
        dim = 1
    else:
        return None
    size = shape[dim] // world_size
    return Part(dim, rank * size, (rank + 1) * size)


def build_rank_model(config: ModelConfig, rank_weights: dict[str, torch.Tensor], rank: int, world_size: int) -> DecoderModel:
    """The rank's model from weights already cut by `rank_part`: built and sharded on `meta`
    (no memory, no random init), then the slices are assigned in place."""
    with torch.device("meta"):
        model = apply_tensor_parallel(build_model(config), rank, world_size)
    model.load_weights(rank_weights, assign=True)
    return model


def apply_tensor_parallel(model: DecoderModel, rank: int, world_size: int) -> DecoderModel:
    """Keep this rank's share of every layer in place; needs an initialised process group."""
    if world_size == 1:
        return model
    config = model.config
    if config.num_kv_heads % world_size or config.intermediate_size % world_size:
        raise ValueError(
            f"world size {world_size} must divide num_kv_heads {config.num_kv_heads} "
            f"and intermediate_size {config.intermediate_size}"
        )
    for layer in model.layers:
        _shard_attention(layer.self_attn, rank, world_size)
        _shard_mlp(layer.mlp, rank, world_size)
    if config.vocab_size % world_size == 0:
        _shard_vocab(model, rank, world_size)
    return model


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
    new_embed = _VocabParallelEmbedding(rows, embed.embedding_dim, rank * rows)
    new_embed = new_embed.to(device=embed.weight.device, dtype=embed.weight.dtype)
    new_head = _VocabParallelHead(head.in_features, rows, bias=False)
    new_head = new_head.to(device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new_embed.weight.copy_(embed.weight.chunk(world_size)[rank])
        if tied:
            new_head.weight = new_embed.weight
        else:
            new_head.weight.copy_(head.weight.chunk(world_size)[rank])
    model.embed_tokens, model.lm_head = new_embed, new_head


def _shard_attention(attn: Attention, rank: int, world_size: int) -> None:
    d = attn.head_dim
    sizes = [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d]
    attn.qkv_proj = _column_parallel(attn.qkv_proj, sizes, rank, world_size)
    attn.o_proj = _row_parallel(attn.o_proj, rank, world_size)
    attn.num_heads //= world_size
    attn.num_kv_heads //= world_size


def _shard_mlp(mlp: GatedMLP, rank: int, world_size: int) -> None:
    size = mlp.intermediate_size
    mlp.gate_up_proj = _column_parallel(mlp.gate_up_proj, [size, size], rank, world_size)
    mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size)
    mlp.intermediate_size //= world_size


def _column_parallel(linear: nn.Linear, part_sizes: list[int], rank: int, world_size: int) -> nn.Linear:
    """Keep this rank's slice of each fused part's output features (rows of the weight)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.chunk(world_size)[rank] for p in t.split(part_sizes)]).contiguous()

    out = nn.Linear(linear.in_features, sum(part_sizes) // world_size, bias=linear.bias is not None)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(take(linear.weight))
        if linear.bias is not None:
            out.bias.copy_(take(linear.bias))
    return out


class _RowParallelLinear(nn.Linear):
    """A slice of the input features; the partial outputs are summed over ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


def _row_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    assert linear.bias is None, "a replicated bias would be summed world_size times"
    out = _RowParallelLinear(linear.in_features // world_size, linear.out_features, bias=False)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight.chunk(world_size, dim=1)[rank])
    return out
