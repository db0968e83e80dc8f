"""The embedded SmolLM2 through ModelRunner(ShardConfig) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.runtime.runner import ModelRunner

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3714, 28, 7018, 411, 19167, 2, 198, 1]


def loom_greedy(dtype: str, num_tokens: int, quantize: str = "none", device: str = "auto") -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from the embedded model through ModelRunner.

    quantize="none" (dequantized weights) is the parity reference; test_quantized_model.py
    judges the quantized weights against it.
    """
    config = ShardConfig(model_id="", uds_path="", device=device, dtype=dtype, block_size=16, quantize=quantize)
    runner = ModelRunner(config)
    runner.warmup(max_prefill_tokens=32, max_batch_total_tokens=256)
    plan = StepPlan(new_requests=[NewRequest(0, PROMPT, len(PROMPT), 0, len(PROMPT), [0, 1, 2], SamplingParams(seed=0))])
    tokens, logprobs = [], []
    for _ in range(num_tokens):
        out = runner.step(plan).outputs[0]
        tokens.append(out.token_id)
        logprobs.append(out.logprob)
        plan = StepPlan(running_requests=[RunningRequest(0, 1)])
    return tokens, logprobs


def transformers_greedy(num_tokens: int) -> tuple[list[int], list[float]]:
    """The float32 reference: transformers' Llama on the same dequantized weights."""
    from loom_shard.loading.loader import load_model_weights

    config, weights = load_model_weights("", torch.float32, progress=None)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(weights, strict=False)
    sequence, logprobs = list(PROMPT), []
    with torch.no_grad():  # plain argmax: generate() would stop early at the config's EOS
        for _ in range(num_tokens):
            logits = hf(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[sequence[-1]]))
    return sequence[len(PROMPT) :], logprobs


@pytest.mark.slow
def test_embedded_model_greedy_matches_transformers_in_float32() -> None:
    assert loom_greedy("float32", 8)[0] == transformers_greedy(8)[0]


@pytest.mark.slow
def test_embedded_model_in_bfloat16_stays_close_to_the_float32_reference() -> None:
    # The default CPU dtype is judged by closeness (MODEL-NOTES): greedy agreement on most of
    # the first tokens, and the chosen tokens' logprobs within bf16 rounding while they agree.
    tokens, logprobs = loom_greedy("bfloat16", 16)
    expected, expected_logprobs = transformers_greedy(16)
    agreed = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))
    assert agreed >= 8, (tokens, expected)
    assert max(abs(a - b) for a, b in zip(logprobs[:agreed], expected_logprobs[:agreed])) < 0.15
