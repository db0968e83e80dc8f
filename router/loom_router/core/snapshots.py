"""KV snapshots, the engine core's side: save a sequence's KV to `--snapshot-dir`, restore it into
the prefix cache, list and delete snapshots. Every block manager change runs in the engine loop
between steps, and the shards do the copies and all the file I/O (parts, manifest, folders: rank 0
commits and lists), so the router needs no shared folder. The frontends validate names and bodies
(loom_router.frontend.snapshots) and call these operations through the contract.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from loom_proto import snapshot as snap
from loom_proto.snapshot import Manifest, SnapshotError, SnapshotReply, SnapshotStatus
from loom_proto.step import SamplingParams
from loom_router.contract import PromptInfo, Submit
from loom_router.core.adapters import Adapter, name_of
from loom_router.core.block_manager import CachedFill, RootedTokens
from loom_router.core.engine import Engine
from loom_router.core.scheduler import Scheduler
from loom_router.core.shard_client import ShardError
from loom_router.types import NotFoundError, SnapshotHTTPError, ValidationError, error_for_status

log = logging.getLogger("loom.snapshots")

HTTP_STATUS = {
    SnapshotStatus.NOT_FOUND: 404, SnapshotStatus.DAMAGED: 422, SnapshotStatus.MISMATCH: 409,
    SnapshotStatus.INVALID: 400, SnapshotStatus.DISABLED: 501, SnapshotStatus.FAILED: 500,
}
DISABLED_MESSAGE = "snapshots are off: start the server with --snapshot-dir DIR to enable them"


def http_error(error: SnapshotError) -> SnapshotHTTPError:
    return SnapshotHTTPError(HTTP_STATUS.get(error.status, 500), error.message, error.status.value)


class _OneToken:
    """The sink of a snapshot's own one-token request: done once it finished or failed."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def token(self, group_id: int, index: int, token_id: int, logprob: float, num_generated: int,
              finish: str | None, top_tokens: list[tuple[int, float]] | None, prompt: PromptInfo | None) -> None:
        if finish is not None and not self.done.done():
            self.done.set_result(None)

    def fail(self, group_id: int, status: int, message: str) -> None:
        if not self.done.done():
            self.done.set_exception(error_for_status(status, message))


async def run(service: Snapshots, method: str, name: str, token_ids: list[int], adapter: str | None = None) -> Any:
    """One snapshot operation for a frontend's Call; raises SnapshotHTTPError (ShardError: 500)."""
    if not service.engine.config.snapshot_dir:
        raise SnapshotHTTPError(501, DISABLED_MESSAGE, "disabled")
    try:
        with _span(service, method, name):  # the shards' snapshot spans are its children
            if method == "snapshot_save":
                return await service.save(name, token_ids, adapter)
            if method == "snapshot_restore":
                return await service.restore(name)
            if method == "snapshot_delete":
                return await service.delete(name)
            return {"snapshots": await service.list_all()}
    except ShardError as error:
        raise SnapshotHTTPError(500, f"the shards failed: {error}", "failed") from None


def _span(service: Snapshots, method: str, name: str) -> AbstractContextManager[object]:
    tracer = service.engine.tracer
    action = method.removeprefix("snapshot_")
    if tracer is None or action not in ("save", "restore"):
        return nullcontext()
    return tracer.span(f"snapshot.{action}", {"loom.snapshot.name": name})


class Snapshots:
    """Save / restore / delete / list against one engine and its shards. The router decides
    (names, what to save, when); the shards own every file, so it needs no shared folder."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tokenizer_hash: str | None = None
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # one operation per name

    async def tokenizer_hash(self) -> str:
        if self._tokenizer_hash is None:
            self._tokenizer_hash = await asyncio.to_thread(self.engine.tokenizer.token_bytes_hash)
        return self._tokenizer_hash

    async def fingerprint(self, adapter: str = "") -> dict[str, Any]:
        return snap.model_fingerprint(self.engine.model_info, await self.tokenizer_hash(), adapter)

    def _adapter(self, name: str | None) -> Adapter | None:
        """The loaded adapter named (None: the base model). Raises SnapshotHTTPError 404."""
        if name is None:
            return None
        try:
            return self.engine.adapters.get(name)
        except NotFoundError as error:
            raise SnapshotHTTPError(404, str(error), "not_found") from None

    @property
    def world_size(self) -> int:
        return self.engine.model_info.world_size

    # ---- save ----

    async def save(self, name: str, token_ids: list[int], adapter_name: str | None = None) -> dict[str, Any]:
        """Save token_ids' KV (computed with the adapter named, or the base model) as `name`."""
        start = time.perf_counter()
        adapter = self._adapter(adapter_name)
        identity = adapter.identity if adapter else ""
        try:
            self.engine.validate_lengths(len(token_ids), 1, 1)  # the frontend checked already
        except ValidationError as error:
            raise SnapshotHTTPError(422, str(error), "validation") from None
        client = self.engine.client
        async with self._locks[name]:
            staging = f"{snap.STAGING_PREFIX}{uuid.uuid4().hex}"
            try:
                await self._compute_and_write(staging, token_ids, adapter)
                reply = await client.commit_snapshot(staging, name, token_ids, await self.tokenizer_hash(), identity)
                _raise_for([reply])
            except BaseException:
                await _quietly(client.delete_snapshot(staging))  # a partial staging folder
                raise
        return _answer(name, len(token_ids), reply.num_bytes, start)

    async def _compute_and_write(self, staging: str, token_ids: list[int], adapter: Adapter | None) -> None:
        """Prefill what the cache lacks (one greedy token, with the adapter), then have the shards
        write the KV of every token while the request's blocks are still held."""
        request = Submit(-1, 0, token_ids, [SamplingParams(seed=0)], max_new_tokens=1, ignore_eos=True,
                         adapter=adapter.name if adapter else None)
        sink = _OneToken()
        group_id = self.engine.add(request, sink, hold_blocks=True)
        try:
            await sink.done
            held = self.engine.held.get(group_id)
            assert held is not None, "a finished hold_blocks request holds its blocks"
            num_blocks = -(-len(token_ids) // self.engine.scheduler.block_manager.block_size)
            block_ids = held.block_table[:num_blocks]
            replies = await self.engine.client.save_snapshot(staging, block_ids, token_ids,
                                                             await self.tokenizer_hash(),
                                                             adapter.identity if adapter else "")
        finally:
            self.engine.cancel(group_id)  # a no-op once finished
            self.engine.release_held(group_id)
        _raise_for(replies)

    # ---- restore ----

    async def restore(self, name: str) -> dict[str, Any]:
        start = time.perf_counter()
        async with self._locks[name]:
            manifest = await self._manifest(name)
            await self._check(manifest)
            identity = _identity(manifest)
            adapter = self.engine.adapters.by_identity(identity) if identity else None
            root = adapter.hash_root if adapter else None  # its blocks are hit by requests naming it
            load_id = uuid.uuid4().hex
            client = self.engine.client
            try:
                replies = await client.load_snapshot(name, load_id, await self.tokenizer_hash(), identity)
                _raise_for(replies)
                token_ids = RootedTokens(_agreed_tokens(replies, manifest), root)
                fill = await self._between_steps(lambda s: _reserve(s, token_ids))
                await self._fill(load_id, fill)
            finally:
                await _forget(client, load_id)
        return _answer(name, len(token_ids), sum(r.num_bytes for r in replies), start)

    async def _manifest(self, name: str) -> Manifest:
        reply, entries = await self.engine.client.list_snapshots(name)
        _raise_for([reply])
        entry = entries[0]
        if entry.manifest is None:
            assert entry.error is not None
            raise http_error(entry.error)
        return entry.manifest

    async def _check(self, manifest: Manifest) -> None:
        """MISMATCH (409) unless the snapshot was written for this model and shard count."""
        reason = await self._mismatch(manifest)
        if reason is not None:
            raise SnapshotHTTPError(409, reason, "mismatch")

    async def _mismatch(self, manifest: Manifest) -> str | None:
        if manifest.num_shards != self.world_size:
            return f"shard count: the snapshot has {manifest.num_shards}, the server {self.world_size} (--num-shard)"
        identity = _identity(manifest)
        if identity and self.engine.adapters.by_identity(identity) is None:
            return (f"its KV was computed with the LoRA adapter {name_of(identity)!r}, which is not loaded "
                    "(or not from the same files)")
        mismatch = snap.find_mismatch(await self.fingerprint(identity), manifest.fingerprint)
        return None if mismatch is None else f"the snapshot is for another model: {mismatch}"

    async def _fill(self, load_id: str, fill: CachedFill) -> None:
        """The shards write the reserved blocks; then they become cache entries (or, on any
        failure, go back unhashed)."""
        bm_call = self.engine.run_between_steps
        try:
            if fill.block_ids:
                _raise_for(await self.engine.client.fill_snapshot(load_id, fill.block_ids, fill.block_indices))
        except BaseException:
            bm_call(lambda s: s.block_manager.cancel_cached(fill))
            raise
        await self._between_steps(lambda s: s.block_manager.commit_cached(fill))

    async def _between_steps(self, fn: Any) -> Any:
        """Await fn(scheduler) run in the engine loop; if this handler is cancelled after it
        ran, a reservation it made is given back rather than leaked."""
        future = self.engine.run_between_steps(fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._cancel_orphan)
            raise

    def _cancel_orphan(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None and isinstance(future.result(), CachedFill):
            fill = future.result()
            self.engine.run_between_steps(lambda s: s.block_manager.cancel_cached(fill))

    # ---- delete, list ----

    async def delete(self, name: str) -> dict[str, Any]:
        async with self._locks[name]:
            listed, entries = await self.engine.client.list_snapshots()  # its manifest names its adapter
            reply = await self.engine.client.delete_snapshot(name)
            _raise_for([reply])
        # Its prefix-cache entries go too, unless a running request still uses them or another
        # snapshot (a copy, a longer one) holds the same tokens.
        if listed.status is not SnapshotStatus.OK:
            return {"name": name, "deleted": True, "cached_blocks_dropped": 0}
        manifests = {entry.name: entry.manifest for entry in entries if entry.manifest is not None}
        deleted = manifests.pop(name, None)
        token_ids = self._cached_tokens(deleted) if deleted else RootedTokens(reply.token_ids, None)
        keep = [self._cached_tokens(manifest) for manifest in manifests.values()]
        num_dropped = await self.engine.run_between_steps(lambda s: s.block_manager.drop_cached(token_ids, keep))
        return {"name": name, "deleted": True, "cached_blocks_dropped": num_dropped}

    async def list_all(self) -> list[dict[str, Any]]:
        reply, entries = await self.engine.client.list_snapshots()
        _raise_for([reply])
        listed = []
        for entry in entries:
            if entry.manifest is None:
                assert entry.error is not None
                listed.append({"name": entry.name, "tokens": None, "bytes": None, "created": None, "adapter": None,
                               "fits": False, "reason": entry.error.message})
                continue
            manifest, reason = entry.manifest, await self._mismatch(entry.manifest)
            identity = _identity(manifest)
            listed.append({"name": entry.name, "tokens": manifest.num_tokens, "bytes": manifest.num_bytes,
                           "created": manifest.created, "adapter": name_of(identity) if identity else None,
                           "fits": reason is None, "reason": reason})
        return listed

    def _cached_tokens(self, manifest: Manifest) -> RootedTokens:
        """A snapshot's tokens under the hash root its blocks are cached with: its adapter's while
        that adapter is loaded (an unloaded one's blocks can never be hit again, and age out)."""
        identity = _identity(manifest)
        adapter = self.engine.adapters.by_identity(identity) if identity else None
        return RootedTokens(manifest.token_ids, adapter.hash_root if adapter else None)


async def _quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except Exception as error:  # noqa: BLE001 (cleanup of a failure already being reported)
        log.warning("snapshot cleanup failed: %s", error)


def _raise_for(replies: list[SnapshotReply]) -> None:
    """The first rank that failed decides the answer (its status says which HTTP code)."""
    for rank, reply in enumerate(replies):
        if reply.status is not SnapshotStatus.OK:
            prefix = f"shard {rank}: " if len(replies) > 1 else ""
            raise SnapshotHTTPError(HTTP_STATUS.get(reply.status, 500), prefix + reply.message, reply.status.value)


def _identity(manifest: Manifest) -> str:
    """The LoRA adapter a snapshot's KV was computed with (`Adapter.identity`); empty: the base model."""
    return manifest.fingerprint.get("adapter") or ""


def _agreed_tokens(replies: list[SnapshotReply], manifest: Manifest) -> list[int]:
    token_ids = replies[0].token_ids
    if any(r.token_ids != token_ids for r in replies) or len(token_ids) != manifest.num_tokens:
        raise SnapshotHTTPError(422, "the snapshot is damaged: its parts disagree on the tokens", "damaged")
    return token_ids


def _reserve(scheduler: Scheduler, token_ids: list[int]) -> CachedFill:
    bm = scheduler.block_manager
    if not bm.enable_prefix_caching:
        raise SnapshotHTTPError(409, "the prefix cache is off: a snapshot cannot be restored", "mismatch")
    if not bm.can_allocate_cached(token_ids):
        raise SnapshotHTTPError(503, "not enough free KV blocks to restore this snapshot now", "overloaded")
    return bm.allocate_cached(token_ids)


async def _forget(client: Any, load_id: str) -> None:
    """Drop a load the shards may still hold (a no-op after a fill)."""
    try:
        await client.fill_snapshot(load_id, [], [])
    except Exception as error:  # noqa: BLE001 (the shard bounds what it keeps; nothing to undo)
        log.warning("could not drop snapshot load %s: %s", load_id, error)


def _answer(name: str, num_tokens: int, num_bytes: int, start: float) -> dict[str, Any]:
    return {"name": name, "tokens": num_tokens, "bytes": num_bytes, "ms": round((time.perf_counter() - start) * 1e3, 2)}
