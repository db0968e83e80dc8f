"""The embedded SmolLM2 through ModelRunner(ShardConfig) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from loom.common.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom.shard.config import ShardConfig
from loom.shard.runner import ModelRunner

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3714, 28, 7018, 411, 19167, 2, 198, 1]


@pytest.mark.slow
def test_embedded_model_greedy_matches_transformers_in_float32() -> None:
    from loom.shard.loader import load_model_weights

    runner = ModelRunner(ShardConfig(model_id="", uds_path="", dtype="float32", block_size=16))
    runner.warmup(max_prefill_tokens=32, max_batch_total_tokens=256)
    plan = StepPlan(new_requests=[NewRequest(0, PROMPT, len(PROMPT), 0, len(PROMPT), [0, 1, 2], SamplingParams(seed=0))])
    tokens = []
    for _ in range(8):
        tokens.append(runner.step(plan).outputs[0].token_id)
        plan = StepPlan(running_requests=[RunningRequest(0, 1)])
    config, weights = load_model_weights("", torch.float32, progress=None)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(weights, strict=False)
    expected = list(PROMPT)
    with torch.no_grad():  # plain argmax: generate() would stop early at the config's EOS
        for _ in range(8):
            expected.append(int(hf(torch.tensor([expected])).logits[0, -1].argmax()))
    assert tokens == expected[len(PROMPT) :]
