"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

It knows nothing of tensor parallelism: `loom_shard.tensor_parallel` reshapes the
projections afterwards and the attention reads its head counts from the module.
"""

from __future__ import annotations

import torch
from torch import nn

from loom_shard import kernels
from loom_shard.attention import AttentionMetadata, paged_attention
from loom_shard.cpu_attention import paged_attention_cpu
from loom_shard.layers.mlp import GatedMLP
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.quant_linear import QuantLinear
from loom_shard.layers.rotary import KernelRope, Rope, RotaryEmbedding
from loom_shard.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk = rope.apply(qkv[:, :num_qk_heads])  # [num_tokens, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, num_qk_heads:]
        return self.o_proj(paged_attention(q, k, v, kv_layer, meta))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.use_fused_layers = True  # False: the modules below even where loom::decoder_layers can run
        self._fused: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None  # _fused_layer_args

    @property
    def num_kv_heads(self) -> int:
        """KV heads this process holds (fewer than the config's under tensor parallelism)."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden] (before the norm).

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        """
        x = self.embed_tokens(input_ids)
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
        for layer, kv_layer in zip(self.layers, kv_cache):
            x = layer(x, rope, kv_layer, meta)
        return x

    def _fused_layer_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """loom::decoder_layers' weights and qkv biases (kernels/csrc/decoder.cpp): the layers'
        arithmetic in one C++ call, bit-identical to the modules. Empty unless every projection is a
        QuantLinear on Loom's kernels, bias-free but for qkv's (Qwen2); not under tensor
        parallelism, whose projections are nn.Linear."""
        if not self.use_fused_layers:
            return [], []
        if self._fused is None:
            layers = list(self.layers) if all(_fusable(layer) for layer in self.layers) else []
            self._fused = ([t for layer in layers for t in _layer_tensors(layer)],
                           [layer.self_attn.qkv_proj.bias for layer in layers])
        return self._fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        return self.lm_head(self.norm(hidden)).float()

    def load_weights(self, weights: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load Hugging Face named tensors, fusing q/k/v and gate/up. Raises on missing or unknown names.

        assign: take the tensors themselves as parameters (a model built on `meta`); the tied
        head and the rotary table are then rebuilt on the weights' device.
        """
        self._fused = None  # rebuilt from the new tensors at the next forward
        own = fuse_hf_weights(weights)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=assign)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        if assign:
            if self.config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
            c = self.config
            self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling).to(self.embed_tokens.weight.device)


def _projections(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _fusable(layer: DecoderLayer) -> bool:
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


_FUSED = {  # our fused parameter -> the Hugging Face parts, concatenated in this order
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fuse_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to this model's names, concatenating the fused projections."""
    own: dict[str, torch.Tensor] = {}
    parts: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        local = name.removeprefix("model.")
        if local.startswith("layers.") and local.split(".", 2)[2] in _PART_NAMES:
            parts[local] = tensor
        else:
            own[local] = tensor
    for name in {".".join(n.split(".")[:2]) for n in parts}:  # "layers.<i>"
        for fused, sources in _FUSED.items():
            found = [parts.pop(f"{name}.{s}", None) for s in sources]
            if all(t is not None for t in found):
                own[f"{name}.{fused}"] = torch.cat(found)
            elif any(t is not None for t in found):
                raise ValueError(f"{name}: only some of {sources} are present")
    if parts:
        raise ValueError(f"unexpected projection weights: {sorted(parts)}")
    return own


_PART_NAMES = frozenset(s for sources in _FUSED.values() for s in sources)
