"""Multi-LoRA on CUDA: a step mixing three adapters and the base model gives each sequence the greedy
tokens of transformers + peft with its adapter merged (float32), with the decode steps that have
no adapter token still replayed as CUDA graphs."""

from __future__ import annotations

import copy

import torch

from loom_proto.config import ShardConfig
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import make_pair, random_tokens
from tests.unit.shard.lora_adapters import ATTENTION, MLP, greedy, merged_model, write_adapter
from tests.unit.shard.test_lora_runner import BLOCK_SIZE, NUM_NEW, _run


def test_mixed_adapters_on_cuda_match_merged_peft(tmp_path) -> None:
    pair = make_pair("llama")
    adapters = {1: write_adapter(pair.hf, tmp_path / "all", seed=1),
                2: write_adapter(pair.hf, tmp_path / "attn", seed=2, rank=8, targets=ATTENTION),
                3: write_adapter(pair.hf, tmp_path / "mlp", seed=3, rank=2, targets=MLP)}
    config = ShardConfig(model_id="tiny", uds_path="", dtype="float32", block_size=BLOCK_SIZE, device="cuda",
                         enable_lora=True, max_loras_per_batch=4, max_lora_rank=8)
    runner = ModelRunner(config, model=copy.deepcopy(pair.loom))
    with torch.inference_mode():
        runner.allocate_kv_cache(num_blocks=64, num_host_blocks=0)
    for lora_id, folder in adapters.items():
        runner.load_lora(lora_id, str(folder))
    prompts = {10: (random_tokens(9, 1), None), 11: (random_tokens(5, 2), 1), 12: (random_tokens(12, 3), 2),
               13: (random_tokens(7, 4), 3)}
    generated = _run(runner, prompts)
    for rid, (prompt, lora_id) in prompts.items():
        reference = pair.hf if lora_id is None else merged_model(pair.hf, adapters[lora_id])
        assert generated[rid] == greedy(reference, prompt, NUM_NEW), f"request {rid} (adapter {lora_id})"
    base_only = _run(runner, {20: (random_tokens(9, 1), None)})
    assert base_only[20] == generated[10]
