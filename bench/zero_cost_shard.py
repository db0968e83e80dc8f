"""A shard that computes nothing: it serves the shard's contract (gRPC, and Step's socket,
loom_proto.step_channel) and answers every Step at once with one token for each sequence whose
prompt is done, so that what remains of a serving run is the router's own cost
(bench/bench_ceiling.py).

With ZERO_COST_STEP_MS=T in its environment each step takes T ms of waiting (one step at a time,
no CPU: a GPU's step as the router sees it), so that a run shows how much the router adds to a
step it cannot overlap, and what `--overlap-steps` hides.

Started as the launcher starts `loom_shard.server` (`--config-json` with a ShardConfig), it prints
the same readiness line. Its Step handler reads the plan with protobuf and answers in
StepResult's sampled-token columns, so that at 512 sequences it stays far cheaper than the router
it stands in front of (it shares the machine's cores with it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from loom_proto import step_channel
from loom_proto.codec import pb
from loom_proto.config import ShardConfig, parse_config
from loom_proto.event_loop import run_event_loop

SERVICE = pb.DESCRIPTOR.services_by_name["Shard"].full_name
VOCAB_SIZE = 49152  # the embedded SmolLM2's, so that the router's checks see a real vocabulary
MAX_POSITIONS = 8192
NUM_BLOCKS = 1 << 16  # KV blocks it claims: enough for 512 streams of any benchmark length
FIRST_TOKEN, NUM_TOKENS = 1000, 1000  # it answers ids in this range: ordinary sub-words of the vocabulary
LOGPROB = -0.5
STEP_S = float(os.environ.get("ZERO_COST_STEP_MS", "0")) / 1e3  # each step's simulated device time


@dataclass(slots=True)
class _Seq:
    num_known: int  # tokens the shard knows (prompt + sampled)
    num_computed: int


@dataclass(slots=True)
class Sequences:
    """The requests a shard holds: a request's token comes once its prompt is computed."""

    seqs: dict[int, _Seq] = field(default_factory=dict)

    def admit(self, request_id: int, num_known: int, num_cached: int) -> None:
        self.seqs[request_id] = _Seq(num_known, num_cached)

    def compute(self, request_id: int, num_compute: int) -> int | None:
        """The token sampled after `num_compute` more positions, or None while the prompt lasts."""
        seq = self.seqs[request_id]
        seq.num_computed += num_compute
        return self._sample(request_id, seq) if seq.num_computed >= seq.num_known else None

    def fork(self, parent_id: int, request_id: int) -> int:
        """A child of the parent's computed positions, and its first token."""
        computed = self.seqs[parent_id].num_computed
        self.seqs[request_id] = child = _Seq(computed, computed)
        return self._sample(request_id, child)

    def release(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            self.seqs.pop(request_id, None)

    @staticmethod
    def _sample(request_id: int, seq: _Seq) -> int:
        token = FIRST_TOKEN + (request_id * 7 + seq.num_known) % NUM_TOKENS
        seq.num_known += 1
        return token


@dataclass(slots=True)
class _Sampled:
    """A step's answer, in StepResult's sampled-token columns."""

    request_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def add(self, request_id: int, token: int | None) -> None:
        if token is not None:
            self.request_ids.append(request_id)
            self.token_ids.append(token)

    def encode(self, idle_ms: float) -> bytes:
        """The answer, with the simulated device time as the step's time and how long the shard
        waited for the plan since its previous step."""
        return pb.StepResult(sampled_request_ids=self.request_ids, sampled_token_ids=self.token_ids,
                             sampled_logprobs=[LOGPROB] * len(self.token_ids), forward_ms=STEP_S * 1e3,
                             total_ms=STEP_S * 1e3, idle_ms=idle_ms).SerializeToString()


@dataclass(slots=True)
class ZeroCostShard:
    block_size: int
    rank: int = 0
    world_size: int = 1
    seqs: Sequences = field(default_factory=Sequences)

    def step(self, data: bytes, idle_ms: float = 0.0) -> bytes:
        plan = pb.StepPlan.FromString(data)
        self.seqs.release(plan.released_ids)
        out = _Sampled()
        for new in plan.new_requests:
            self.seqs.admit(new.request_id, len(new.token_ids), new.num_cached)
            self._compute(new.request_id, new.num_compute, new.forks, out)
        for running in plan.running_requests:
            self._compute(running.request_id, running.num_compute, running.forks, out)
        for request_id in plan.decode_ids:
            out.add(request_id, self.seqs.compute(request_id, 1))
        return out.encode(idle_ms)

    def _compute(self, request_id: int, num_compute: int, forks: Sequence[pb.Fork], out: _Sampled) -> None:
        out.add(request_id, self.seqs.compute(request_id, num_compute))
        for fork in forks:
            out.add(fork.request_id, self.seqs.fork(request_id, fork.request_id))

    def info(self) -> pb.ModelInfo:
        return pb.ModelInfo(architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3,
                            head_dim=64, hidden_size=576, vocab_size=VOCAB_SIZE,
                            max_position_embeddings=MAX_POSITIONS, dtype="bfloat16", weights_hash="zero-cost",
                            device="cpu", block_size=self.block_size, rank=self.rank, world_size=self.world_size,
                            quantization="none", cpu_kernels="")


def timed(shard: ZeroCostShard):  # noqa: ANN201 - the Step answer, after STEP_S of device time
    device = asyncio.Lock()  # steps run one at a time, as on one GPU
    idle_since = time.perf_counter()  # when the last step ended

    async def step(data: bytes) -> bytes:
        nonlocal idle_since
        async with device:
            idle_ms = (time.perf_counter() - idle_since) * 1e3
            if STEP_S:
                await asyncio.sleep(STEP_S)
            answer = shard.step(data, idle_ms)
            idle_since = time.perf_counter()
            return answer

    return step


def handler(shard: ZeroCostShard, step_after_device) -> grpc.GenericRpcHandler:  # noqa: ANN001
    def unary(fn, request_type):  # noqa: ANN001, ANN202 (gRPC's handler plumbing)
        async def call(request, context):  # noqa: ANN001, ANN202
            return fn(request)
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=request_type.FromString,
                                                   response_serializer=lambda m: m.SerializeToString())

    async def step(data: bytes, context: object) -> bytes:
        return await step_after_device(data)

    def release(request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        shard.seqs.release(request.request_ids)
        return pb.ReleaseResponse()

    methods = {
        "Info": unary(lambda _: shard.info(), pb.InfoRequest),
        "Health": unary(lambda _: pb.HealthResponse(ok=True), pb.HealthRequest),
        "Warmup": unary(lambda _: pb.WarmupResult(num_blocks=NUM_BLOCKS, num_host_blocks=0,
                                                  block_size=shard.block_size), pb.WarmupRequest),
        "Release": unary(release, pb.ReleaseRequest),
        "ClearCache": unary(lambda _: pb.ClearCacheResponse(), pb.ClearCacheRequest),
        "Step": grpc.unary_unary_rpc_method_handler(step),  # bytes in, bytes out
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


async def serve(config: ShardConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    shard = ZeroCostShard(config.block_size, config.rank, config.world_size)
    step_after_device = timed(shard)  # one device for both ways a step arrives
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler(shard, step_after_device),))
    server.add_insecure_port(f"unix://{config.uds_path}")
    await server.start()

    async def step_frame(plan: bytes, metadata: step_channel.Metadata) -> tuple[int, bytes]:
        return step_channel.OK, await step_after_device(plan)

    step_server = await step_channel.serve(step_channel.socket_path(config.uds_path), step_frame)
    print(f"loom-shard ready rank={config.rank} uds={config.uds_path} (zero-cost)", flush=True)
    await stop.wait()
    step_server.close()
    await server.stop(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ShardConfig, argv, "zero-cost-shard", __doc__ or "")
    run_event_loop(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
