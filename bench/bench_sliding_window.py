"""How many long requests decode at once in one KV budget, sliding-window layers keeping only their
window (KV groups) against full-length KV in every layer, through the router's real scheduler and
block manager (the shard's forward is not run: only the blocks are counted).

Run: python bench/bench_sliding_window.py [--kv-gib 4] [--prompt 8192] [--new 256] [--requests 64]

The models' shapes are the released ones' (layers, windows, KV heads, head dims); the pool holds
as many blocks as `--kv-gib` of bfloat16 K/V buy in each layout (`loom_shard.runtime.kv_groups`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loom_proto.step import SamplingParams, SeqOutput, StepResult  # noqa: E402
from loom_router.core.request import SequenceGroup  # noqa: E402
from loom_router.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from loom_shard.runtime.kv_groups import KVGroups  # noqa: E402

BLOCK_SIZE = 16
BYTES = 2  # bfloat16


@dataclass(frozen=True)
class Shape:
    name: str
    layer_windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int


def _pattern(num_layers: int, every: int, window: int) -> tuple[int | None, ...]:
    """Every `every`-th layer global, the others sliding."""
    return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))


SHAPES = [
    Shape("Gemma 3 1B (26 layers, 5:1, window 512)", _pattern(26, 6, 512), 1, 256),
    Shape("Gemma 3 12B (48 layers, 5:1, window 1024)", _pattern(48, 6, 1024), 8, 256),
    Shape("Gemma 2 9B (42 layers, 1:1, window 4096)", _pattern(42, 2, 4096), 8, 256),
    Shape("gpt-oss 20B (24 layers, 1:1, window 128)", tuple(128 if i % 2 == 0 else None for i in range(24)), 8, 64),
]


def max_concurrent(windows: tuple[int | None, ...], num_blocks: int, args: argparse.Namespace) -> tuple[int, int]:
    """(most requests decoding at once, steps to finish them all) for `requests` requests of
    `prompt` + `new` tokens, scheduled by the router with a pool of num_blocks."""
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, num_host_blocks=0,
                                          max_batch_prefill_tokens=args.prefill_budget, kv_group_windows=windows))
    for i in range(args.requests):  # distinct prompts: no prefix is shared
        prompt = [(i * 7919 + j) % 50000 for j in range(args.prompt)]
        scheduler.add(SequenceGroup.create(i, prompt, [SamplingParams(seed=i)], first_seq_id=i))
    generated = [0] * args.requests
    most, steps = 0, 0
    while (plan := scheduler.schedule()) is not None:
        steps += 1
        outputs = [SeqOutput(r.request_id, 1 if _reaches_end(scheduler, r.request_id, r.num_compute) else None, 0.0)
                   for r in [*plan.new_requests, *plan.running_requests]]
        for seq, out in scheduler.update(plan, StepResult(outputs, 0.0, 0.0)):
            if out.token_id is not None:
                generated[seq.seq_id] += 1
                if generated[seq.seq_id] >= args.new:
                    scheduler.finish(seq)
        most = max(most, sum(1 for n in generated if 0 < n < args.new))  # decoding now
    return most, steps


def _reaches_end(scheduler: Scheduler, seq_id: int, num_compute: int) -> bool:
    """What the shard answers: a token once a step computes a sequence's last known token."""
    seq = scheduler.live_seq(seq_id)
    return seq is not None and seq.num_computed + num_compute == seq.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv-gib", type=float, default=4.0)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefill-budget", type=int, default=2048)
    args = parser.parse_args()
    budget = int(args.kv_gib * 2**30)
    print(f"KV budget {args.kv_gib} GiB (bfloat16), block size {BLOCK_SIZE}, {args.requests} requests of "
          f"{args.prompt} + {args.new} tokens, prefill budget {args.prefill_budget} tokens per step")
    print("| model shape | full-length KV: blocks, most decoding at once | KV groups: blocks, most at once | more |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        row = [shape.name]
        results = []
        for windows in [(None,) * len(shape.layer_windows), shape.layer_windows]:
            groups = KVGroups.of(windows)
            block_bytes = groups.num_slots * 2 * BLOCK_SIZE * shape.kv_heads * shape.head_dim * BYTES
            num_blocks = budget // block_bytes
            most, _ = max_concurrent(groups.windows, num_blocks, args)
            results.append(most)
            row.append(f"{num_blocks} blocks of {groups.num_slots} layers, {most}")
        row.append(f"{results[1] / max(results[0], 1):.1f}x")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
