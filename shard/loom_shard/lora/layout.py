"""Where an adapter's per-module factors go in Loom's model: the fused projections (q/k/v in
`qkv_proj`, gate/up in `gate_up_proj`) take their parts side by side, and a tensor-parallel rank
takes the same share of each factor as of the base weight.

For a projection of P parts, each part's rank padded to R (--max-lora-rank):

    A:   [P * R, in]     part p's lora_A in rows p*R .. p*R + r        (x @ A.T: every part's shrink)
    B_p: [R, out_p]      part p's lora_B.T in rows 0 .. r              (its columns of the output)

so one shrink serves every part and each part's expand reads only its own factor (a block-diagonal
B would read P times the bytes, and at decode the factors' bytes are the LoRA step's cost). Column-parallel
projections (qkv, gate_up) cut B's columns by rank; row-parallel ones (o, down) cut A's rows, and
their partial shrinks are summed over ranks before the expand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom_shard.layers.mlp import GatedMLP
from loom_shard.lora.adapter import LoraAdapter, ModuleShapes


@dataclass(slots=True, frozen=True)
class Projection:
    """One of a decoder layer's projections LoRA can target."""

    owner: str  # "self_attn" or "mlp"
    name: str  # the module's attribute, e.g. "qkv_proj"
    parts: tuple[str, ...]  # the PEFT modules it fuses, in output order
    row_parallel: bool  # under tensor parallelism its input features are split


PROJECTIONS = (
    Projection("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), row_parallel=False),
    Projection("self_attn", "o_proj", ("o_proj",), row_parallel=True),
    Projection("mlp", "gate_up_proj", ("gate_proj", "up_proj"), row_parallel=False),
    Projection("mlp", "down_proj", ("down_proj",), row_parallel=True),
)


def module_shapes(model: nn.Module) -> ModuleShapes:
    """The whole model's (every rank's) projection shapes, from its config; MoE layers' experts are
    not LoRA targets, so a model whose every layer is MoE has no MLP shapes."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size)}
    if all(isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        shapes |= {"gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
                   "down_proj": (c.intermediate_size, c.hidden_size)}
    return ModuleShapes(c.num_layers, shapes)


def local_sizes(proj: Projection, shapes: ModuleShapes, world_size: int) -> tuple[int, list[int]]:
    """This rank's input features and each part's output features of a projection."""
    in_full = shapes.shapes[proj.parts[0]][0]
    in_local = in_full // world_size if proj.row_parallel else in_full
    return in_local, [shapes.shapes[part][1] // (1 if proj.row_parallel else world_size) for part in proj.parts]


def projection_factors(adapter: LoraAdapter, layer: int, proj: Projection, shapes: ModuleShapes, max_rank: int,
                       rank: int, world_size: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """This rank's (A [P*R, in_local], [B_p [R, out_p] per part]) of one projection, float32 on the
    host; None when the adapter leaves every part of it alone."""
    if not any((layer, part) in adapter.factors for part in proj.parts):
        return None
    in_local, outs = local_sizes(proj, shapes, world_size)
    a_parts = torch.zeros(len(proj.parts) * max_rank, in_local)
    b_parts = [torch.zeros(max_rank, out_local) for out_local in outs]
    for p, (part, out_local) in enumerate(zip(proj.parts, outs)):
        factors = adapter.factors.get((layer, part))
        if factors is not None:
            a, b = factors  # [r, in], [out, r]
            if proj.row_parallel:
                a = a[:, rank * in_local : (rank + 1) * in_local]
            else:
                b = b[rank * out_local : (rank + 1) * out_local]
            r = a.shape[0]
            a_parts[p * max_rank : p * max_rank + r] = a
            b_parts[p][:r] = b.T
    return a_parts, b_parts
