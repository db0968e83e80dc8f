"""The architecture of a decoder-only model, as the loaders read it and the model builds it.

Every family (Llama, Qwen, Gemma, Phi-3, Mixtral, gpt-oss) is the same decoder with switches:
the defaults are Llama's, and a family's config turns on what it has (QK-norm, Gemma's extra
norms, sliding-window layers, softcapping, attention sinks, mixture-of-experts feed-forwards).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Llama3Scaling:
    """Llama-3.1 rope scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, frozen=True)
class LinearScaling:
    """Positions divided by `factor` ("linear"; Gemma 3's global layers)."""

    factor: float


@dataclass(slots=True, frozen=True)
class DynamicScaling:
    """Dynamic NTK ("dynamic"): the base grows for positions past the trained context."""

    factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, frozen=True)
class YarnScaling:
    """YaRN ("yarn"; gpt-oss, Qwen long context): interpolated low frequencies, scaled attention."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1
    truncate: bool = True


@dataclass(slots=True, frozen=True)
class LongRopeScaling:
    """LongRoPE ("longrope"/"su"; Phi-3, Phi-4): per-frequency factors and a scaled attention. The
    long factors serve every position when the model's context exceeds the trained one, the short
    ones otherwise (vLLM's choice: one rotation per position, so cached keys never go stale)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    max_position_embeddings: int
    attention_factor: float

    @property
    def uses_long_factors(self) -> bool:
        return self.max_position_embeddings > self.original_max_position_embeddings


RopeScaling = Llama3Scaling | LinearScaling | DynamicScaling | YarnScaling | LongRopeScaling


class Activation(enum.Enum):
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


class LayerKind(enum.Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"


class Routing(enum.Enum):
    """How a mixture-of-experts router turns its logits into expert weights."""

    SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, keep the top k (Mixtral, Qwen3-MoE)
    TOPK_SOFTMAX = "topk_softmax"  # keep the top k logits, softmax over them (gpt-oss)


class ExpertActivation(enum.Enum):
    SILU = "silu"  # silu(gate) * up
    CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss: clamp, gate * sigmoid(1.702 gate) * (up + 1)


@dataclass(slots=True, frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per expert
    routing: Routing = Routing.SOFTMAX_TOPK
    renormalize: bool = True  # SOFTMAX_TOPK: the kept weights sum to 1
    router_bias: bool = False
    expert_bias: bool = False
    activation: ExpertActivation = ExpertActivation.SILU
    dense_layers: frozenset[int] = frozenset()  # layers with a plain MLP instead (Qwen3-MoE mlp_only_layers)

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")
        if self.intermediate_size <= 0:
            raise ValueError(f"expert intermediate_size must be positive, got {self.intermediate_size}")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # registry key, e.g. "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2, gpt-oss)
    # -- what the newer families switch on (defaults: Llama) --
    o_proj_bias: bool = False  # gpt-oss
    rotary_dim: int | None = None  # rotated dims of each head (Phi-4-mini rotates 3/4); None: all
    local_rope_theta: float | None = None  # Gemma 3: sliding layers' own rope base, unscaled
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2, 3)
    activation: Activation = Activation.SILU
    embedding_multiplier: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_logit_softcap: float | None = None  # Gemma 2
    attention_sinks: bool = False  # gpt-oss: one learnt logit per head joins each softmax
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_kinds: tuple[LayerKind, ...] | None = None  # per layer; None: all sliding with a window, else full
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 1..head_dim {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_kinds is not None and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, None where it attends to every earlier key."""
        if self.sliding_window is None:
            return None
        if self.layer_kinds is None or self.layer_kinds[layer] is LayerKind.SLIDING:
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers
