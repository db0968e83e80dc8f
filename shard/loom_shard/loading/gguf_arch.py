"""What each llama.cpp GGUF architecture means (convert_hf_to_gguf.py's conventions): the family
switches its metadata implies, and where each Hugging Face tensor of the model lies in the file.

    llama (Mixtral too, with experts), qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, gpt-oss

Conventions undone here: Gemma's norms are stored as 1 + w; llama's q/k rows interleave each
head's rotary halves; experts are stacked per layer ([experts, rows, cols]); gpt-oss's gate and up
are split out of Hugging Face's interleaved gate_up; Phi-3's gate/up is one `ffn_up`; llama.cpp's
fixed choices (Gemma 3's 5:1 layer pattern and local rope base, Gemma 2's alternation) apply when
the metadata is silent.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from loom_shard.model_config import (
    Activation,
    ExpertActivation,
    LayerKind,
    LinearScaling,
    ModelConfig,
    MoEConfig,
    Routing,
    YarnScaling,
)

ARCHITECTURES = {  # GGUF general.architecture -> the Hugging Face architecture it holds
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's for Gemma 3's sliding layers when the file has none


class Combine(enum.Enum):
    """How a Hugging Face tensor is made of its GGUF sources."""

    ONE = "one"  # the (expert's slice of the) tensor itself
    INTERLEAVE_GATE_UP = "interleave_gate_up"  # gpt-oss: gate, up [E, I, H] -> gate_up [E, H, 2I], columns interleaved
    INTERLEAVE_BIAS = "interleave_bias"  # gpt-oss: gate, up biases [E, I] -> [E, 2I], interleaved
    TRANSPOSE = "transpose"  # gpt-oss: down [E, H, I] -> [E, I, H]


@dataclass(slots=True, frozen=True)
class Recipe:
    """Where one Hugging Face tensor lies in a GGUF file."""

    sources: tuple[str, ...]
    expert: int | None = None  # one expert of a stacked tensor
    shift: float = 0.0  # stored plus this (Gemma's norms): subtracted after reading
    unpermute: bool = False  # llama's q/k rows: undo the rotary interleave
    combine: Combine = Combine.ONE


class Metadata:
    """A GGUF file's metadata, read with its architecture's prefix."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)


def family_config(meta: Metadata, base: ModelConfig) -> ModelConfig:
    """`base` (the fields every architecture writes alike) with the architecture's switches."""
    arch = meta.arch
    if arch == "qwen2":
        return replace(base, attention_bias=True)
    if arch in ("qwen3", "qwen3moe"):
        config = replace(base, qk_norm=True)
        return replace(config, moe=_moe(meta, base, renormalize=bool(meta.get("expert_weights_norm", True)))) \
            if arch == "qwen3moe" else config
    if arch == "llama" and meta.get("expert_count"):
        return replace(base, architecture="MixtralForCausalLM", moe=_moe(meta, base, renormalize=True))
    if arch in ("gemma2", "gemma3"):
        return _gemma(meta, base)
    if arch == "phi3":
        window = meta.get("attention.sliding_window")
        return replace(base, sliding_window=int(window) if window else None)
    if arch == "gpt-oss":
        moe = replace(_moe(meta, base, renormalize=False), routing=Routing.TOPK_SOFTMAX, router_bias=True,
                      expert_bias=True, activation=ExpertActivation.CLAMPED_SWIGLU)
        return replace(base, attention_bias=True, o_proj_bias=True, attention_sinks=True, moe=moe,
                       sliding_window=int(meta.get("attention.sliding_window", 128)),
                       layer_kinds=_alternating(base.num_layers, 2))
    return base


def _moe(meta: Metadata, base: ModelConfig, renormalize: bool) -> MoEConfig:
    intermediate = int(meta.get("expert_feed_forward_length") or base.intermediate_size)
    return MoEConfig(num_experts=int(meta.get("expert_count")), num_experts_per_tok=int(meta.get("expert_used_count")),
                     intermediate_size=intermediate, renormalize=renormalize)


def _alternating(num_layers: int, pattern: int) -> tuple[LayerKind, ...]:
    """Every `pattern`-th layer global, the others sliding (llama.cpp's swa pattern)."""
    return tuple(LayerKind.SLIDING if (i + 1) % pattern else LayerKind.FULL for i in range(num_layers))


def _gemma(meta: Metadata, base: ModelConfig) -> ModelConfig:
    gemma3 = meta.arch == "gemma3"
    pattern = int(meta.get("attention.sliding_window_pattern") or (6 if gemma3 else 2))
    # llama.cpp's attention scale: 1 / sqrt(hidden / heads) for the 27B models, 1 / sqrt(head_dim) otherwise
    is_27b = base.num_layers == (62 if gemma3 else 46)
    scalar = base.hidden_size / base.num_heads if is_27b else base.head_dim
    window = meta.get("attention.sliding_window")
    config = replace(
        base, sandwich_norms=True, activation=Activation.GELU_TANH, embedding_multiplier=math.sqrt(base.hidden_size),
        attention_scale=float(meta.get("attention.scale") or scalar**-0.5),
        attn_logit_softcap=meta.get("attn_logit_softcapping"), final_logit_softcap=meta.get("final_logit_softcapping"),
        sliding_window=int(window) if window else None, layer_kinds=_alternating(base.num_layers, pattern))
    if gemma3:
        config = replace(config, qk_norm=True,
                         local_rope_theta=float(meta.get("rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA))
    return config


def rope_scaling(meta: Metadata) -> LinearScaling | YarnScaling | None:
    """The scaling `{arch}.rope.scaling.*` describes (Llama 3's and LongRoPE's come from tensors).
    Raises ValueError for a kind Loom does not run."""
    kind = meta.get("rope.scaling.type") or "none"
    if kind == "none":
        return None
    factor = float(meta.get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return LinearScaling(factor)
    if kind == "yarn":
        return YarnScaling(factor, int(meta.get("rope.scaling.original_context_length")),
                           float(meta.get("rope.scaling.yarn_beta_fast") or 32.0),
                           float(meta.get("rope.scaling.yarn_beta_slow") or 1.0),
                           truncate=meta.arch != "gpt-oss")  # gpt-oss's own config says truncate false
    raise ValueError(f"unsupported rope scaling type {kind!r}")


_LAYER = {  # Hugging Face suffix -> GGUF suffix, for every architecture
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_BY_ARCH = {  # what differs
    "gemma2": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"},
    "llama": {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight"},
    "qwen3moe": {"mlp.gate.weight": "ffn_gate_inp.weight"},
}
_BY_ARCH["gemma3"] = _BY_ARCH["gemma2"]
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_SOURCE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_GPT_OSS_EXPERTS = {
    "mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "ffn_up_exps.weight"), Combine.INTERLEAVE_GATE_UP),
    "mlp.experts.gate_up_proj_bias": (("ffn_gate_exps.bias", "ffn_up_exps.bias"), Combine.INTERLEAVE_BIAS),
    "mlp.experts.down_proj": (("ffn_down_exps.weight",), Combine.TRANSPOSE),
    "mlp.experts.down_proj_bias": (("ffn_down_exps.bias",), Combine.ONE),
}


def recipe(arch: str, hf_name: str) -> Recipe | None:
    """Where `hf_name` lies in a GGUF file of `arch`; None when this convention has no place for it."""
    gemma = arch in ("gemma2", "gemma3")
    if hf_name in _GLOBAL:
        shift = 1.0 if gemma and hf_name == "model.norm.weight" else 0.0
        return Recipe((_GLOBAL[hf_name],), shift=shift)
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if match is None:
        return None
    layer, rest = match.groups()
    block = f"blk.{layer}."
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        return Recipe((f"{block}ffn_{_EXPERT_SOURCE[expert.group(2)]}_exps.weight",), expert=int(expert.group(1)))
    if arch == "gpt-oss" and rest in _GPT_OSS_EXPERTS:
        sources, combine = _GPT_OSS_EXPERTS[rest]
        return Recipe(tuple(block + s for s in sources), combine=combine)
    name = _BY_ARCH.get(arch, {}).get(rest) or _LAYER.get(rest)
    if name is None:
        return None
    return Recipe((block + name,), shift=1.0 if gemma and rest.endswith("norm.weight") else 0.0,
                  unpermute=arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
