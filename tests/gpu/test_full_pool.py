"""Warmup sizes the pool from free memory after the largest prefill and decode batch; then the
whole pool filled with long sequences, decoded at the widest graph batch, must not run out of
memory (the paged kernel gathers nothing, so a step's memory does not grow with context)."""

from __future__ import annotations

import torch

from loom_proto.config import ShardConfig
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_shard.loading.hf_folder import config_from_hf
from loom_shard.models import build_model
from loom_shard.runtime.cuda_graphs import MAX_GRAPH_SEQS
from loom_shard.runtime.runner import ModelRunner

SMOLLM2_SHAPES = dict(  # the embedded model's architecture, random weights
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)
MAX_PREFILL = 4096


def test_filled_pool_at_max_batch_does_not_oom() -> None:
    torch.manual_seed(0)
    config = ShardConfig(model_id="random", uds_path="", device="cuda", dtype="bfloat16", block_size=16,
                         memory_fraction=0.04, host_kv_cache_bytes=0)
    runner = ModelRunner(config, model=build_model(config_from_hf(SMOLLM2_SHAPES)))
    num_blocks = runner.warmup(max_prefill_tokens=MAX_PREFILL).num_blocks
    batch = MAX_GRAPH_SEQS
    blocks_per_seq = min(num_blocks // batch, 8192 // 16)
    assert blocks_per_seq >= 4, f"pool of {num_blocks} blocks too small for the test"
    prompt_len = blocks_per_seq * 16 - 8  # leaves room for 8 decoded tokens: the pool is full
    greedy = SamplingParams(seed=0)
    per_step = max(1, MAX_PREFILL // prompt_len)
    for first in range(0, batch, per_step):
        news = [NewRequest(i, [(i * 7 + t) % 49152 for t in range(prompt_len)], prompt_len, 0, prompt_len,
                           list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), sampling=greedy)
                for i in range(first, min(first + per_step, batch))]
        runner.step(StepPlan(new_requests=news))
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(batch)])
    assert runner.step_graphs is not None
    replays = runner.step_graphs.num_replays  # the prefill steps' (each within the largest graph)
    for _ in range(7):
        outputs = runner.step(plan).outputs
        assert len(outputs) == batch and all(o.token_id is not None for o in outputs)
    assert runner.step_graphs.num_replays == replays + 7
