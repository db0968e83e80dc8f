"""Tiny random Hugging Face models of every family Loom serves, with sliding windows shorter than
the tests' prompts, small enough to run many times on a CPU."""

from __future__ import annotations

import torch
import transformers

WINDOW = 8  # sliding windows: every test prompt is longer
BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.2,  # transformers' 0.02 makes most tiny random models repeat one token
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so positions < 64 cross all three bands
}
LONGROPE_ORIGINAL = 32  # Phi-3's trained context in the tiny model: the test prompts are longer


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}


def hf_config(kind: str) -> transformers.PretrainedConfig:
    """The transformers config of one tiny test model (`KINDS` lists them)."""
    t = transformers
    if kind == "llama":
        return t.LlamaConfig(**BASE)
    if kind == "llama3":
        return t.LlamaConfig(**BASE, rope_scaling=LLAMA3_SCALING)
    if kind in ("llama_yarn", "llama_linear", "llama_dynamic"):
        scaling = {"llama_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                   "llama_linear": {"rope_type": "linear", "factor": 4.0},
                   "llama_dynamic": {"rope_type": "dynamic", "factor": 4.0}}[kind]
        return t.LlamaConfig(**BASE, rope_scaling=scaling)
    if kind == "qwen2":
        return t.Qwen2Config(**BASE, tie_word_embeddings=True)
    if kind == "mistral":
        return t.MistralConfig(**BASE, sliding_window=WINDOW)
    if kind == "qwen3":
        return t.Qwen3Config(**BASE, head_dim=16)
    if kind == "qwen3_window":  # layers from max_window_layers on slide
        return t.Qwen3Config(**BASE, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if kind == "gemma2":
        return t.Gemma2Config(**{**BASE, "initializer_range": 0.02}, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=5.0)
    if kind == "gemma3":  # five sliding layers, then a global one
        return t.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 6, "rope_theta": 1e6}, head_dim=16,
                                  sliding_window=WINDOW, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    if kind == "phi3":  # LongRoPE past a short trained context, 3/4 of each head rotated
        return t.Phi3Config(**BASE, partial_rotary_factor=0.75, original_max_position_embeddings=LONGROPE_ORIGINAL,
                            rope_scaling=_longrope(12), pad_token_id=0)
    if kind == "phi3_short":  # the context is the trained one: LongRoPE's short factors
        return t.Phi3Config(**BASE, original_max_position_embeddings=BASE["max_position_embeddings"],
                            rope_scaling=_longrope(16), pad_token_id=0)
    if kind == "phi3_window":
        return t.Phi3Config(**BASE, sliding_window=WINDOW, pad_token_id=0)
    if kind == "mixtral":
        return t.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen3_moe":  # layer 1 keeps a dense MLP
        return t.Qwen3MoeConfig(**{**BASE, "num_hidden_layers": 3}, head_dim=16, moe_intermediate_size=32,
                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1])
    if kind == "gpt_oss":
        return t.GptOssConfig(**{**BASE, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=WINDOW)
    raise ValueError(kind)


ARCHITECTURE = {
    "llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "llama_yarn": "LlamaForCausalLM",
    "llama_linear": "LlamaForCausalLM", "llama_dynamic": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_window": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "phi3_short": "Phi3ForCausalLM", "phi3_window": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
KINDS = list(ARCHITECTURE)


def hf_model(kind: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """The tiny model with random weights (norms, biases and sinks too), eager attention (the
    reference: transformers' SDPA path ignores Gemma 2's softcap), in float32; `overrides` set
    config attributes."""
    torch.manual_seed(seed)
    config = hf_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [ARCHITECTURE[kind]]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(model)
    return model


def randomize(model: torch.nn.Module) -> None:
    # Norm weights start at 1.0 (Gemma's at 0), biases and sinks at 0: random ones catch a norm
    # applied to the wrong tensor, a dropped bias or sink.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn_like(p))
