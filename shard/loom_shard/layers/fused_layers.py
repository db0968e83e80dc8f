"""Every decoder layer of a step in one C++ call, `loom::decoder_layers` (kernels/csrc/decoder.cpp),
where the model is a plain Llama whose projections are QuantLinears on Loom's kernels: the same
kernels and ops as the modules, in the same order, so bit-identical to them, without the Python
around each op (about 2 ms of a batch-1 decode step)."""

from __future__ import annotations

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.attention.cpu import paged_attention_cpu
from loom_shard.attention.metadata import AttentionMetadata, GroupedMetadata
from loom_shard.layers.decoder import DecoderLayer
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.quant_linear import QuantLinear
from loom_shard.layers.rotary import KernelRope, Rope
from loom_shard.lora.linear import unwrap
from loom_shard.model_config import Activation

FusedArgs = tuple[list[torch.Tensor], list[torch.Tensor | None]]  # the layers' tensors, their qkv biases


class FusedLayers:
    """The layers' tensors in loom::decoder_layers' order, gathered once per set of weights."""

    def __init__(self) -> None:
        self.enabled = True  # False: the modules run even where loom::decoder_layers can
        self._args: FusedArgs | None = None

    def reset(self) -> None:
        """The weights changed: gather again at the next step."""
        self._args = None

    def args(self, layers: nn.ModuleList, plain_model: bool) -> FusedArgs:
        """Empty unless every layer is a plain Llama layer whose projections are QuantLinears on
        Loom's kernels, bias-free but for qkv's (Qwen2), and the model adds nothing around them
        (`plain_model`); not under tensor parallelism, whose projections are nn.Linear."""
        if not self.enabled:
            return [], []
        if self._args is None:
            fused = list(layers) if plain_model and all(_fusable(layer) for layer in layers) else []
            self._args = ([t for layer in fused for t in _layer_tensors(layer)],
                          [layer.self_attn.qkv_proj.bias for layer in fused])
        return self._args

    def run(self, x: torch.Tensor, layers: nn.ModuleList, plain_model: bool, kv_cache: torch.Tensor,
            meta: AttentionMetadata | GroupedMetadata, rope: Rope) -> torch.Tensor | None:
        """x [num_tokens, hidden] through every layer in one call; None where it cannot run (then
        the modules do): the C++ rotary tables and the CPU paged kernel's single set of tables."""
        paged = meta.paged
        if not isinstance(rope, KernelRope) or paged is None or paged.kernel is not paged_attention_cpu:
            return None
        weights, qkv_biases = self.args(layers, plain_model)
        if not weights:
            return None
        attn = layers[0].self_attn
        return kernels.ops().decoder_layers(
            x, weights, qkv_biases, kv_cache, meta.slot_mapping, rope.positions, rope.cos, rope.sin,
            paged.block_tables, paged.query_starts, paged.num_cached, attn.num_heads, attn.num_kv_heads,
            layers[0].mlp.intermediate_size, layers[0].input_layernorm.eps)


def _projections(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The layer's projections, without their LoRA wrappers (a step with adapter tokens runs the modules)."""
    attn, mlp = layer.self_attn, layer.mlp
    return unwrap(attn.qkv_proj), unwrap(attn.o_proj), unwrap(mlp.gate_up_proj), unwrap(mlp.down_proj)


def _fusable(layer: DecoderLayer) -> bool:
    if not layer.is_plain or not isinstance(layer.mlp, GatedMLP) or layer.mlp.activation is not Activation.SILU:
        return False
    projections = _projections(layer)
    on_kernels = all(type(p) is QuantLinear and p.uses_kernels for p in projections)
    return on_kernels and all(p.bias is None for p in projections[1:])  # only qkv may have a bias (Qwen2)


def _layer_tensors(layer: DecoderLayer) -> list[torch.Tensor]:
    """One layer's tensors in loom::decoder_layers' order."""
    qkv, o, gate_up, down = (_qtensors(p) for p in _projections(layer))
    return [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight, *gate_up, *down]


def _qtensors(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(linear, QuantLinear)
    return linear.packed, linear.scales.view(torch.float16)
