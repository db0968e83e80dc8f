"""The decoder-only model every family builds: embeddings, decoder layers over a paged KV cache,
final norm and LM head. A family's file (llama.py, gemma.py, ...) says how its checkpoint names
map to these modules (`own_weights`) and which switches of `ModelConfig` it turns on.

It knows nothing of tensor parallelism or quantization: `loom_shard.loading.tensor_parallel` and
`loom_shard.loading.quantize` swap modules afterwards, and the attention reads its head counts from them.
"""

from __future__ import annotations

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.attention.cpu import paged_attention_cpu
from loom_shard.attention.metadata import AttentionMetadata, GroupedMetadata
from loom_shard.layers.decoder import DecoderLayer
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.moe import MoE
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.quant_linear import QuantLinear
from loom_shard.layers.rotary import KernelRope, RotaryEmbedding
from loom_shard.model_config import Activation, ModelConfig
from loom_shard.models.weights import fuse_hf_weights


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary, self.local_rotary = self._rotary_embeddings()
        self.use_fused_layers = True  # False: the modules below even where loom::decoder_layers can run
        self._fused: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None  # _fused_layer_args

    def _rotary_embeddings(self) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        c = self.config
        rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, rotary_dim=c.rotary_dim)
        local = None
        if c.local_rope_theta is not None:
            local = RotaryEmbedding(c.head_dim, c.local_rope_theta, None, rotary_dim=c.rotary_dim)
        return rotary, local

    @property
    def num_kv_heads(self) -> int:
        """KV heads this process holds (fewer than the config's under tensor parallelism)."""
        return self.layers[0].self_attn.num_kv_heads

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str] | None:
        """The checkpoint's names of one expert's gate, up and down projections, where its
        checkpoint stores experts one by one (Mixtral, Qwen3-MoE); None otherwise."""
        return None

    def held_experts(self) -> range:
        """The global ids of the experts this process holds (a tensor-parallel rank holds a range)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                experts = layer.mlp.experts
                return range(experts.expert_start, experts.expert_start + experts.num_experts)
        return range(0)

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | GroupedMetadata) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden] (before the norm).

        kv_cache: [num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]; `meta.layer(i)`
        names layer i's slot and metadata (one slot per layer unless KV groups share blocks).
        """
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_multiplier is not None:
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)  # rounded as transformers does
        rope = self.rotary.lookup(meta.positions, meta.max_position, x.dtype)
        paged = meta.paged
        if isinstance(rope, KernelRope) and paged is not None and paged.kernel is paged_attention_cpu:
            weights, qkv_biases = self._fused_layer_args()
            if weights:
                attn = self.layers[0].self_attn
                return kernels.ops().decoder_layers(
                    x, weights, qkv_biases, kv_cache, meta.slot_mapping, rope.positions, rope.cos, rope.sin,
                    paged.block_tables, paged.query_starts, paged.num_cached, attn.num_heads, attn.num_kv_heads,
                    self.layers[0].mlp.intermediate_size, self.layers[0].input_layernorm.eps)
        local_rope = rope
        if self.local_rotary is not None:
            local_rope = self.local_rotary.lookup(meta.positions, meta.max_position, x.dtype)
        for index, layer in enumerate(self.layers):
            slot, layer_meta = meta.layer(index)
            x = layer(x, local_rope if layer.uses_local_rope else rope, kv_cache[slot], layer_meta)
        return x

    def _fused_layer_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """loom::decoder_layers' weights and qkv biases (kernels/csrc/decoder.cpp): the layers'
        arithmetic in one C++ call, bit-identical to the modules. Empty unless every layer is a plain
        Llama layer whose projections are QuantLinears on Loom's kernels, bias-free but for qkv's
        (Qwen2); not under tensor parallelism, whose projections are nn.Linear."""
        if not self.use_fused_layers:
            return [], []
        if self._fused is None:
            layers = list(self.layers) if all(_fusable(layer) for layer in self.layers) else []
            if self.local_rotary is not None or self.config.embedding_multiplier is not None:
                layers = []
            self._fused = ([t for layer in layers for t in _layer_tensors(layer)],
                           [layer.self_attn.qkv_proj.bias for layer in layers])
        return self._fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        logits = self.lm_head(self.norm(hidden)).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this model's names (a family overrides it for its own)."""
        return fuse_hf_weights(weights)

    def load_weights(self, weights: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load Hugging Face named tensors, fusing q/k/v and gate/up. Raises on missing or unknown names.
        A parameter with a `weight_loader` (a tensor-parallel layer's) takes its share of the tensor.

        assign: take the tensors themselves as parameters (a model built on `meta`); the tied
        head and the rotary tables are then rebuilt on the weights' device.
        """
        self._fused = None  # rebuilt from the new tensors at the next forward
        own = self.own_weights(dict(weights))
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in own.items():  # a tensor-parallel layer cuts its share (tensor_parallel)
            loader = getattr(params.get(name), "weight_loader", None)
            if loader is not None:
                own[name] = loader(tensor)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=assign)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        if assign:
            if self.config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
            self.rotary, self.local_rotary = self._rotary_embeddings()


def _projections(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


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

