"""How often a greedy request's tokens are the same alone and in a batch, per CPU
attention backend, on the shard runner with the embedded model.

Run: python bench/bench_agreement.py [--requests 8] [--new-tokens 32] [--dtype bfloat16]
Each request decodes alone (its own prefill, then one token per step), then all of them together
(prefills in one step, then decodes in one batch). Prints, per backend, how many requests gave the
same tokens and where the first difference came. Attention is one of several reductions on the
path (the linears are the others), so this measures the whole step, not the kernel alone.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import BLOCK_SIZE, load_model, make_runner  # noqa: E402

from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan  # noqa: E402
from loom_shard.attention.backend import TorchBackend  # noqa: E402


def generate(runner, prompts: dict[int, list[int]], new_tokens: int, blocks_per_seq: int) -> dict[int, list[int]]:  # noqa: ANN001
    news = [NewRequest(i, p, len(p), 0, len(p), list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                       SamplingParams(seed=i)) for i, p in prompts.items()]
    out = {i: [] for i in prompts}
    result = runner.step(StepPlan(new_requests=news))
    for _ in range(new_tokens):
        for o in result.outputs:
            out[o.request_id].append(o.token_id)
        result = runner.step(StepPlan(running_requests=[RunningRequest(i, 1) for i in prompts]))
    runner.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, description = load_model(random_model=False)
    print(f"model: {description}, {args.dtype}, {args.requests} requests x {args.new_tokens} greedy tokens")
    rng = random.Random(0)
    prompts = {i: [rng.randrange(1000, 20000) for _ in range(rng.randrange(20, 120))] for i in range(args.requests)}
    blocks_per_seq = -(-(120 + args.new_tokens + 1) // BLOCK_SIZE)
    runner = make_runner(model, args.dtype, args.requests * blocks_per_seq + 1)
    for name, backend in {"default": runner.attention, "torch": TorchBackend(runner.device)}.items():
        runner.attention = backend
        alone = {i: generate(runner, {i: p}, args.new_tokens, blocks_per_seq)[i] for i, p in prompts.items()}
        together = generate(runner, prompts, args.new_tokens, blocks_per_seq)
        same = [i for i in prompts if alone[i] == together[i]]
        firsts = [next(t for t, (a, b) in enumerate(zip(alone[i], together[i])) if a != b) for i in prompts if i not in same]
        print(f"[{backend.kind.value}] {len(same)}/{len(prompts)} identical alone vs batched; first differences at tokens {firsts}")


if __name__ == "__main__":
    main()
