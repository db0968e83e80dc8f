"""The shard's gRPC server: protobuf in, a runner call, protobuf out; no logic of its own.

`loom-shard` (`main`) parses a ShardConfig, joins torch.distributed when tensor
parallel, loads the model through the runner and serves on a unix socket.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from loom_proto import config as config_module
from loom_proto import shard_pb2_grpc, step_channel
from loom_proto.codec import from_pb, pb, snapshot_status_to_pb, to_pb
from loom_proto.config import ShardConfig
from loom_proto.event_loop import freeze_startup_heap, run_event_loop
from loom_proto.process import die_with_parent
from loom_proto.snapshot import KVLayout, SnapshotEntry, SnapshotError, SnapshotReply, SnapshotStatus, model_fingerprint
from loom_proto.step import ModelInfo, StepPlan, StepResult, WarmupResult
from loom_shard.auth import SecretInterceptor
from loom_shard.lora.adapter import AdapterError
from loom_shard.runtime.snapshot import PartStore, clean_leftovers
from loom_shard.tracing import ShardTracer, StepPhases, configure_tracing

log = logging.getLogger("loom_shard.server")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
STOP_GRACE_S = 2.0
EXIT_MODEL_LOAD_ERROR = 2
EXIT_SERVE_ERROR = 1

T = TypeVar("T")


class Launched(Protocol):
    """What the server needs of loom_shard.runtime.runner.LaunchedStep."""

    def ready(self) -> bool: ...
    def wait(self) -> None: ...


class Runner(Protocol):
    """What the server needs of loom_shard.runtime.runner.ModelRunner."""

    def info(self) -> ModelInfo: ...
    def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult: ...
    def step(self, plan: StepPlan, phases: StepPhases | None = None) -> StepResult: ...
    def launch(self, plan: StepPlan, phases: StepPhases | None = None) -> Launched: ...
    def finish(self, launched: Any) -> StepResult: ...
    def release(self, request_ids: list[int]) -> None: ...
    def clear(self) -> None: ...
    def read_kv(self, block_ids: list[int], num_tokens: int) -> tuple[KVLayout, memoryview]: ...
    def write_kv(self, block_ids: list[int], block_indices: list[int], layout: KVLayout, kv: memoryview) -> None: ...
    def read_lora(self, path: str) -> Any: ...
    def add_lora(self, lora_id: int, factors: Any) -> None: ...
    def unload_lora(self, lora_id: int) -> bool: ...


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class ShardServicer(shard_pb2_grpc.ShardServicer):
    """Maps each RPC onto the runner.

    Everything that touches model or cache state (Warmup, Step, Release,
    ClearCache) runs on one worker thread, so those run one at a time and in
    arrival order, while Info and Health answer from the event loop at once.
    Snapshot block copies run on that worker too (between two steps); their file
    reads, writes and checksums run on an I/O thread, so steps continue meanwhile.

    With `launch_ahead` (--launch-ahead; None: on CUDA) a step is two jobs on the worker: its
    launch queues the device work, and its finish, once the samples reached the host (waited for
    on another thread), reads them back. A step that arrives meanwhile launches in between, so the
    host prepares it while the device computes the one before (the router sends it ahead:
    --overlap-steps). Without, a step is one job, as on the CPU, where launching it computes it.
    """

    def __init__(self, runner: Runner, snapshot_dir: str | None = None,
                 worker: ThreadPoolExecutor | None = None, tracer: ShardTracer | None = None,
                 launch_ahead: bool | None = None) -> None:
        self._runner = runner
        self._tracer = tracer  # --otlp-endpoint; None: untraced
        self._worker = worker or new_worker()
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loom-snapshot-io")
        info = runner.info()
        self._launch_ahead = info.device.startswith("cuda") if launch_ahead is None else launch_ahead
        if self._launch_ahead:
            log.info("a step launches while the one before it still computes (--launch-ahead)")
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-step-wait")
        self._parts = PartStore(Path(snapshot_dir) if snapshot_dir else None, info.rank, info.world_size)
        self.step_server: asyncio.AbstractServer | None = None  # the step socket, once served
        self.on_warm: Callable[[], None] | None = None  # after each Warmup (the process's GC freeze)
        self._idle_since = time.perf_counter()  # when the worker's last step ended
        self._in_flight = 0  # steps launched and not finished (changed on the worker only)

    def close(self) -> None:
        if self.step_server is not None:
            step_channel.close(self.step_server)
        # A forward already running finishes; queued ones are dropped.
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._waiter.shutdown(wait=False, cancel_futures=True)

    async def _on_worker(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the worker thread; a failure becomes a gRPC error and the shard keeps serving."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except ValueError as error:
            log.warning("%s rejected: %s", fn.__name__, describe(error))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(error))
        except Exception as error:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, describe(error))
        raise AssertionError("context.abort returned")  # abort always raises

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return to_pb(self._runner.info())

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ok=True)

    async def Warmup(self, request: pb.WarmupRequest, context: grpc.aio.ServicerContext) -> pb.WarmupResult:
        max_batch_total_tokens = (
            request.max_batch_total_tokens if request.HasField("max_batch_total_tokens") else None
        )
        result = await self._on_worker(
            context, self._runner.warmup, request.max_prefill_tokens, max_batch_total_tokens
        )
        if self.on_warm is not None:
            self.on_warm()
        return to_pb(result)

    async def Step(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        try:
            return to_pb(await self.run_step(from_pb(request), context.invocation_metadata()))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(error))
        except Exception as error:
            await context.abort(grpc.StatusCode.INTERNAL, describe(error))
        raise AssertionError("context.abort returned")  # abort always raises

    async def run_step(self, plan: StepPlan, metadata: Any) -> StepResult:
        """One step on the worker thread (gRPC's Step and the step socket both come here);
        ValueError: the plan was refused; anything else: it failed."""
        try:
            if self._tracer is None:
                return await self._step_on_worker(plan, None)
            with self._tracer.step(metadata, plan) as phases:
                return await self._step_on_worker(plan, phases)
        except ValueError as error:
            log.warning("step rejected: %s", describe(error))
            raise
        except Exception:
            log.exception("step failed")
            raise

    async def _step_on_worker(self, plan: StepPlan, phases: StepPhases | None) -> StepResult:
        loop = asyncio.get_running_loop()
        if not self._launch_ahead:
            result, idle_ms = await loop.run_in_executor(self._worker, self._timed, self._runner.step, plan, phases)
        else:
            launched, idle_ms = await loop.run_in_executor(self._worker, self._timed, self._launch, plan, phases)
            if not launched.ready():
                await loop.run_in_executor(self._waiter, launched.wait)
            result, _ = await loop.run_in_executor(self._worker, self._timed, self._finish, launched)
        result.idle_ms = idle_ms
        return result

    def _launch(self, plan: StepPlan, phases: StepPhases | None) -> Launched:
        launched = self._runner.launch(plan, phases)
        self._in_flight += 1
        return launched

    def _finish(self, launched: Launched) -> StepResult:
        try:
            return self._runner.finish(launched)
        finally:
            self._in_flight -= 1

    def _timed(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """fn's value (on the worker), and how long the device waited for it (ms): since the worker's
        last job for a step ended, or nothing while a step launched before is still computing."""
        idle_s = time.perf_counter() - self._idle_since if not self._in_flight else 0.0
        try:
            value = fn(*args)
        finally:
            self._idle_since = time.perf_counter()
        return value, idle_s * 1e3

    async def step_frame(self, plan: bytes, metadata: step_channel.Metadata) -> tuple[int, bytes]:
        """A request on the step socket (loom_proto.step_channel): the reply's status and payload."""
        try:
            result = await self.run_step(from_pb(pb.StepPlan.FromString(plan)), metadata)
        except ValueError as error:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], describe(error).encode()
        except Exception as error:
            return grpc.StatusCode.INTERNAL.value[0], describe(error).encode()
        return step_channel.OK, to_pb(result).SerializeToString()

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        await self._on_worker(context, self._runner.release, list(request.request_ids))
        return pb.ReleaseResponse()

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearCacheResponse:
        await self._on_worker(context, self._runner.clear)
        return pb.ClearCacheResponse()

    # ---- LoRA adapters: read beside the steps, added between two ----------------------------

    async def LoadLora(self, request: pb.LoadLoraRequest, context: grpc.aio.ServicerContext) -> pb.LoraResponse:
        try:
            adapter = await self._run(self._io, self._runner.read_lora, request.path)
            await self._run(self._worker, self._runner.add_lora, request.lora_id, adapter)
        except AdapterError as error:
            log.warning("adapter %s refused: %s", request.path, error)
            return pb.LoraResponse(ok=False, message=str(error))
        log.info("adapter %d loaded from %s", request.lora_id, request.path)
        return pb.LoraResponse(ok=True, digest=adapter.digest)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: grpc.aio.ServicerContext) -> pb.LoraResponse:
        found = await self._on_worker(context, self._runner.unload_lora, request.lora_id)
        return pb.LoraResponse(ok=found, message="" if found else f"adapter id {request.lora_id} is not loaded")

    # ---- snapshots: a status in the reply, never a gRPC error, for what the router maps ----

    async def SaveSnapshot(
        self, request: pb.SaveSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveSnapshotResponse:
        reply = await self._snapshot_call("SaveSnapshot", self._save(request), context)
        return pb.SaveSnapshotResponse(
            status=snapshot_status_to_pb(reply.status), message=reply.message, num_bytes=reply.num_bytes
        )

    async def LoadSnapshot(
        self, request: pb.LoadSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadSnapshotResponse:
        reply = await self._snapshot_call("LoadSnapshot", self._load(request), context)
        return pb.LoadSnapshotResponse(
            status=snapshot_status_to_pb(reply.status), message=reply.message,
            token_ids=reply.token_ids, num_bytes=reply.num_bytes,
        )

    async def FillSnapshot(
        self, request: pb.FillSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.FillSnapshotResponse:
        reply = await self._snapshot_call("FillSnapshot", self._fill(request), context)
        return pb.FillSnapshotResponse(status=snapshot_status_to_pb(reply.status), message=reply.message)

    async def CommitSnapshot(
        self, request: pb.CommitSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitSnapshotResponse:
        reply = await self._snapshot_call("CommitSnapshot", self._commit(request), context)
        return pb.CommitSnapshotResponse(status=snapshot_status_to_pb(reply.status), message=reply.message,
                                         num_bytes=reply.num_bytes)

    async def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        listed: list[SnapshotEntry] = []

        async def run() -> SnapshotReply:
            listed.extend(await self._run(self._io, self._parts.list_snapshots, request.name or None))
            return SnapshotReply(SnapshotStatus.OK)

        reply = await _snapshot_call("ListSnapshots", run())
        return pb.ListSnapshotsResponse(status=snapshot_status_to_pb(reply.status), message=reply.message,
                                        entries=[_entry_to_pb(entry) for entry in listed])

    async def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        async def run() -> SnapshotReply:
            token_ids = await self._run(self._io, self._parts.delete, request.name)
            return SnapshotReply(SnapshotStatus.OK, token_ids=token_ids)

        reply = await _snapshot_call("DeleteSnapshot", run())
        return pb.DeleteSnapshotResponse(status=snapshot_status_to_pb(reply.status), message=reply.message,
                                         token_ids=reply.token_ids)

    async def _snapshot_call(self, rpc: str, call: Awaitable[SnapshotReply],
                             context: grpc.aio.ServicerContext) -> SnapshotReply:
        if self._tracer is None:
            return await _snapshot_call(rpc, call)
        return await self._tracer.snapshot(rpc, context.invocation_metadata(), _snapshot_call(rpc, call))

    async def _run(self, executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def _save(self, request: pb.SaveSnapshotRequest) -> SnapshotReply:
        self._parts.folder(request.dir_name)  # fail before copying anything (disabled, bad name)
        fingerprint = model_fingerprint(self._runner.info(), request.tokenizer_hash, request.adapter)
        token_ids = list(request.token_ids)
        layout, kv = await self._run(self._worker, self._runner.read_kv, list(request.block_ids), len(token_ids))
        num_bytes = await self._run(self._io, self._parts.save, request.dir_name, fingerprint, token_ids, layout, kv)
        return SnapshotReply(SnapshotStatus.OK, num_bytes=num_bytes)

    async def _load(self, request: pb.LoadSnapshotRequest) -> SnapshotReply:
        fingerprint = model_fingerprint(self._runner.info(), request.tokenizer_hash, request.adapter)
        loaded = await self._run(self._io, self._parts.load, request.dir_name, request.load_id, fingerprint)
        return SnapshotReply(SnapshotStatus.OK, num_bytes=loaded.num_bytes, token_ids=loaded.header.token_ids)

    async def _commit(self, request: pb.CommitSnapshotRequest) -> SnapshotReply:
        fingerprint = model_fingerprint(self._runner.info(), request.tokenizer_hash, request.adapter)
        manifest = await self._run(self._io, self._parts.commit, request.staging_name, request.name,
                                   fingerprint, list(request.token_ids))
        return SnapshotReply(SnapshotStatus.OK, num_bytes=manifest.num_bytes)

    async def _fill(self, request: pb.FillSnapshotRequest) -> SnapshotReply:
        loaded = self._parts.take(request.load_id)
        if not request.block_ids:
            return SnapshotReply(SnapshotStatus.OK)  # only forget it
        if loaded is None:
            raise SnapshotError(SnapshotStatus.NOT_FOUND, f"no loaded snapshot {request.load_id!r}")
        await self._run(self._worker, self._runner.write_kv, list(request.block_ids),
                        list(request.block_indices), loaded.header.layout, loaded.kv)
        return SnapshotReply(SnapshotStatus.OK)


def _entry_to_pb(entry: SnapshotEntry) -> pb.SnapshotEntry:
    if entry.manifest is not None:
        return pb.SnapshotEntry(name=entry.name, status=snapshot_status_to_pb(SnapshotStatus.OK),
                                manifest_json=entry.manifest.to_json().decode())
    assert entry.error is not None
    return pb.SnapshotEntry(name=entry.name, status=snapshot_status_to_pb(entry.error.status),
                            message=entry.error.message)


async def _snapshot_call(name: str, call: Awaitable[SnapshotReply]) -> SnapshotReply:
    """Run a snapshot operation; its failure becomes a status and the shard keeps serving."""
    try:
        return await call
    except SnapshotError as error:
        log.warning("%s: %s: %s", name, error.status.value, error.message)
        return SnapshotReply(error.status, error.message)
    except ValueError as error:
        log.warning("%s rejected: %s", name, describe(error))
        return SnapshotReply(SnapshotStatus.INVALID, describe(error))
    except Exception as error:
        log.exception("%s failed", name)
        return SnapshotReply(SnapshotStatus.FAILED, describe(error))


def new_worker() -> ThreadPoolExecutor:
    """The one thread that runs every forward.

    The model should be built on it too: each thread that runs torch ops gets its own
    OpenMP team, and two teams on one machine's cores slowed a CPU decode step by half
    (25 -> 38 ms at batch 1, bench/BENCHMARKS.md); CUDA's current device is per thread too.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-forward")


async def start_server(
    runner: Runner, uds_path: str | None = None, snapshot_dir: str | None = None,
    worker: ThreadPoolExecutor | None = None, tracer: ShardTracer | None = None, *,
    tcp_address: str | None = None, secret: str | None = None, launch_ahead: bool | None = None,
) -> tuple[grpc.aio.Server, ShardServicer]:
    """Serve `runner` on the unix socket at `uds_path` (a stale socket file there is replaced; a
    live one, another server's, is an OSError),
    with Step also on its step socket (loom_proto.step_channel, closed with the servicer), or on
    TCP at `tcp_address` (host:port; steps over gRPC). With `secret`, every call must carry it
    (loom_shard.auth); TCP without one is refused: anyone on the network could drive the model.
    `launch_ahead`: ShardServicer's (None: on CUDA)."""
    if (uds_path is None) == (tcp_address is None):
        raise ValueError("serve on exactly one of a unix socket and a TCP address")
    if tcp_address is not None and secret is None:
        raise ValueError(f"refusing to serve on tcp {tcp_address} without the shard secret")
    if uds_path is not None:  # gRPC would replace a live one (the step socket's serve() checks its own)
        step_channel.refuse_live_socket(uds_path)
    interceptors = [] if secret is None else [SecretInterceptor(secret, runner.info().rank)]
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    servicer = ShardServicer(runner, snapshot_dir, worker, tracer, launch_ahead)
    shard_pb2_grpc.add_ShardServicer_to_server(servicer, server)
    target = f"unix://{uds_path}" if uds_path is not None else str(tcp_address)
    try:
        server.add_insecure_port(target)
    except RuntimeError as error:  # grpc's way of saying bind() failed
        raise OSError(f"cannot serve on {target}: {error}") from None
    await server.start()
    if uds_path is not None:
        servicer.step_server = await step_channel.serve(step_channel.socket_path(uds_path), servicer.step_frame)
    return server, servicer


async def serve(runner: Runner, config: ShardConfig, worker: ThreadPoolExecutor | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if config.snapshot_dir:
        Path(config.snapshot_dir).mkdir(parents=True, exist_ok=True)
        if config.rank == 0:
            clean_leftovers(Path(config.snapshot_dir))  # staging and trash folders of a crash
    tracer = configure_tracing(config.otlp_endpoint, config.rank)
    server, servicer = await start_server(runner, config.uds_path, config.snapshot_dir, worker, tracer,
                                          tcp_address=config.tcp_address, secret=config.resolved_shard_secret(),
                                          launch_ahead=config.launch_ahead)
    # The model, torch and the KV pools (after warmup, the CUDA graphs) stay for the process's life:
    # out of the collector's reach, a full collection scans what steps allocate, not ~300k startup
    # objects (~100 ms, a stall of every stream when it lands mid-step).
    freeze_startup_heap()
    servicer.on_warm = freeze_startup_heap
    where = f"uds={config.uds_path}" if config.uds_path is not None else f"tcp={config.tcp_address}"
    print(f"loom-shard ready rank={config.rank} {where}", flush=True)
    await stop.wait()
    log.info("stopping rank %d", config.rank)
    await server.stop(STOP_GRACE_S)
    servicer.close()
    if tracer is not None:
        await asyncio.to_thread(tracer.shutdown)  # the last spans


def parse_config(argv: Sequence[str] | None = None) -> ShardConfig:
    return config_module.parse_config(ShardConfig, argv, "loom-shard", "Serve one Loom shard (one TP rank) "
                                      "over gRPC. Started by loom-launcher, which hands it its config as JSON.")


def init_distributed(config: ShardConfig) -> None:
    """Join the tensor-parallel group: gloo on CPU, nccl on CUDA (one GPU per rank)."""
    import torch  # only here: the server itself does not need torch
    import torch.distributed as dist

    from loom_shard.runtime.model_setup import resolve_device

    backend = "gloo"
    device = resolve_device(config.device, config.gpu_index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
    )


def close_distributed(config: ShardConfig) -> None:
    if config.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def build_runner(config: ShardConfig) -> Runner:
    from loom_shard.runtime.runner import ModelRunner  # loads torch and the model code

    return ModelRunner(config)


def fail(message: str, status: int) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)  # one line
    return status


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # where its parent asked for it (a Ray actor's shard)
    config = parse_config(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Until serve() takes the signals over, SIGTERM stops a long model load like SIGINT does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from loom_shard.loading.loader import ModelLoadError
    from loom_shard.runtime.model_setup import ShardSetupError, keep_freed_memory_mapped

    try:
        config.resolved_shard_secret()  # a missing secret file fails now, not after the model loads
    except ValueError as error:
        return fail(str(error), EXIT_SERVE_ERROR)
    keep_freed_memory_mapped()  # before the worker thread allocates: it then uses the main heap
    worker = new_worker()

    def load() -> Runner:
        if config.world_size > 1:
            init_distributed(config)
        return build_runner(config)

    try:
        runner = worker.submit(load).result()
        run_event_loop(serve(runner, config, worker))
    except KeyboardInterrupt:
        return 0
    except (ModelLoadError, ShardSetupError) as error:
        return fail(str(error), EXIT_MODEL_LOAD_ERROR)
    except OSError as error:
        return fail(str(error), EXIT_SERVE_ERROR)
    finally:
        # An interrupted load runs to its end on the worker (threads cannot be killed) before exit.
        worker.shutdown(wait=False, cancel_futures=True)
        close_distributed(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
