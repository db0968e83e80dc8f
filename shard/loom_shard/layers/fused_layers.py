"""Every decoder layer of a step in one C++ call, `loom::decoder_layers` (kernels/csrc/decoder.cpp),
where the model is a plain Llama whose projections run on Loom's kernels (QuantLinears, a qkv
SplitLinear of them, and PackedLinears on loom::linear; LoRA deltas included when the step names
adapters): the same kernels and ops as the modules, in the same order, so bit-identical to them,
without the Python around each op (about 2 ms of a batch-1 decode step, 4.6 ms of a batch-32 one)."""

from __future__ import annotations

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.attention.cpu import paged_attention_cpu
from loom_shard.attention.metadata import AttentionMetadata, GroupedMetadata
from loom_shard.layers.decoder import DecoderLayer
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.packed_linear import PackedLinear
from loom_shard.layers.quant_linear import QuantLinear
from loom_shard.layers.rotary import KernelRope, Rope
from loom_shard.layers.row_invariance import Gemm
from loom_shard.layers.split_linear import SplitLinear
from loom_shard.lora.linear import LoraBatch, LoraLinear, unwrap
from loom_shard.model_config import Activation

FusedArgs = tuple[list[torch.Tensor], list[torch.Tensor | None]]  # the layers' tensors, their qkv biases
PER_LAYER = 14  # tensors per layer in loom::decoder_layers' weights (kPerLayer)


class FusedLayers:
    """The layers' tensors in loom::decoder_layers' order, gathered once per set of weights."""

    def __init__(self) -> None:
        self.enabled = True  # False: the modules run even where loom::decoder_layers can
        self._args: FusedArgs | None = None
        self._lora: tuple[list[torch.Tensor], LoraBatch | None] | None = None

    def reset(self) -> None:
        """The weights changed: gather again at the next step."""
        self._args = None
        self._lora = None

    def lora(self, layers: nn.ModuleList) -> tuple[list[torch.Tensor], LoraBatch | None]:
        """Every layer's LoRA slots in loom::decoder_layers' order and the step's batch where every
        projection carries LoRA on Loom's kernels; ([], batch) where only some do (the modules
        apply them); ([], None) where none does."""
        if self._lora is None:
            linears = [p for layer in layers for p in _wrapped(layer)]
            wrapped = [p for p in linears if isinstance(p, LoraLinear)]
            if not wrapped:
                self._lora = ([], None)
            elif len(wrapped) == len(linears) and wrapped[0].batch.on_kernels:
                self._lora = ([t for p in wrapped for t in (p.lora_a, *p.lora_b)], wrapped[0].batch)
            else:
                self._lora = ([], wrapped[0].batch)
        return self._lora

    def args(self, layers: nn.ModuleList, plain_model: bool) -> FusedArgs:
        """Empty unless every layer is a plain Llama layer whose projections run on Loom's kernels
        (_on_kernels), bias-free but for qkv's (Qwen2), and the model adds nothing around them
        (`plain_model`); not under tensor parallelism, whose projections are nn.Linear."""
        if not self.enabled:
            return [], []
        if self._args is None:
            fused = list(layers) if plain_model and all(_fusable(layer) for layer in layers) else []
            self._args = ([t for layer in fused for t in _layer_tensors(layer)],
                          [layer.self_attn.qkv_proj.bias for layer in fused])
        return self._args

    def run(self, x: torch.Tensor, layers: nn.ModuleList, plain_model: bool, kv_cache: torch.Tensor,
            meta: AttentionMetadata | GroupedMetadata, rope: Rope, keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [num_tokens, hidden] through every layer in one call; None where it cannot run (then
        the modules do): the C++ rotary tables and the CPU paged kernel's single set of tables.
        keep: the token rows wanted (the last layer's projection and MLP run on those alone)."""
        paged = meta.paged
        if not isinstance(rope, KernelRope) or paged is None or paged.kernel is not paged_attention_cpu:
            return None
        weights, qkv_biases = self.args(layers, plain_model)
        if not weights:
            return None
        lora, batch = self.lora(layers)
        if batch is None or not batch.active:
            lora = []
        elif not lora:
            return None
        attn = layers[0].self_attn
        return kernels.ops().decoder_layers(
            x, weights, qkv_biases, kv_cache, meta.slot_mapping, rope.positions, rope.cos, rope.sin,
            paged.block_tables, paged.query_starts, paged.num_cached, attn.num_heads, attn.num_kv_heads,
            layers[0].mlp.intermediate_size, layers[0].input_layernorm.eps, lora,
            batch.token_slot if lora else None, batch.slot_ranks if lora else None, keep)


def _wrapped(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The layer's projections as the modules call them (LoraLinear where LoRA is on)."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _projections(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The layer's projections, without their LoRA wrappers."""
    return tuple(unwrap(p) for p in _wrapped(layer))  # type: ignore[return-value]


def _fusable(layer: DecoderLayer) -> bool:
    if not layer.is_plain or not isinstance(layer.mlp, GatedMLP) or layer.mlp.activation is not Activation.SILU:
        return False
    qkv, *rest = _projections(layer)
    if isinstance(qkv, SplitLinear):  # parts that start at q, k or v, as loom::decoder_layers splits it
        fits = set(qkv.starts) <= set(_qkv_starts(layer)) and all(map(_on_kernels, qkv.parts))
    else:
        fits = _on_kernels(qkv)
    return fits and all(map(_on_kernels, rest)) and all(p.bias is None for p in rest)  # qkv's: Qwen2


def _on_kernels(linear: nn.Module) -> bool:
    """A QuantLinear on Loom's kernels, or a PackedLinear on loom::linear (a dense weight where that
    is its GEMM: safetensors models, a GGUF's formats not kept quantized)."""
    if type(linear) is QuantLinear:
        return linear.uses_kernels
    return type(linear) is PackedLinear and linear.runs_loom_linear()


def _layer_tensors(layer: DecoderLayer) -> list[torch.Tensor]:
    """One layer's tensors in loom::decoder_layers' order."""
    qkv, *rest = _projections(layer)
    o, gate_up, down = (_kernel_tensors(p) for p in rest)
    return [layer.input_layernorm.weight, *_qkv_tensors(qkv, _qkv_starts(layer)), *o,
            layer.post_attention_layernorm.weight, *gate_up, *down]


def _qkv_starts(layer: DecoderLayer) -> list[int]:
    """Where q, k and v start in the qkv projection's output."""
    attn = layer.self_attn
    return [0, attn.num_heads * attn.head_dim, (attn.num_heads + attn.num_kv_heads) * attn.head_dim]


def _qkv_tensors(qkv: nn.Module, starts: list[int]) -> list[torch.Tensor]:
    """(packed weight, scales) for each of q, k and v: a part's at the output where it starts, the
    others empty (they run with the part before them)."""
    parts = dict(zip(qkv.starts, qkv.parts)) if isinstance(qkv, SplitLinear) else {0: qkv}
    empty = torch.empty(0, dtype=torch.float16)
    return [t for start in starts for t in (_kernel_tensors(parts[start]) if start in parts else (empty, empty))]


def _kernel_tensors(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales) as loom::decoder_layers takes a projection: no scales for loom::linear."""
    if isinstance(linear, QuantLinear):
        return linear.packed, linear.scales.view(torch.float16)
    assert isinstance(linear, PackedLinear)
    return linear.packed_weights(Gemm.LOOM)[0], torch.empty(0, dtype=torch.float16)
