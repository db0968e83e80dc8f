"""Tiny GGUF files written from tiny Hugging Face models the way llama.cpp's convert_hf_to_gguf.py
writes each architecture, names from gguf-py's own tensor map (not Loom's): norms + 1 for Gemma,
llama's q/k rows permuted, experts stacked per layer, gpt-oss's gate_up split, Phi-3's rope factors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from tests.unit.shard.k_quants import WRITERS

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "gpt_oss": "gpt-oss"}
_MODEL_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def write_family_gguf(path: Path, kind: str, hf: transformers.PreTrainedModel,
                      experts_as: gguf.GGMLQuantizationType | None = None,
                      down_experts_as: gguf.GGMLQuantizationType | None = None) -> None:
    """The model as its architecture's GGUF in float32; experts in `experts_as` when given, their
    down projections in `down_experts_as` when that is given too (as Q4_K_M's Q6_K ones)."""
    arch = GGUF_ARCH[kind]
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, kind, hf.config)
    for name, array in _tensors(kind, arch, hf).items():
        if experts_as is not None and "_exps.weight" in name:
            as_kind = down_experts_as if down_experts_as and "ffn_down_exps" in name else experts_as
            writer.add_tensor(name, _quantize(array, as_kind), raw_dtype=as_kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantize(array: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    if kind not in WRITERS:
        return gguf.quants.quantize(array, kind)
    rows = WRITERS[kind](array.reshape(-1, array.shape[-1]))  # gguf-py does not write K-quants
    return rows.reshape(*array.shape[:-1], rows.shape[-1])


def _metadata(writer: gguf.GGUFWriter, kind: str, c: transformers.PretrainedConfig) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if kind in ("mixtral", "qwen3_moe", "gpt_oss"):
        writer.add_expert_count(c.num_local_experts if kind != "qwen3_moe" else c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if kind == "qwen3_moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(c.norm_topk_prob)
    if kind == "gpt_oss":
        writer.add_expert_feed_forward_length(c.intermediate_size)
        writer.add_sliding_window(c.sliding_window)
        scaling = c.rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    if kind == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        if c.rope_scaling and c.rope_scaling.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(c.rope_scaling["factor"])
    if kind == "phi3":
        writer.add_rope_dimension_count(int(c.partial_rotary_factor * c.hidden_size) // c.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(c.original_max_position_embeddings))))


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tensors(kind: str, arch: str, hf: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    c = hf.config
    state = {n: t.detach().float() for n, t in hf.state_dict().items()}
    if getattr(c, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    hf_named: dict[str, torch.Tensor] = {}
    for layer in range(c.num_hidden_layers):
        hf_named.update(_experts(kind, layer, state))
    hf_named.update(state)
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], c.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, tensor in hf_named.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if name.endswith("q_proj.weight") else c.num_key_value_heads
            tensor = torch.from_numpy(_permute(tensor.numpy(), heads))
        if name.endswith(".sinks"):
            name += ".weight"
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = tensor.numpy()
    if kind == "phi3" and c.rope_scaling:
        out["rope_factors_long.weight"] = np.array(c.rope_scaling["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(c.rope_scaling["short_factor"], dtype=np.float32)
    return out


def _experts(kind: str, layer: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pop one layer's experts from `state`, stacked and named as the convert script merges them."""
    p = f"model.layers.{layer}."
    if kind == "mixtral":
        return {f"{p}block_sparse_moe.experts.{w}.weight": _stack(state, f"{p}block_sparse_moe.experts.{{}}.{w}.weight")
                for w in ("w1", "w2", "w3")}
    if kind == "qwen3_moe" and f"{p}mlp.experts.0.gate_proj.weight" in state:
        return {f"{p}mlp.experts.{w}.weight": _stack(state, f"{p}mlp.experts.{{}}.{w}.weight")
                for w in ("gate_proj", "up_proj", "down_proj")}
    if kind == "gpt_oss":
        gate_up = state.pop(f"{p}mlp.experts.gate_up_proj").transpose(-1, -2)  # [E, 2I, H], gate/up interleaved
        bias = state.pop(f"{p}mlp.experts.gate_up_proj_bias")
        return {f"{p}mlp.experts.gate_proj.weight": gate_up[:, ::2], f"{p}mlp.experts.up_proj.weight": gate_up[:, 1::2],
                f"{p}mlp.experts.gate_proj.bias": bias[..., ::2], f"{p}mlp.experts.up_proj.bias": bias[..., 1::2],
                f"{p}mlp.experts.down_proj.weight": state.pop(f"{p}mlp.experts.down_proj").transpose(-1, -2),
                f"{p}mlp.experts.down_proj.bias": state.pop(f"{p}mlp.experts.down_proj_bias")}
    return {}


def _stack(state: dict[str, torch.Tensor], pattern: str) -> torch.Tensor:
    experts = []
    while pattern.format(len(experts)) in state:
        experts.append(state.pop(pattern.format(len(experts))))
    return torch.stack(experts)
