"""From a checkpoint's tensor names to the model's: the fusions every family shares (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`) and the stacking of per-expert tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loom_shard.model_config import ModelConfig

Shapes = dict[str, tuple[int, ...]]

FUSED = {  # our fused parameter -> the Hugging Face parts, concatenated in this order
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_PART_NAMES = frozenset(s for sources in FUSED.values() for s in sources)


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
        for fused, sources in FUSED.items():
            found = [parts.pop(f"{name}.{s}", None) for s in sources]
            if all(t is not None for t in found):
                own[f"{name}.{fused}"] = torch.cat(found)
            elif any(t is not None for t in found):
                raise ValueError(f"{name}: only some of {sources} are present")
    if parts:
        raise ValueError(f"unexpected projection weights: {sorted(parts)}")
    return own


ExpertNames = Callable[[int, int], tuple[str, str, str]]  # (layer, expert) -> its gate, up, down names


def stack_experts(weights: dict[str, torch.Tensor], num_layers: int, num_experts: int, held: range,
                  names: ExpertNames) -> dict[str, torch.Tensor]:
    """Pop every per-expert gate/up/down tensor ([intermediate, hidden] twice, [hidden, intermediate])
    and stack those of the `held` experts into "layers.<i>.mlp.experts.w13" (gate rows, then up
    rows) and "w2". The others (another tensor-parallel rank's, read empty) are dropped; layers
    without experts are skipped."""
    own: dict[str, torch.Tensor] = {}
    for layer in range(num_layers):
        if names(layer, 0)[0] not in weights:
            continue
        w13, w2 = [], []
        for expert in range(num_experts):
            gate, up, down = (weights.pop(n) for n in names(layer, expert))
            if expert in held:
                w13.append(torch.cat([gate, up]))
                w2.append(down)
        own[f"layers.{layer}.mlp.experts.w13"] = torch.stack(w13)
        own[f"layers.{layer}.mlp.experts.w2"] = torch.stack(w2)
    return own


def hf_shapes(config: ModelConfig, mlp: Callable[[str, int], Shapes], fused_qkv: bool = False) -> Shapes:
    """The checkpoint's tensor names and shapes in Hugging Face's Llama naming, which the families
    share for embeddings, attention and norms; `mlp(prefix, layer)` names each layer's feed-forward.
    fused_qkv: q/k/v stored as one `qkv_proj` (Phi-3)."""
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim, head_dim = config.num_kv_heads * config.head_dim, config.head_dim
    shapes: Shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        if fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_dim + 2 * kv_dim, hidden)
        else:
            for part, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                shapes[p + f"self_attn.{part}_proj.weight"] = (rows, hidden)
                if config.attention_bias:
                    shapes[p + f"self_attn.{part}_proj.bias"] = (rows,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_heads,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[p + "post_feedforward_layernorm.weight"] = (hidden,)
        shapes.update(mlp(p, i))
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def dense_mlp_shapes(config: ModelConfig) -> Callable[[str, int], Shapes]:
    """A Llama MLP's three projections."""
    hidden, inter = config.hidden_size, config.intermediate_size

    def shapes(prefix: str, layer: int) -> Shapes:
        return {prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter)}

    return shapes
