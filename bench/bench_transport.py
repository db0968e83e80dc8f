"""What putting the shards on TCP costs per step, measured on loopback against unix sockets, and
what a cross-node step would add at 25 and 100 Gbit/s, simulated from the bytes it moves.

Measured: the router's ShardClient drives real shard gRPC servers (`loom_shard.server`, each in
its own process, the TCP ones demanding the shard secret) whose runner computes nothing and
answers one token per sequence; the median round trip of `step()` per transport, 1 and 2 ranks,
for decode steps of 1, 32 and 256 sequences and one 2048-token prefill.

Simulated: per step, every layer all-reduces its attention and MLP outputs ([tokens, hidden] in
bfloat16) across the ranks (a ring: 2(p-1) messages of S/p bytes per rank), and the router sends
the plan to each remote rank and gets its result back. Time = bytes / bandwidth + messages x one
network latency (an assumption, printed).

    python bench/bench_transport.py [--iterations 200] [--latency-us 15]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout: bench/common.py

from common import free_port, machine  # noqa: E402

from loom_proto.codec import to_pb
from loom_proto.step import (
    ModelInfo,
    NewRequest,
    RunningRequest,
    SamplingParams,
    SeqOutput,
    StepPlan,
    StepResult,
    WarmupResult,
)
from loom_proto.wire import encode_plan

SECRET = "bench-transport-secret"
BLOCK_SIZE = 16


@dataclass(slots=True)
class NullRunner:
    """Computes nothing: one token (and its logprob) per sequence that finishes its chunk."""

    rank: int
    world_size: int

    def info(self) -> ModelInfo:
        return ModelInfo(architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         hidden_size=576, vocab_size=49152, max_position_embeddings=8192, dtype="bfloat16",
                         weights_hash="null", device="cpu", block_size=BLOCK_SIZE, rank=self.rank,
                         world_size=self.world_size)

    def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        return WarmupResult(num_blocks=1 << 16, num_host_blocks=0, block_size=BLOCK_SIZE)

    def step(self, plan: StepPlan, phases: object = None) -> StepResult:
        return StepResult(outputs=null_outputs(plan), forward_ms=0.0, total_ms=0.0)

    def release(self, request_ids: list[int]) -> None:
        pass

    def clear(self) -> None:
        pass


def null_outputs(plan: StepPlan) -> list[SeqOutput]:
    ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running_requests]
    return [SeqOutput(request_id=i, token_id=1000 + i % 1000, logprob=-0.5) for i in ids]


def serve_null_shard(rank: int, world_size: int, uds_path: str | None, tcp_address: str | None) -> None:
    from loom_proto.event_loop import run_event_loop
    from loom_shard.server import start_server

    async def run() -> None:
        server, _ = await start_server(NullRunner(rank, world_size), uds_path, tcp_address=tcp_address,  # type: ignore[arg-type]
                                       secret=SECRET if tcp_address else None)
        await server.wait_for_termination()

    run_event_loop(run())


def decode_plan(num_seqs: int) -> StepPlan:
    return StepPlan(running_requests=[RunningRequest(request_id=i, num_compute=1,
                                                     new_block_ids=[i] if i % BLOCK_SIZE == 0 else [])
                                      for i in range(num_seqs)])


def prefill_plan(num_tokens: int) -> StepPlan:
    new = NewRequest(request_id=0, token_ids=list(range(1000, 1000 + num_tokens)), num_prompt_tokens=num_tokens,
                     num_cached=0, num_compute=num_tokens, block_table=list(range(num_tokens // BLOCK_SIZE)),
                     sampling=SamplingParams(seed=1))
    return StepPlan(new_requests=[new])


PLANS: dict[str, Callable[[], StepPlan]] = {
    "decode x1": lambda: decode_plan(1),
    "decode x32": lambda: decode_plan(32),
    "decode x256": lambda: decode_plan(256),
    "prefill 2048": lambda: prefill_plan(2048),
}


async def time_steps(unix: list[str], tcp: list[str], plan: StepPlan, iterations: int) -> tuple[float, ...]:
    """Unix and TCP steps taken in turns (the order alternating), so that the load of a shared
    machine falls on both alike. Returns the median unix and TCP times and the median of the
    paired differences, in µs."""
    from loom_router.core.shard_client import ShardClient

    clients = [ShardClient(unix), ShardClient(tcp, SECRET)]
    try:
        for client in clients:
            await client.wait_ready(30.0)
            for _ in range(20):  # connections up, caches warm
                await client.step(plan)
        times: list[list[float]] = [[], []]
        for iteration in range(iterations):
            for which in (0, 1) if iteration % 2 else (1, 0):
                start = time.perf_counter()
                await clients[which].step(plan)
                times[which].append((time.perf_counter() - start) * 1e6)
        diffs = [t - u for u, t in zip(*times, strict=True)]
        return statistics.median(times[0]), statistics.median(times[1]), statistics.median(diffs)
    finally:
        for client in clients:
            await client.close()


def measure(iterations: int) -> None:
    print(f"machine: {machine()}")
    print("| step | plan bytes | result bytes | ranks | unix µs | tcp µs | tcp - unix µs (paired median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="loom-bt-") as folder:
        for world_size in (1, 2):
            paths = [str(Path(folder) / f"s{world_size}-{rank}") for rank in range(world_size)]
            addresses = [f"127.0.0.1:{free_port()}" for _ in range(world_size)]
            servers = [context.Process(target=serve_null_shard, args=(rank, world_size, path, None), daemon=True)
                       for rank, path in enumerate(paths)]
            servers += [context.Process(target=serve_null_shard, args=(rank, world_size, None, address), daemon=True)
                        for rank, address in enumerate(addresses)]
            for server in servers:
                server.start()
            try:
                for name, make in PLANS.items():
                    plan = make()
                    result_bytes = to_pb(StepResult(null_outputs(plan), 0.0, 0.0)).ByteSize()
                    unix, tcp, diff = asyncio.run(time_steps(paths, addresses, plan, iterations))
                    print(f"| {name} | {len(encode_plan(plan))} | {result_bytes} | {world_size} | {unix:.0f} | "
                          f"{tcp:.0f} | {diff:+.0f} |")
            finally:
                for server in servers:
                    server.terminate()
                    server.join()


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    activation_bytes: int = 2  # bfloat16


SHAPES = (ModelShape("SmolLM2-135M", 30, 576), ModelShape("Llama-3-8B", 32, 4096),
          ModelShape("Llama-3-70B", 80, 8192))
STEPS = {"decode x1": (1, 1), "decode x32": (32, 32), "decode x256": (256, 256), "prefill 2048": (2048, 1)}


def simulate(latency_us: float) -> None:
    """TP over 2 ranks on 2 nodes: what one step's network traffic costs at 25 and 100 Gbit/s."""
    ranks = 2
    print(f"\nsimulated: TP={ranks}, one rank per node, bfloat16 activations, 2 all-reduces per layer (ring), "
          f"{latency_us:g} µs per message")
    print("| model | step | all-reduce MB/step/rank | plan + result KB | 25 Gbit/s ms | 100 Gbit/s ms |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in SHAPES:
        for name, (num_tokens, num_seqs) in STEPS.items():
            plan = PLANS[name]()
            wire = len(encode_plan(plan)) + to_pb(StepResult(null_outputs(plan), 0.0, 0.0)).ByteSize()
            tensor = num_tokens * shape.hidden_size * shape.activation_bytes
            per_rank = 2 * shape.num_layers * 2 * (ranks - 1) / ranks * tensor  # bytes each rank sends
            messages = 2 * shape.num_layers * 2 * (ranks - 1) + 2  # ring steps + plan out, result back
            cells = []
            for gbits in (25, 100):
                seconds = (per_rank + wire) * 8 / (gbits * 1e9) + messages * latency_us * 1e-6
                cells.append(f"{seconds * 1e3:.2f}")
            print(f"| {shape.name} | {name} | {per_rank / 1e6:.2f} | {wire / 1e3:.1f} | {cells[0]} | {cells[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--latency-us", type=float, default=15.0, help="one network message's latency")
    parser.add_argument("--simulate-only", action="store_true")
    args = parser.parse_args()
    if not args.simulate_only:
        measure(args.iterations)
    simulate(args.latency_us)


if __name__ == "__main__":
    main()
