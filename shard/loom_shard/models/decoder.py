"""The decoder-only model every family builds: embeddings, decoder layers over a paged KV cache,
final norm and LM head. A family's file (llama.py, gemma.py, ...) says how its checkpoint names
map to these modules (`own_weights`) and which switches of `ModelConfig` it turns on.

It knows nothing of tensor parallelism or quantization: `loom_shard.loading.tensor_parallel` and
`loom_shard.loading.quantize` swap modules afterwards, and the attention reads its head counts from them.
"""

from __future__ import annotations

import torch
from torch import nn

from loom_shard.attention.metadata import AttentionMetadata, GroupedMetadata
from loom_shard.layers.decoder import DecoderLayer
from loom_shard.layers.fused_layers import FusedLayers
from loom_shard.layers.moe import MoE
from loom_shard.layers.norm import RMSNorm
from loom_shard.layers.rotary import RotaryEmbedding
from loom_shard.model_config import ModelConfig
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
        self.fused_layers = FusedLayers()  # every layer in one C++ call where the layers allow it

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
                meta: AttentionMetadata | GroupedMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden] (before the norm);
        with `keep` (int64 token indices), those rows' alone, [len(keep), hidden] in its order.

        kv_cache: [num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]; `meta.layer(i)`
        names layer i's slot and metadata (one slot per layer unless KV groups share blocks).
        """
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_multiplier is not None:
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)  # rounded as transformers does
        rope = self.rotary.lookup(meta.positions, meta.max_position, x.dtype)
        plain = self.local_rotary is None and self.config.embedding_multiplier is None
        fused = self.fused_layers.run(x, self.layers, plain, kv_cache, meta, rope, keep)
        if fused is not None:
            return fused
        local_rope = rope
        if self.local_rotary is not None:
            local_rope = self.local_rotary.lookup(meta.positions, meta.max_position, x.dtype)
        for index, layer in enumerate(self.layers):
            slot, layer_meta = meta.layer(index)
            x = layer(x, local_rope if layer.uses_local_rope else rope, kv_cache[slot], layer_meta)
        return x if keep is None else x[keep]

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
        self.fused_layers.reset()  # gathered from the new tensors at the next forward
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

