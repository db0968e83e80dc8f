"""Multi-LoRA step cost: a batch of decodes spread over several adapters against the same batch on
the base model, in the shard runner on the embedded SmolLM2-135M (Q4_1, Loom's kernels).

Run: python bench/bench_lora.py [--batch 32] [--adapters 8] [--rank 8] [--max-lora-rank 16] [--dtype bfloat16]
[--threads 2]
Adapters are random PEFT folders of SmolLM2's shapes targeting every projection (q, k, v, o, gate,
up, down). Each decode enters with 150-300 cached tokens (as bench_engine.py's). Reported: the mean
step time of each case (min over interleaved rounds) and the ratio adapters / base.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.bench_engine import BLOCK_SIZE, load_model  # noqa: E402
from bench.common import machine  # noqa: E402
from loom_proto.config import ShardConfig  # noqa: E402
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan  # noqa: E402
from loom_shard.runtime.model_setup import cpu_summary  # noqa: E402
from loom_shard.runtime.runner import ModelRunner  # noqa: E402

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder of these projection shapes (module -> (in, out)), every module targeted."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for owner, names in MODULES.items():
            for name in names:
                in_features, out_features = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{owner}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [n for names in MODULES.values() for n in names]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def decode_step_ms(runner: ModelRunner, lora_ids: list[int | None], num_steps: int) -> float:
    """Mean decode step time for len(lora_ids) requests (request i with adapter lora_ids[i])."""
    rng = random.Random(len(lora_ids))
    blocks_per_seq = -(-(300 + num_steps + 2) // BLOCK_SIZE)
    news = []
    for i, lora_id in enumerate(lora_ids):
        context = rng.randrange(150, 301)
        tokens = [rng.randrange(1000, 20000) for _ in range(context)]
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        news.append(NewRequest(i, tokens, context, context - 1, 1, table, SamplingParams(seed=i), lora_id=lora_id))
    runner.step(StepPlan(new_requests=news))
    plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(len(lora_ids))])
    runner.step(plan)  # warm
    start = time.perf_counter()
    for _ in range(num_steps):
        runner.step(plan)
    elapsed = time.perf_counter() - start
    runner.clear()
    return elapsed / num_steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=0, help="the slots' rank (default: --rank)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; {cpu_summary()}; {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    model, description = load_model(random_model=False, quantize="auto")
    print(f"model: {description}; dtype {args.dtype}")
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    config = ShardConfig(model_id="bench", uds_path="", dtype=args.dtype, block_size=BLOCK_SIZE, enable_lora=True,
                         max_loras_per_batch=args.adapters, max_lora_rank=args.max_lora_rank or args.rank)
    runner = ModelRunner(config, model=model)
    num_blocks = args.batch * -(-(300 + args.steps + 2) // BLOCK_SIZE) + 8
    runner.allocate_kv_cache(num_blocks, num_host_blocks=1).device_blocks.normal_(
        generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder:
        for lora_id in range(1, args.adapters + 1):
            runner.load_lora(lora_id, str(write_adapter(Path(folder) / str(lora_id), shapes, c.num_layers,
                                                        args.rank, lora_id)))
    cases = {"base model": [None] * args.batch,
             f"{args.adapters} adapters": [1 + i % args.adapters for i in range(args.batch)]}
    best: dict[str, float] = {}
    for _ in range(args.rounds):  # interleaved, min over rounds
        for name, lora_ids in cases.items():
            step_ms = decode_step_ms(runner, lora_ids, args.steps)
            best[name] = min(best.get(name, step_ms), step_ms)
    for name, step_ms in best.items():
        print(f"decode batch {args.batch:3d}, {name:12s}: {step_ms:7.2f} ms/step ({args.batch / step_ms * 1e3:6.1f} tokens/s)")
    base, lora = best["base model"], best[f"{args.adapters} adapters"]
    print(f"ratio {args.adapters} adapters (rank {args.rank}) / base model: {lora / base:.2f}x")


if __name__ == "__main__":
    main()
