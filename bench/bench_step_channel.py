"""What one decode step's round trip to a shard costs on each transport: gRPC's Step against the
same StepPlan/StepResult bytes framed on the shard's step socket (loom_proto.step_channel).

    python bench/bench_step_channel.py [--steps 3000] [--rounds 3]

The shard is bench/zero_cost_shard.py's (it answers at once), in a process of its own serving
both; the client sends a one-sequence decode plan `--steps` times on each transport, taking turns
each round, and prints the wall time and the CPU time of each side per round trip (the client's
from os.times, the shard's from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from loom_proto import step_channel
from loom_proto.codec import pb

BENCH = Path(__file__).resolve().parent
STEP_METHOD = "/" + pb.DESCRIPTOR.services_by_name["Shard"].full_name + "/Step"


def serve(path: str) -> None:
    sys.path.insert(0, str(BENCH))
    import zero_cost_shard

    from loom_proto.event_loop import run_event_loop

    async def main() -> None:
        shard = zero_cost_shard.ZeroCostShard(block_size=16)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((zero_cost_shard.handler(shard),))
        server.add_insecure_port(f"unix://{path}")
        await server.start()

        async def frame(plan: bytes, metadata: step_channel.Metadata) -> tuple[int, bytes]:
            return step_channel.OK, shard.step(plan)

        await step_channel.serve(step_channel.socket_path(path), frame)
        print("ready", flush=True)
        await asyncio.Event().wait()

    run_event_loop(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(path: str, shard_pid: int, steps: int, rounds: int) -> None:
    first = pb.StepPlan(new_requests=[pb.NewRequest(request_id=1, token_ids=[1, 2, 3], num_compute=3,
                                                    block_table=[0])]).SerializeToString()
    decode = pb.StepPlan(running_requests=[pb.RunningRequest(request_id=1, num_compute=1)]).SerializeToString()
    channel = grpc.aio.insecure_channel(f"unix://{path}")
    grpc_step = channel.unary_unary(STEP_METHOD, request_serializer=None,
                                    response_deserializer=pb.StepResult.FromString)
    await grpc_step(first)
    socket = await step_channel.connect(step_channel.socket_path(path))

    async def over_grpc() -> None:
        await grpc_step(decode)

    async def over_socket() -> None:
        _, payload = await socket.request(decode, None)
        pb.StepResult.FromString(payload)

    print("| transport | wall µs | client CPU µs | shard CPU µs |\n|---|---|---|---|")
    for _ in range(rounds):
        for name, call in (("gRPC", over_grpc), ("step socket", over_socket)):
            before, shard_before, wall = os.times(), cpu_seconds(shard_pid), time.perf_counter()
            for _ in range(steps):
                await call()
            wall = time.perf_counter() - wall
            after = os.times()
            client = (after.user - before.user) + (after.system - before.system)
            shard = cpu_seconds(shard_pid) - shard_before
            print(f"| {name} | {wall / steps * 1e6:.0f} | {client / steps * 1e6:.0f} | {shard / steps * 1e6:.0f} |",
                  flush=True)
    socket.close()
    await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the shard process
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import uvloop

    path = tempfile.mktemp(prefix="loom-bench-step-")
    shard = subprocess.Popen([sys.executable, __file__, "--serve", path], stdout=subprocess.PIPE, text=True)
    try:
        assert shard.stdout is not None and shard.stdout.readline().strip() == "ready"
        uvloop.run(measure(path, shard.pid, args.steps, args.rounds))
    finally:
        shard.kill()
        shard.wait()
        for leftover in (path, step_channel.socket_path(path)):
            if os.path.exists(leftover):
                os.unlink(leftover)


if __name__ == "__main__":
    main()
