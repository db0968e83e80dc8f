"""The router's side of the shard protocol: one async client for every tensor-parallel rank.

Every rank gets the same message; only rank 0's answer is used. A failing rank
surfaces as a `ShardError` naming the rank and the shard's own message. Steps go over each
shard's step socket (loom_proto.step_channel) when every rank serves one, else over gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from loom_proto import shard_pb2_grpc, step_channel
from loom_proto.codec import from_pb, pb, snapshot_entry_from_pb, snapshot_reply_from_pb
from loom_proto.shard_auth import secret_metadata
from loom_proto.snapshot import SnapshotEntry, SnapshotReply
from loom_proto.step import ModelInfo, StepPlan, StepResult, WarmupResult
from loom_proto.wire import encode_plan
from loom_router.types import ShardDivergence

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC's default reconnect backoff grows to minutes; a shard that is still
    # loading its model should be noticed within a second of binding its socket.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
STEP_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Shard'].full_name}/Step"
HEALTH_TIMEOUT_S = 2.0
# After one rank fails a step, how long the others get to fail it too (a plan every rank
# refuses is not a divergence); a rank still busy then is stuck in a collective.
DIVERGENCE_GRACE_S = 0.5  # every rank checks a plan before running it: a refusal is quick

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]  # gRPC call metadata (the trace context)


class ShardError(Exception):
    """A shard rank failed an RPC; `code` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, rank: int, code: str, message: str) -> None:
        super().__init__(f"shard rank {rank}: {code}: {message}")
        self.rank = rank
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Rank:
    channel: grpc.aio.Channel
    stub: shard_pb2_grpc.ShardStub
    step: Callable[[bytes], Awaitable[Any]]  # takes the serialized plan


def grpc_target(where: str) -> str:
    """A gRPC target: `unix://path` and `host:port` as given, a bare path as a unix socket."""
    if "://" in where or (":" in where and not where.startswith(("/", "."))):
        return where
    return f"unix://{where}"


def _open_rank(where: str, is_rank0: bool) -> _Rank:
    channel = grpc.aio.insecure_channel(grpc_target(where), options=CHANNEL_OPTIONS)
    # Step sends pre-serialized bytes (serialized once for all ranks) and only
    # rank 0's reply is parsed; the other ranks' replies stay bytes.
    step = channel.unary_unary(
        STEP_METHOD,
        request_serializer=None,
        response_deserializer=pb.StepResult.FromString if is_rank0 else None,
    )
    return _Rank(channel=channel, stub=shard_pb2_grpc.ShardStub(channel), step=step)


class ShardClient:
    """Talks to all ranks of one model over unix sockets or TCP (rank order = `targets` order).

    With `secret`, every call carries it (loom_proto.shard_auth): shards on TCP demand it.
    """

    def __init__(self, targets: Sequence[str], secret: str | None = None) -> None:
        if not targets:
            raise ValueError("ShardClient needs at least one shard socket")
        self._auth: Metadata = () if secret is None else (secret_metadata(secret),)
        self.healthy_by_rank: list[bool] = []  # the last health check's answers
        self.last_step_ms_by_rank: list[float] = []  # the last step's wall time per rank, for the metrics
        # --otlp-endpoint: the current span's trace context as call metadata (RequestTracer.grpc_metadata),
        # sent with Step and the snapshot calls so that the shards' spans join the router's trace.
        self.trace_metadata: Callable[[], Metadata | None] | None = None
        self._targets = list(targets)
        # Channels bind to the event loop they are made in: open them on first use.
        self._ranks: list[_Rank] | None = None
        # Each rank's step socket, connected on the first step (None: not tried yet; []: gRPC).
        self._step_channels: list[step_channel.ClientProtocol] | None = None

    def _metadata(self) -> Metadata | None:
        """Every call's metadata: the secret, and the trace context when tracing."""
        trace = None if self.trace_metadata is None else self.trace_metadata()
        if trace is None:
            return self._auth or None
        return (*self._auth, *trace)

    @property
    def world_size(self) -> int:
        return len(self._targets)

    def _all_ranks(self) -> list[_Rank]:
        if self._ranks is None:
            self._ranks = [_open_rank(target, rank == 0) for rank, target in enumerate(self._targets)]
        return self._ranks

    async def _on_all(self, call: Callable[[_Rank], Awaitable[T]]) -> list[T]:
        """Run `call` on every rank concurrently; the first failing rank raises ShardError."""
        ranks = self._all_ranks()
        if len(ranks) == 1:
            try:
                return [await call(ranks[0])]
            except grpc.aio.AioRpcError as error:
                raise _shard_error(0, error) from None
        tasks = [asyncio.ensure_future(call(r)) for r in ranks]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # A rank that failed may leave the others blocked in a collective: do not
            # wait for them (nor leave calls behind when this coroutine is cancelled).
            for task in tasks:
                task.cancel()
        for rank, task in enumerate(tasks):
            error = task.exception() if task.done() and not task.cancelled() else None
            if isinstance(error, grpc.aio.AioRpcError):
                raise _shard_error(rank, error) from None
            if error is not None:
                raise error
        return [task.result() for task in tasks]

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every rank accepts connections and answers Health; ShardError on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for rank, r in enumerate(self._all_ranks()):
            try:
                await asyncio.wait_for(r.channel.channel_ready(), max(deadline - loop.time(), 0.0))
                await r.stub.Health(pb.HealthRequest(), timeout=max(deadline - loop.time(), 0.001),
                                    metadata=self._auth)
            except (TimeoutError, grpc.aio.AioRpcError) as error:
                detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else "no answer"
                raise ShardError(rank, "UNAVAILABLE", f"not ready after {timeout_s:g} s ({detail})") from None

    async def _on_rank0(self, call: Callable[[_Rank], Awaitable[T]]) -> T:
        try:
            return await call(self._all_ranks()[0])
        except grpc.aio.AioRpcError as error:
            raise _shard_error(0, error) from None

    async def info(self) -> ModelInfo:
        """Rank 0's model fingerprint."""
        return from_pb(await self._on_rank0(lambda r: r.stub.Info(pb.InfoRequest(), metadata=self._auth)))

    async def health(self) -> bool:
        """True when every rank answers Health in time; each rank's answer stays in
        `healthy_by_rank` for the metrics."""

        async def ask(r: _Rank) -> bool:
            try:
                return bool((await r.stub.Health(pb.HealthRequest(), timeout=HEALTH_TIMEOUT_S,
                                                     metadata=self._auth)).ok)
            except grpc.aio.AioRpcError:
                return False

        self.healthy_by_rank = list(await asyncio.gather(*(ask(r) for r in self._all_ranks())))
        return all(self.healthy_by_rank)

    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        """Warm every rank up together (the forward has collectives); the pool is the smallest rank's."""
        request = pb.WarmupRequest(
            max_prefill_tokens=max_prefill_tokens, max_batch_total_tokens=max_batch_total_tokens
        )
        replies = await self._on_all(lambda r: r.stub.Warmup(request, metadata=self._auth))
        results: list[WarmupResult] = [from_pb(m) for m in replies]
        return WarmupResult(
            num_blocks=min(w.num_blocks for w in results),
            num_host_blocks=min(w.num_host_blocks for w in results),
            block_size=results[0].block_size,
        )

    async def step(self, plan: StepPlan) -> StepResult:
        """Send the same plan to every rank at once; return rank 0's result.

        Raises ShardError when every rank failed the step (the router rolls it back), and
        ShardDivergence when some ranks ran it and others failed or did not answer in time
        after the first failure (a rank stuck in a collective): that group cannot go on.
        """
        data = encode_plan(plan)
        metadata = self._metadata()
        if self._step_channels is None:
            self._step_channels = await self._connect_step_channels()
        channels = self._step_channels

        async def timed(rank: int) -> tuple[Any, float]:
            # Other ranks' replies stay undecoded bytes: their wall time is what the metrics get.
            start = time.perf_counter()
            if channels:
                reply = await self._step_frame(rank, channels[rank], data, metadata)
            else:
                reply = await self._all_ranks()[rank].step(data, metadata=metadata)
            return reply, (time.perf_counter() - start) * 1000.0

        if self.world_size == 1:
            try:
                reply, ms = await timed(0)
            except grpc.aio.AioRpcError as error:
                raise _shard_error(0, error) from None
            self.last_step_ms_by_rank = [ms]
            return from_pb(reply)
        tasks = [asyncio.ensure_future(timed(rank)) for rank in range(self.world_size)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            pending = [t for t in tasks if not t.done()]
            if pending:  # one rank failed: the others fail the same plan soon, or are stuck
                await asyncio.wait(pending, timeout=DIVERGENCE_GRACE_S)
        finally:
            for task in tasks:
                task.cancel()
        reply, _ = agreed_step_reply(tasks)
        self.last_step_ms_by_rank = [task.result()[1] for task in tasks]
        return from_pb(reply)

    async def _step_frame(self, rank: int, channel: step_channel.ClientProtocol, data: bytes,
                          metadata: Metadata | None) -> Any:
        """One step on a rank's step socket; rank 0's reply parsed (the others' stay bytes)."""
        try:
            status, payload = await channel.request(data, metadata)
        except step_channel.ChannelClosed as error:
            self._step_channels = None  # reconnect (or fall back to gRPC) for the next step
            raise ShardError(rank, "UNAVAILABLE", str(error)) from None
        if status != step_channel.OK:
            code = next((c.name for c in grpc.StatusCode if c.value[0] == status), str(status))
            raise ShardError(rank, code, payload.decode(errors="replace"))
        return pb.StepResult.FromString(payload) if rank == 0 else payload

    async def _connect_step_channels(self) -> list[step_channel.ClientProtocol]:
        """Every rank's step socket, or [] (steps over gRPC) when any rank serves none (a shard
        on TCP never does: the step socket is a local unix socket beside the gRPC one)."""
        targets = [grpc_target(target) for target in self._targets]
        if not all(target.startswith("unix://") for target in targets):
            return []
        channels = []
        for path in (target.removeprefix("unix://") for target in targets):
            try:
                channels.append(await step_channel.connect(step_channel.socket_path(path)))
            except OSError:
                for channel in channels:
                    channel.close()
                return []
        return channels

    async def release(self, request_ids: Sequence[int]) -> None:
        request = pb.ReleaseRequest(request_ids=request_ids)
        await self._on_all(lambda r: r.stub.Release(request, metadata=self._auth))

    async def clear_cache(self) -> None:
        await self._on_all(lambda r: r.stub.ClearCache(pb.ClearCacheRequest(), metadata=self._auth))

    # ---- LoRA adapters: every rank holds its share of each ----------------------------------

    async def load_lora(self, lora_id: int, path: str) -> list[tuple[bool, str, str]]:
        """Each rank reads and checks the adapter; (ok, why not, its files' sha256) per rank, in rank order."""
        request = pb.LoadLoraRequest(lora_id=lora_id, path=path)
        replies = await self._on_all(lambda r: r.stub.LoadLora(request, metadata=self._auth))
        return [(m.ok, m.message, m.digest) for m in replies]

    async def unload_lora(self, lora_id: int) -> None:
        request = pb.UnloadLoraRequest(lora_id=lora_id)
        await self._on_all(lambda r: r.stub.UnloadLora(request, metadata=self._auth))

    # ---- snapshots: every rank handles its own part; the replies come back in rank order ----

    async def save_snapshot(self, dir_name: str, block_ids: Sequence[int], token_ids: Sequence[int],
                            tokenizer_hash: str, adapter: str = "") -> list[SnapshotReply]:
        """Each rank copies the blocks' KV and writes its part into the staging folder dir_name
        (adapter: the LoRA adapter's identity the KV was computed with; empty: the base model)."""
        request = pb.SaveSnapshotRequest(dir_name=dir_name, block_ids=block_ids, token_ids=token_ids,
                                         tokenizer_hash=tokenizer_hash, adapter=adapter)
        metadata = self._metadata()
        replies = await self._on_all(lambda r: r.stub.SaveSnapshot(request, metadata=metadata))
        return [snapshot_reply_from_pb(m) for m in replies]

    async def load_snapshot(self, dir_name: str, load_id: str, tokenizer_hash: str,
                            adapter: str = "") -> list[SnapshotReply]:
        """Each rank reads and verifies its part, keeping its KV under load_id."""
        request = pb.LoadSnapshotRequest(dir_name=dir_name, load_id=load_id, tokenizer_hash=tokenizer_hash,
                                         adapter=adapter)
        metadata = self._metadata()
        replies = await self._on_all(lambda r: r.stub.LoadSnapshot(request, metadata=metadata))
        return [snapshot_reply_from_pb(m) for m in replies]

    async def fill_snapshot(self, load_id: str, block_ids: Sequence[int],
                            block_indices: Sequence[int]) -> list[SnapshotReply]:
        """Each rank writes the loaded KV into the blocks (none: forgets it)."""
        request = pb.FillSnapshotRequest(load_id=load_id, block_ids=block_ids, block_indices=block_indices)
        metadata = self._metadata()
        replies = await self._on_all(lambda r: r.stub.FillSnapshot(request, metadata=metadata))
        return [snapshot_reply_from_pb(m) for m in replies]

    # ---- the snapshot folders: rank 0 handles them (the ranks share the directory) ----

    async def commit_snapshot(self, staging_name: str, name: str, token_ids: Sequence[int],
                              tokenizer_hash: str, adapter: str = "") -> SnapshotReply:
        """Rank 0 writes the manifest and renames the staging folder to `name`."""
        request = pb.CommitSnapshotRequest(staging_name=staging_name, name=name, token_ids=token_ids,
                                           tokenizer_hash=tokenizer_hash, adapter=adapter)
        metadata = self._metadata()
        reply = await self._on_rank0(lambda r: r.stub.CommitSnapshot(request, metadata=metadata))
        return snapshot_reply_from_pb(reply)

    async def list_snapshots(self, name: str = "") -> tuple[SnapshotReply, list[SnapshotEntry]]:
        """Every snapshot's manifest (or one, by name), each with its status."""
        reply = await self._on_rank0(lambda r: r.stub.ListSnapshots(pb.ListSnapshotsRequest(name=name),
                                                                 metadata=self._auth))
        return snapshot_reply_from_pb(reply), [snapshot_entry_from_pb(e) for e in reply.entries]

    async def delete_snapshot(self, name: str) -> SnapshotReply:
        """Rank 0 removes the folder; the reply carries the snapshot's token ids."""
        request = pb.DeleteSnapshotRequest(name=name)
        reply = await self._on_rank0(lambda r: r.stub.DeleteSnapshot(request, metadata=self._auth))
        return snapshot_reply_from_pb(reply)

    async def close(self) -> None:
        for channel in self._step_channels or ():
            channel.close()
        self._step_channels = None
        if self._ranks is not None:
            await asyncio.gather(*(r.channel.close() for r in self._ranks))
            self._ranks = None


def agreed_step_reply(tasks: list[asyncio.Future[Any]]) -> Any:
    """Rank 0's reply when every rank succeeded; the first rank's ShardError when every rank
    failed; ShardDivergence (naming the ranks) otherwise."""
    outcomes = [TimeoutError("no answer") if not t.done() or t.cancelled() else t.exception()
                for t in tasks]
    if all(error is None for error in outcomes):
        return tasks[0].result()
    errors = [_shard_error(rank, e) if isinstance(e, grpc.aio.AioRpcError) else e
              for rank, e in enumerate(outcomes)]
    if all(isinstance(error, ShardError) for error in errors):
        raise errors[0]  # type: ignore[misc]
    ran = [rank for rank, error in enumerate(errors) if error is None]
    detail = "; ".join(f"rank {rank}: {error!r}" for rank, error in enumerate(errors) if error is not None)
    raise ShardDivergence(f"tensor-parallel ranks diverged on a step (ranks {ran} ran it; {detail}): "
                          "their KV state may differ, so the server stops")


def _shard_error(rank: int, error: grpc.aio.AioRpcError) -> ShardError:
    return ShardError(rank, error.code().name, error.details() or "")
