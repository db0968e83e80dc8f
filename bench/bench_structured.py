"""Cost of constrained decoding at batch 32: the router's bitmask computation (llguidance,
the real tokenizer) plus the shard's masked step, against the same step unconstrained.

Run: python bench/bench_structured.py [--batch 32] [--steps 16] [--threads 2] [--random-model]
Steps of the two kinds alternate, so load from other processes hits both alike. Every
constrained sequence has its own matcher (a JSON schema with strings, enums, an array and
a nested object), advanced with the token the shard sampled; a finished one starts over.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, load_model, make_runner  # noqa: E402

from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan  # noqa: E402
from loom_router.structured.grammar import ConstraintSpec, GrammarCompiler, MaskFiller  # noqa: E402
from loom_router.tokenizer import load_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"type": "string"}},
        "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "mood", "age", "pets", "home"],
}
CONSTRAINED_BASE = 1000  # request ids of the constrained set


def admit(runner, batch: int, first_id: int, first_block: int, blocks_per_seq: int) -> None:  # noqa: ANN001
    rng = random.Random(first_id)
    news = []
    for i in range(batch):
        context = rng.randrange(150, 301)
        tokens = [rng.randrange(1000, 20000) for _ in range(context)]
        table = list(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq))
        sampling = SamplingParams(seed=first_id + i, do_sample=True, temperature=1.0)
        news.append(NewRequest(first_id + i, tokens, context, context - 1, 1, table, sampling))
    runner.step(StepPlan(new_requests=news))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random-model", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} (other processes share these cores)")
    bench_sampler(args.batch)
    model, description = load_model(args.random_model)
    compiler = GrammarCompiler(load_tokenizer(""))
    start = time.perf_counter()
    grammar = compiler.compile(ConstraintSpec.json_schema(SCHEMA))
    print(f"model: {description}; schema compiled in {(time.perf_counter() - start) * 1e3:.0f} ms "
          f"(with the llguidance tokenizer); again (cached): "
          f"{_ms(lambda: compiler.compile(ConstraintSpec.json_schema(SCHEMA)))[0]:.3f} ms")
    blocks_per_seq = -(-(300 + 2 * args.steps + 4) // BLOCK_SIZE)
    runner = make_runner(model, args.dtype, 2 * args.batch * blocks_per_seq + 8)
    admit(runner, args.batch, 0, 0, blocks_per_seq)
    admit(runner, args.batch, CONSTRAINED_BASE, args.batch * blocks_per_seq, blocks_per_seq)
    matchers = {CONSTRAINED_BASE + i: grammar.new_matcher() for i in range(args.batch)}
    filler = MaskFiller(compiler)
    free_plan = StepPlan(running_requests=[RunningRequest(i, 1) for i in range(args.batch)])
    free, masked, masks = [], [], []  # (wall ms, cpu ms) per step
    for step in range(args.steps + 1):
        free.append(_ms(lambda: runner.step(free_plan)))
        plan = StepPlan(running_requests=[RunningRequest(rid, 1) for rid in matchers])
        masks.append(_ms(lambda: filler.fill(plan, matchers.get)))
        outputs = []
        masked.append(_ms(lambda: outputs.extend(runner.step(plan).outputs)))
        for out in outputs:
            matcher = matchers[out.request_id]
            if not matcher.consume(out.token_id) or matcher.is_finished:
                matchers[out.request_id] = grammar.new_matcher()
    rows = {"unconstrained step": free, f"router bitmasks ({args.batch} matchers)": masks,
            "constrained step (shard)": masked}
    # min: the least disturbed step (other processes only ever add time); median: typical
    for stat in (min, statistics.median):
        print(f"batch {args.batch}, {args.dtype}, {args.steps} steps each, {stat.__name__}, wall ms / cpu ms:")
        values = {name: [stat(x[k] for x in xs[1:]) for k in (0, 1)] for name, xs in rows.items()}  # [0] warms
        for name, (wall, cpu) in values.items():
            print(f"  {name:34s} {wall:9.2f} / {cpu:9.2f}")
        base, mask_cost, step_cost = values.values()
        for k, kind in enumerate(("wall", "cpu")):
            total = mask_cost[k] + step_cost[k]
            print(f"  constrained total ({kind})           {total:9.2f} = {total / base[k] - 1:+.1%} vs unconstrained")


def bench_sampler(batch: int, vocab_size: int = 49152, repeats: int = 30) -> None:
    """The shard's share alone: sample() with and without a mask on every row (best CPU ms)."""
    from loom_shard.runtime.sampler import SeqSamplingState, sample
    from loom_shard.runtime.token_mask import apply_allowed_masks

    rng = random.Random(0)
    logits = torch.randn(batch, vocab_size)
    masks = [rng.randbytes(vocab_size // 8) for _ in range(batch)]
    free = [SeqSamplingState(SamplingParams(seed=i, do_sample=True), [1, 2], 2) for i in range(batch)]
    masked = [SeqSamplingState(SamplingParams(seed=i, do_sample=True), [1, 2], 2, masks[i]) for i in range(batch)]
    best = {name: min(_ms(fn)[1] for _ in range(repeats)) for name, fn in (
        ("apply_allowed_masks", lambda: apply_allowed_masks(logits, masks)),
        ("sample, no masks", lambda: sample(logits, free)),
        ("sample, every row masked", lambda: sample(logits, masked)))}
    print(f"shard sampler, batch {batch}, vocab {vocab_size}, best of {repeats}, cpu ms:")
    for name, value in best.items():
        print(f"  {name:34s} {value:9.2f}")


def _ms(fn) -> tuple[float, float]:  # noqa: ANN001
    """(wall ms, CPU ms of this process, all threads) of one call."""
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu_start) * 1e3


if __name__ == "__main__":
    main()
