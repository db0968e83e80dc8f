"""A shard whose GPU is simulated, behind the real shard server: what launching a step while the
one before still computes (loom_shard.server with `launch_ahead`, ModelRunner.launch / finish)
does for serving, measurable without a GPU (bench/bench_ceiling.py --simulated-gpu).

The server is loom_shard.server's own (its worker, the wait for a step's samples on another
thread, the step socket); the runner answers as bench/zero_cost_shard.py does (one token for each
sequence whose prompt is done) and costs what a GPU shard's step costs:

    host work   SIM_LAUNCH_US + SIM_LAUNCH_US_PER_SEQ x sequences on the worker, holding the GIL
                (the runner's Python: plan check, tables, staging, the graph's launch), and
                SIM_FINISH_US_PER_SEQ x sequences when the step is finished (samples read back);
    device time SIM_DEVICE_US + SIM_DEVICE_US_PER_SEQ x sequences, one step after another on a
                simulated device clock, without CPU.

A launch returns once its host work is done, its device time queued, as Loom's runner on CUDA.
The device reports "cuda", so the router plans ahead (--overlap-steps) and the server launches
ahead (--launch-ahead) by default; with --launch-ahead false each step is one job on the server's
worker (host work, device time and the samples read back one after the other), as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from zero_cost_shard import LOGPROB, NUM_BLOCKS, Sequences, ZeroCostShard

from loom_proto.codec import from_pb
from loom_proto.config import ShardConfig, parse_config
from loom_proto.event_loop import run_event_loop
from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult, WarmupResult
from loom_shard.server import serve


def _env_s(name: str, default_us: float) -> float:
    return float(os.environ.get(name, default_us)) / 1e6


@dataclass(slots=True, frozen=True)
class Costs:
    """A step's simulated costs in seconds: fixed, and per sequence."""

    launch: float = _env_s("SIM_LAUNCH_US", 100)
    launch_per_seq: float = _env_s("SIM_LAUNCH_US_PER_SEQ", 6)
    finish_per_seq: float = _env_s("SIM_FINISH_US_PER_SEQ", 1.5)
    device: float = _env_s("SIM_DEVICE_US", 1000)
    device_per_seq: float = _env_s("SIM_DEVICE_US_PER_SEQ", 4)


@dataclass(slots=True)
class SimulatedStep:
    outputs: list[SeqOutput]
    num_seqs: int
    start: float
    done_at: float  # when the simulated device finishes it

    def ready(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> None:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


@dataclass(slots=True)
class SimulatedRunner:
    info_: ModelInfo
    costs: Costs = field(default_factory=Costs)
    seqs: Sequences = field(default_factory=Sequences)
    device_free: float = 0.0  # when the device finishes the work queued so far
    last_end: float = 0.0  # when the last finished step ended

    def info(self) -> ModelInfo:
        return self.info_

    def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        return WarmupResult(num_blocks=NUM_BLOCKS, num_host_blocks=0, block_size=self.info_.block_size)

    def step(self, plan: StepPlan, phases: object = None) -> StepResult:
        return self.finish(self.launch(plan, phases, wait=True))

    def launch(self, plan: StepPlan, phases: object = None, wait: bool = False) -> SimulatedStep:
        start = time.perf_counter()
        self.seqs.release(plan.released_ids)
        for new in plan.new_requests:
            self.seqs.admit(new.request_id, len(new.token_ids), new.num_cached)
        outputs = []
        for r in [*plan.new_requests, *plan.running_requests]:
            outputs.append(_output(r.request_id, self.seqs.compute(r.request_id, r.num_compute)))
            outputs += [_output(f.request_id, self.seqs.fork(r.request_id, f.request_id)) for f in r.forks]
        n, c = plan.num_requests, self.costs
        _busy(c.launch + c.launch_per_seq * n)
        self.device_free = max(time.perf_counter(), self.device_free) + c.device + c.device_per_seq * n
        launched = SimulatedStep(outputs, n, start, self.device_free)
        if wait:
            launched.wait()
        return launched

    def finish(self, launched: SimulatedStep) -> StepResult:
        launched.wait()
        _busy(self.costs.finish_per_seq * launched.num_seqs)
        end = time.perf_counter()
        ms = (end - max(launched.start, self.last_end)) * 1e3  # as ModelRunner: from the step before's end
        self.last_end = end
        return StepResult(launched.outputs, forward_ms=ms, total_ms=ms)

    def release(self, request_ids: list[int]) -> None:
        self.seqs.release(request_ids)

    def clear(self) -> None:
        self.seqs = Sequences()


def _output(request_id: int, token: int | None) -> SeqOutput:
    return SeqOutput(request_id, token, None if token is None else LOGPROB)


def _busy(seconds: float) -> None:
    """Host work: the CPU (and the GIL) held for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ShardConfig, argv, "simulated-gpu-shard", __doc__ or "")
    info = from_pb(ZeroCostShard(config.block_size, config.rank, config.world_size).info())
    run_event_loop(serve(SimulatedRunner(replace(info, device="cuda:0", weights_hash="simulated-gpu")), config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
