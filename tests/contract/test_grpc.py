"""The shard gRPC transport: the real server and ShardClient over unix sockets, around a fake runner."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from grpc_fakes import BLOCK_SIZE, FakeRunner

from loom_proto.config import RouterConfig, public_json
from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan, StepResult
from loom_router.core.shard_client import ShardClient, ShardError
from loom_router.types import ShardDivergence
from loom_shard.server import start_server
from tests.net import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def without_wait(result: StepResult) -> StepResult:
    """The answer without the shard's wait before the step (a time, not part of the answer)."""
    return replace(result, idle_ms=0.0)


def decode_plan(request_id: int = 1, last_token: int = 5) -> StepPlan:
    new = NewRequest(
        request_id=request_id, token_ids=[1, 2, last_token], num_prompt_tokens=3, num_cached=0, num_compute=3,
        block_table=[0], sampling=SamplingParams(seed=7, top_k=3, logit_bias={4: 1.0}),
    )
    running = RunningRequest(request_id=9, num_compute=1)
    return StepPlan(new_requests=[new], running_requests=[running], swap_in=[(0, 1)])


@pytest.fixture
async def shards(tmp_path):
    """Start `world_size` servers, each with its own FakeRunner; yields (runners, client)."""
    started = []

    async def start(world_size: int = 1, step_delay_s: float = 0.0) -> tuple[list[FakeRunner], ShardClient]:
        runners, paths = [], []
        for rank in range(world_size):
            runner = FakeRunner(rank=rank, world_size=world_size, step_delay_s=step_delay_s)
            path = str(tmp_path / f"shard-{rank}.sock")
            started.append(await start_server(runner, path))
            runners.append(runner)
            paths.append(path)
        client = ShardClient(paths)
        started.append(client)
        await client.wait_ready(timeout_s=5.0)
        return runners, client

    yield start
    for item in reversed(started):
        if isinstance(item, ShardClient):
            await item.close()
        else:
            server, servicer = item
            await server.stop(None)
            servicer.close()


async def test_info_warmup_step_release_round_trip(shards):
    (runner,), client = await shards()
    assert await client.info() == runner.info()
    assert await client.health()

    warm = await client.warmup(max_prefill_tokens=512, max_batch_total_tokens=None)
    assert (warm.num_blocks, warm.num_host_blocks, warm.block_size) == (64, 16, BLOCK_SIZE)
    assert runner.warmup_args == (512, None)
    await client.warmup(max_prefill_tokens=8, max_batch_total_tokens=4096)
    assert runner.warmup_args == (8, 4096)

    plan = decode_plan()
    result = await client.step(plan)
    assert runner.plans == [plan]
    assert without_wait(result) == runner.step(plan)
    assert result.idle_ms > 0  # the shard's wait for this plan, since it started

    await client.release([3, 4])
    await client.clear_cache()
    assert runner.released == [[3, 4]]
    assert runner.num_clears == 1


async def test_a_step_tells_how_long_the_shard_waited_for_it(shards):
    _, client = await shards(step_delay_s=0.05)
    await client.step(decode_plan())
    await asyncio.sleep(0.3)
    waited = await client.step(decode_plan(request_id=2))
    assert 250 <= waited.idle_ms < 3000
    # Sent while the step before it ran: it waited in the shard's queue, not the shard for it.
    _, queued = await asyncio.gather(client.step(decode_plan(request_id=3)), client.step(decode_plan(request_id=4)))
    assert queued.idle_ms < 25


async def test_health_and_info_answer_while_a_slow_step_runs(shards):
    (runner,), client = await shards(step_delay_s=2.0)
    step = asyncio.create_task(client.step(decode_plan()))
    await asyncio.sleep(0.3)  # the step is now inside the runner
    assert runner.plans, "the step should have reached the runner"

    started = time.perf_counter()
    assert await client.health()
    assert (await client.info()).rank == 0
    assert time.perf_counter() - started < 0.5
    assert not step.done()
    assert (await step).outputs[0].token_id == 6


async def test_steps_run_one_at_a_time(shards):
    (runner,), client = await shards(step_delay_s=0.05)
    results = await asyncio.gather(*(client.step(decode_plan(request_id=i)) for i in range(4)))
    assert runner.max_concurrent_steps == 1
    assert sorted(r.outputs[0].request_id for r in results) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("error", "code"),
    [(ValueError("block 99 out of range"), "INVALID_ARGUMENT"), (RuntimeError("kaboom"), "INTERNAL")],
)
async def test_step_error_becomes_shard_error_and_shard_keeps_serving(shards, error, code):
    (runner,), client = await shards()
    runner.fail_with = error
    with pytest.raises(ShardError) as caught:
        await client.step(decode_plan())
    assert (caught.value.rank, caught.value.code) == (0, code)
    assert f"{type(error).__name__}: {error}" in str(caught.value)

    result = await client.step(decode_plan(last_token=10))
    assert result.outputs[0].token_id == 11


async def test_every_rank_gets_the_same_plan_and_rank0_answers(shards):
    runners, client = await shards(world_size=2)
    plan = decode_plan()
    result = await client.step(plan)
    assert runners[0].plans == [plan]
    assert runners[1].plans == [plan]
    assert without_wait(result) == runners[0].step(plan)  # rank 1 would answer token 7, not 6
    assert result.outputs[0].token_id == 6

    warm = await client.warmup(max_prefill_tokens=64, max_batch_total_tokens=None)
    assert (warm.num_blocks, warm.num_host_blocks) == (56, 16)  # the smallest rank's pools
    assert runners[1].warmup_args == (64, None)

    await client.release([5])
    assert runners[0].released == runners[1].released == [[5]]
    assert (await client.info()).rank == 0


async def test_failing_rank_is_named(shards):
    runners, client = await shards(world_size=2)
    runners[0].fail_with = runners[1].fail_with = ValueError("bad block table")
    with pytest.raises(ShardError, match=r"shard rank 0: INVALID_ARGUMENT: ValueError: bad block table") as caught:
        await client.step(decode_plan())  # every rank refused it: an ordinary failed step
    assert caught.value.rank == 0


async def test_one_rank_failing_a_step_the_others_ran_is_a_divergence(shards):
    runners, client = await shards(world_size=2)
    runners[1].fail_with = ValueError("bad block table")
    with pytest.raises(ShardDivergence, match=r"ranks \[0\] ran it; rank 1: .*bad block table"):
        await client.step(decode_plan())


async def test_failing_rank_is_reported_without_waiting_for_a_blocked_rank(shards):
    # Rank 0 stands in for a rank stuck in a collective its failed peer never joins.
    runners, client = await shards(world_size=2)
    runners[0].step_delay_s = 3.0
    runners[1].fail_with = RuntimeError("device lost")
    started = time.perf_counter()
    with pytest.raises(ShardDivergence, match="rank 0: .*no answer.*rank 1: .*RuntimeError: device lost"):
        await client.step(decode_plan())
    assert time.perf_counter() - started < runners[0].step_delay_s


async def test_wait_ready_times_out_on_a_missing_shard(tmp_path):
    client = ShardClient([str(tmp_path / "nobody.sock")])
    started = time.perf_counter()
    with pytest.raises(ShardError, match="rank 0.*not ready"):
        await client.wait_ready(timeout_s=0.5)
    assert time.perf_counter() - started < 2.0
    assert not await client.health()
    await client.close()


async def test_wait_ready_notices_a_shard_that_starts_late(tmp_path):
    path = str(tmp_path / "late.sock")
    client = ShardClient([path])

    async def start_late():
        await asyncio.sleep(0.5)
        return await start_server(FakeRunner(), path)

    starting = asyncio.create_task(start_late())
    began = time.perf_counter()
    await client.wait_ready(timeout_s=5.0)
    assert time.perf_counter() - began < 2.0  # the reconnect backoff stays short
    server, servicer = await starting
    await client.close()
    await server.stop(None)
    servicer.close()


async def test_a_serving_shard_freezes_its_heap_once_loaded_and_again_after_warmup(tmp_path, monkeypatch):
    """What a shard keeps for its life (torch, the model; after warmup its pools and graphs) is
    moved out of the cyclic collector's reach, whose full scans of it stalled every stream."""
    from loom_proto.config import ShardConfig
    from loom_shard import server

    runner = FakeRunner()
    frozen: list[tuple[int, int | None] | None] = []  # the runner's warmup arguments at each freeze
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: frozen.append(runner.warmup_args))
    config = ShardConfig(uds_path=str(tmp_path / "shard.sock"))
    serving = asyncio.create_task(server.serve(runner, config))
    client = ShardClient([config.uds_path])
    await client.wait_ready(timeout_s=5.0)
    assert frozen == [None]  # loaded and serving, not warmed up yet
    await client.warmup(64, None)
    assert frozen == [None, (64, None)]
    await client.close()
    os.kill(os.getpid(), signal.SIGTERM)  # serve() handles it on this loop: a clean stop
    await asyncio.wait_for(serving, timeout=10.0)


def run_shard_cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loom_shard.server", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT,
    )


@pytest.mark.slow
def test_cli_model_load_failure_is_one_line_and_status_2(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    done = run_shard_cli("--model-id", str(missing), "--uds-path", str(tmp_path / "s.sock"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, done.stderr
    assert str(missing) in error_lines[0]
    assert "loom-shard ready" not in done.stdout


def test_cli_rejects_a_bad_config():
    done = run_shard_cli("--uds-path", "/tmp/x.sock", "--rank", "2", "--world-size", "2", timeout_s=60)
    assert done.returncode == 2
    assert "rank 2 outside world size 2" in done.stderr


# main() around a fake runner; its world size is what torch.distributed reports, so
# a rank that did not join the process group shows.
FAKE_SHARD_MAIN = """
import sys
import torch.distributed as dist
from grpc_fakes import FakeRunner
import loom_shard.server as server

def build_runner(config):
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return FakeRunner(rank=config.rank, world_size=world_size)

server.build_runner = build_runner
sys.exit(server.main(sys.argv[1:]))
"""


def start_fake_shard(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)])}
    return subprocess.Popen(
        [sys.executable, "-c", FAKE_SHARD_MAIN, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()



def test_cli_prints_readiness_serves_and_exits_on_sigterm(tmp_path):
    """main()'s lifecycle around a fake runner: ready line, serving, clean SIGTERM exit."""
    path = str(tmp_path / "cli.sock")
    proc = start_fake_shard("--uds-path", path, "--rank", "0")
    try:
        ready = proc.stdout.readline()
        assert ready == f"loom-shard ready rank=0 uds={path}\n", proc.stderr.read() if not ready else ready

        async def talk() -> None:
            client = ShardClient([path])
            await client.wait_ready(timeout_s=5.0)
            assert (await client.step(decode_plan())).outputs[0].token_id == 6
            await client.close()

        asyncio.run(talk())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        stop(proc)


def test_cli_unusable_socket_path_is_one_line_error(tmp_path):
    path = tmp_path / "missing-dir" / "s.sock"
    proc = start_fake_shard("--uds-path", str(path))
    try:
        assert proc.wait(timeout=60) == 1
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr
        error_lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(error_lines) == 1, stderr
        assert error_lines[0].startswith(f"error: cannot serve on unix://{path}")
    finally:
        stop(proc)


@pytest.mark.slow
def test_cli_two_ranks_join_one_process_group(tmp_path):
    """With --world-size 2 each rank joins torch.distributed (gloo) before building its runner."""
    paths = [str(tmp_path / f"tp-{rank}.sock") for rank in range(2)]
    common = ("--world-size", "2", "--master-port", str(free_port()))
    procs = [start_fake_shard("--uds-path", paths[r], "--rank", str(r), *common) for r in range(2)]
    try:
        for rank, proc in enumerate(procs):
            assert proc.stdout.readline() == f"loom-shard ready rank={rank} uds={paths[rank]}\n"

        async def talk() -> None:
            client = ShardClient(paths)
            await client.wait_ready(timeout_s=5.0)
            info = await client.info()
            assert (info.rank, info.world_size) == (0, 2)
            await client.step(decode_plan())
            await client.close()

        asyncio.run(talk())
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        assert [proc.wait(timeout=20) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            stop(proc)


# ---- Step's socket (loom_proto.step_channel) beside gRPC ------------------------------------


async def test_steps_take_the_step_socket_and_gRPC_stays_a_full_contract(shards, tmp_path):
    (runner,), client = await shards()
    plan = decode_plan()
    assert without_wait(await client.step(plan)) == runner.step(plan)
    assert client._step_channels, "every rank serves a step socket: steps go over it"
    # A plain gRPC client (any other one) still gets the same answer from gRPC's Step.
    grpc_only = ShardClient([str(tmp_path / "shard-0.sock")])
    grpc_only._step_channels = []
    try:
        assert without_wait(await grpc_only.step(plan)) == runner.step(plan)
    finally:
        await grpc_only.close()


async def test_without_a_step_socket_steps_go_over_gRPC(shards, tmp_path):
    (runner,), client = await shards()
    os.unlink(tmp_path / "shard-0.sock.step")  # a shard that serves no step socket
    plan = decode_plan()
    result = await client.step(plan)
    assert client._step_channels == [] and runner.plans == [plan]
    assert without_wait(result) == runner.step(plan)


async def test_a_step_socket_that_closes_fails_the_step_as_unavailable_and_the_next_reconnects(shards):
    (runner,), client = await shards(step_delay_s=0.3)
    await client.step(decode_plan())
    step = asyncio.create_task(client.step(decode_plan(last_token=7)))
    await asyncio.sleep(0.1)
    client._step_channels[0]._transport.close()  # as a shard that died would
    with pytest.raises(ShardError) as caught:
        await step
    assert caught.value.code == "UNAVAILABLE"
    runner.step_delay_s = 0.0
    await asyncio.sleep(0.4)  # the shard finishes the orphaned step
    assert (await client.step(decode_plan(last_token=10))).outputs[0].token_id == 11


# A shard whose warmup never ends (it marks the file named in LOOM_TEST_WARMUP_MARK when asked).
SLOW_WARMUP_SHARD_MAIN = """
import os, sys, time
from grpc_fakes import FakeRunner
import loom_shard.server as server

class SlowWarmup(FakeRunner):
    def warmup(self, max_prefill_tokens, max_batch_total_tokens):
        open(os.environ["LOOM_TEST_WARMUP_MARK"], "w").close()
        time.sleep(600)

server.build_runner = lambda config: SlowWarmup()
sys.exit(server.main(sys.argv[1:]))
"""


def test_a_signal_while_the_shards_warm_up_stops_the_router_at_once(tmp_path: Path) -> None:
    path, mark = str(tmp_path / "slow.sock"), tmp_path / "warming"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)]),
           "LOOM_TEST_WARMUP_MARK": str(mark), "TMPDIR": str(tmp_path)}
    shard = subprocess.Popen([sys.executable, "-c", SLOW_WARMUP_SHARD_MAIN, "--uds-path", path, "--rank", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    config = RouterConfig(model_id="", shard_uds_paths=(path,), hostname="127.0.0.1", port=free_port())
    router = subprocess.Popen([sys.executable, "-m", "loom_router.main", "--config-json", public_json(config)],
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), "the shard was never asked to warm up"
        router.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert router.wait(timeout=10) == 0, router.stderr.read() if router.stderr else ""
        assert time.monotonic() - start < 5  # not after the warmup
        assert not list(tmp_path.glob("loom-router-*"))
    finally:
        stop(router)
        stop(shard)
