"""The engine core's CPU per sequence and step, without sockets: the real Engine (scheduler, block
manager, the plan's bytes, the result's parsing, each token's postprocessing and its frontend's
Outbox batch, encoded) in front of the zero-cost shard called in process, so what is timed is the
core's own Python per decoding sequence (on a GPU it runs once per step for every sequence).

    python bench/bench_core_step.py [--streams 32 256] [--new-tokens 256] [--rounds 3] [--overlap-steps]

For each stream count it runs that many greedy requests of `--new-tokens` tokens at once and
reports this process's CPU time per generated token less the zero-cost shard's own (the best of
`--rounds`), and steps per second; the heap is frozen first, as the engine core's is when it
serves. `--overlap-steps`: the engine plans each step while the one before runs
(loom_router.core.lookahead), as it does in front of GPU shards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import machine  # noqa: E402
from zero_cost_shard import NUM_BLOCKS, ZeroCostShard  # noqa: E402

from loom_proto.codec import from_pb, pb  # noqa: E402
from loom_proto.config import RouterConfig  # noqa: E402
from loom_proto.event_loop import freeze_startup_heap  # noqa: E402
from loom_proto.step import ModelInfo, SamplingParams, StepPlan, StepResult, WarmupResult  # noqa: E402
from loom_proto.wire import encode_plan  # noqa: E402
from loom_router.contract import PromptInfo, Submit  # noqa: E402
from loom_router.core.engine import Engine  # noqa: E402
from loom_router.core.outbox import Outbox  # noqa: E402
from loom_router.tokenizer import load_tokenizer  # noqa: E402

BLOCK_SIZE = 16
PROMPT = list(range(1000, 1100))


class InProcessShard:
    """The zero-cost shard behind the ShardBackend interface: the plan encoded as the client
    encodes it, the reply parsed as the client parses it. Its own CPU time (`shard_s`) is kept
    apart, so that the core's can be told from it."""

    def __init__(self) -> None:
        self.shard = ZeroCostShard(BLOCK_SIZE)
        self.steps = 0
        self.shard_s = 0.0

    async def info(self) -> ModelInfo:
        return from_pb(self.shard.info())

    async def health(self) -> bool:
        return True

    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        return WarmupResult(num_blocks=NUM_BLOCKS, num_host_blocks=0, block_size=BLOCK_SIZE)

    async def release(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self.shard.seqs.pop(request_id, None)

    async def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        data = encode_plan(plan)
        started = time.process_time()
        reply = self.shard.step(data)
        self.shard_s += time.process_time() - started
        return from_pb(pb.StepResult.FromString(reply))


class DroppingSender:
    """Stands in for the frontend's socket: the batches arrive encoded (by the Outbox) and are dropped."""

    backlogged = False

    def send(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class FinishWatch(Outbox):
    """The frontend's Outbox, which also notices when the last request finished."""

    def __init__(self, requests: int) -> None:
        super().__init__(0, DroppingSender())  # type: ignore[arg-type]
        self.left = requests
        self.all_done = asyncio.Event()

    def token(self, group_id: int, index: int, token_id: int, logprob: float, num_generated: int,
              finish: str | None, top_tokens: list[tuple[int, float]] | None, prompt: PromptInfo | None) -> None:
        super().token(group_id, index, token_id, logprob, num_generated, finish, top_tokens, prompt)
        if finish is not None:
            self.left -= 1
            if not self.left:
                self.all_done.set()


async def run(streams: int, new_tokens: int, overlap: bool) -> tuple[float, float]:
    """(CPU µs per generated token, steps per second) for `streams` requests decoding at once."""
    config = RouterConfig(model_id="", shard_uds_paths=("in-process",), max_concurrent_requests=max(512, streams),
                          overlap_steps=overlap)
    shard = InProcessShard()
    engine = Engine(config, shard, load_tokenizer(""))
    await engine.start()
    freeze_startup_heap()  # as the engine core does once it serves: collections scan what steps allocate
    outbox = FinishWatch(streams)
    submits = [Submit(0, i, PROMPT, [SamplingParams(seed=i)], new_tokens, ignore_eos=True) for i in range(streams)]
    start_cpu, start_wall, start_steps = time.process_time(), time.perf_counter(), shard.steps
    for submit in submits:
        engine.add(submit, outbox)
    await outbox.all_done.wait()
    cpu = time.process_time() - start_cpu - shard.shard_s
    wall, steps = time.perf_counter() - start_wall, shard.steps - start_steps
    await engine.stop(drain_timeout_s=1.0)
    return cpu / (streams * new_tokens) * 1e6, steps / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overlap-steps", action="store_true", help="plan each step while the one before runs")
    args = parser.parse_args()
    print(f"{machine()}; load {os.getloadavg()[0]:.1f}")
    for streams in args.streams:
        results = [asyncio.run(run(streams, args.new_tokens, args.overlap_steps)) for _ in range(args.rounds)]
        best = min(results)
        print(f"{streams:4d} streams: {best[0]:6.2f} µs of engine-core CPU per token (best of {args.rounds}: "
              f"{', '.join(f'{r[0]:.2f}' for r in results)}), {best[1]:,.0f} steps/s", flush=True)


if __name__ == "__main__":
    main()
