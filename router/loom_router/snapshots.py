"""KV snapshot routes: save a sequence's KV to `--snapshot-dir`, restore it into the prefix
cache, list and delete snapshots. Names are validated strictly; every block manager change
runs in the engine loop between steps, and the shards do the copies and all the file I/O
(parts, manifest, folders: rank 0 commits and lists), so the router needs no shared folder.

    POST   /snapshots/{name}?action=save     {"inputs"} | {"messages"} | {"token_ids"}
    POST   /snapshots/{name}?action=restore
    DELETE /snapshots/{name}
    GET    /snapshots
"""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.convertors import PathConvertor, register_url_convertor

from loom_proto import snapshot as snap
from loom_proto.snapshot import Manifest, SnapshotError, SnapshotReply, SnapshotStatus
from loom_proto.step import SamplingParams
from loom_router.block_manager import CachedFill
from loom_router.http_common import AppState, encode, get_state
from loom_router.metrics import note_snapshot_failure
from loom_router.scheduler import Scheduler
from loom_router.shard_client import ShardError
from loom_router.types import GenerationParams
from loom_router.validation import ChatMessage

log = logging.getLogger("loom.snapshots")

MAX_NAME_BYTES = 255
FORBIDDEN_CHARS = frozenset('/\\:*?"<>|')
INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # control, format (BOM, ZWJ...), separators
ROUTE_PREFIX = "/snapshots"
HTTP_STATUS = {
    SnapshotStatus.NOT_FOUND: 404, SnapshotStatus.DAMAGED: 422, SnapshotStatus.MISMATCH: 409,
    SnapshotStatus.INVALID: 400, SnapshotStatus.DISABLED: 501, SnapshotStatus.FAILED: 500,
}
DISABLED_MESSAGE = "snapshots are off: start the server with --snapshot-dir DIR to enable them"


class SnapshotHTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "snapshot") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    @classmethod
    def of(cls, error: SnapshotError) -> SnapshotHTTPError:
        return cls(HTTP_STATUS.get(error.status, 500), error.message, error.status.value)


def _bad_name(reason: str) -> SnapshotHTTPError:
    return SnapshotHTTPError(400, f"invalid snapshot name: {reason}", "invalid_name")


# ---- names ----------------------------------------------------------------------------------


def validate_name(raw: bytes) -> str:
    """The snapshot name in raw (URL-decoded bytes), or SnapshotHTTPError 400 saying why.

    1..255 bytes of NFC UTF-8; no path separators or `: * ? " < > |`, no `..`, no
    leading dot (reserved for the server's own folders), no leading or trailing
    whitespace, no trailing dot, no control or invisible format characters (BOM, ZWJ).
    """
    if not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise _bad_name(f"must be 1 to {MAX_NAME_BYTES} bytes, got {len(raw)}")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_name("not valid UTF-8") from None
    if ".." in name or name.startswith("."):
        raise _bad_name("no '..' and no leading '.'")
    if name != name.strip():
        raise _bad_name("no leading or trailing whitespace")
    if name.endswith("."):
        raise _bad_name("no trailing '.'")
    for char in name:
        if char in FORBIDDEN_CHARS:
            raise _bad_name(f"{char!r} is not allowed")
        if unicodedata.category(char) in INVISIBLE_CATEGORIES:
            raise _bad_name(f"control or invisible character U+{ord(char):04X} is not allowed")
    if unicodedata.normalize("NFC", name) != name:
        raise _bad_name("not in Unicode normal form C (NFC)")
    return name


def name_from_request(request: Request) -> bytes:
    """The name as the client sent it: the raw path's bytes, so invalid UTF-8 is seen as such."""
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    raw_path = raw_path.split(b"?", 1)[0]
    prefix = (request.scope.get("root_path", "") + ROUTE_PREFIX + "/").encode()
    return unquote_to_bytes(raw_path[len(prefix):] if raw_path.startswith(prefix) else b"")


# ---- the service ----------------------------------------------------------------------------


class Snapshots:
    """Save / restore / delete / list against one engine and its shards. The router decides
    (names, what to save, when); the shards own every file, so it needs no shared folder."""

    def __init__(self, state: AppState) -> None:
        self.engine = state.engine
        self._tokenizer_hash: str | None = None
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # one operation per name

    async def tokenizer_hash(self) -> str:
        if self._tokenizer_hash is None:
            self._tokenizer_hash = await asyncio.to_thread(self.engine.tokenizer.token_bytes_hash)
        return self._tokenizer_hash

    async def fingerprint(self) -> dict[str, Any]:
        return snap.model_fingerprint(self.engine.model_info, await self.tokenizer_hash())

    @property
    def world_size(self) -> int:
        return self.engine.model_info.world_size

    # ---- save ----

    async def save(self, name: str, token_ids: list[int]) -> dict[str, Any]:
        start = time.perf_counter()
        self.engine.validate_lengths(len(token_ids), 1, 1)  # ValidationError: 422
        client = self.engine.client
        async with self._locks[name]:
            staging = f"{snap.STAGING_PREFIX}{uuid.uuid4().hex}"
            try:
                await self._compute_and_write(staging, token_ids)
                reply = await client.commit_snapshot(staging, name, token_ids, await self.tokenizer_hash())
                _raise_for([reply])
            except BaseException:
                await _quietly(client.delete_snapshot(staging))  # a partial staging folder
                raise
        return _answer(name, len(token_ids), reply.num_bytes, start)

    async def _compute_and_write(self, staging: str, token_ids: list[int]) -> None:
        """Prefill what the cache lacks (one greedy token), then have the shards write the
        KV of every token while the request's blocks are still held."""
        params = GenerationParams(choices=[SamplingParams(seed=0)], max_new_tokens=1, ignore_eos=True)
        stream = self.engine.submit(token_ids, params, hold_blocks=True)
        try:
            async for _ in stream:
                pass
            assert stream.held is not None, "a finished hold_blocks request holds its blocks"
            num_blocks = -(-len(token_ids) // self.engine.scheduler.block_manager.block_size)
            block_ids = stream.held.block_table[:num_blocks]
            replies = await self.engine.client.save_snapshot(staging, block_ids, token_ids,
                                                             await self.tokenizer_hash())
        finally:
            stream.cancel()  # a no-op once finished
            self.engine.release_held(stream)
        _raise_for(replies)

    # ---- restore ----

    async def restore(self, name: str) -> dict[str, Any]:
        start = time.perf_counter()
        async with self._locks[name]:
            manifest = await self._manifest(name)
            await self._check(manifest)
            load_id = uuid.uuid4().hex
            client = self.engine.client
            try:
                replies = await client.load_snapshot(name, load_id, await self.tokenizer_hash())
                _raise_for(replies)
                token_ids = _agreed_tokens(replies, manifest)
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
            raise SnapshotHTTPError.of(entry.error)
        return entry.manifest

    async def _check(self, manifest: Manifest) -> None:
        """MISMATCH (409) unless the snapshot was written for this model and shard count."""
        reason = await self._mismatch(manifest)
        if reason is not None:
            raise SnapshotHTTPError(409, reason, "mismatch")

    async def _mismatch(self, manifest: Manifest) -> str | None:
        if manifest.num_shards != self.world_size:
            return f"shard count: the snapshot has {manifest.num_shards}, the server {self.world_size} (--num-shard)"
        mismatch = snap.find_mismatch(await self.fingerprint(), manifest.fingerprint)
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
            reply = await self.engine.client.delete_snapshot(name)
            _raise_for([reply])
        # Its prefix-cache entries go too, unless a running request still uses them.
        token_ids = reply.token_ids
        num_dropped = await self.engine.run_between_steps(lambda s: s.block_manager.drop_cached(token_ids))
        return {"name": name, "deleted": True, "cached_blocks_dropped": num_dropped}

    async def list_all(self) -> list[dict[str, Any]]:
        reply, entries = await self.engine.client.list_snapshots()
        _raise_for([reply])
        listed = []
        for entry in entries:
            if entry.manifest is None:
                assert entry.error is not None
                listed.append({"name": entry.name, "tokens": None, "bytes": None, "created": None, "fits": False,
                               "reason": entry.error.message})
                continue
            manifest, reason = entry.manifest, await self._mismatch(entry.manifest)
            listed.append({"name": entry.name, "tokens": manifest.num_tokens, "bytes": manifest.num_bytes,
                           "created": manifest.created, "fits": reason is None, "reason": reason})
        return listed


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


# ---- routes ---------------------------------------------------------------------------------


class SaveRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    inputs: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> SaveRequest:
        if sum(x is not None for x in (self.inputs, self.messages, self.token_ids)) != 1:
            raise ValueError("give exactly one of `inputs`, `messages`, `token_ids`")
        return self


def _service(request: Request) -> Snapshots:
    state = get_state(request)
    if not state.config.snapshot_dir:
        raise SnapshotHTTPError(501, DISABLED_MESSAGE, "disabled")
    if state.engine.model_info.num_kv_groups > 1:  # their sliding layers' early KV is not kept
        raise SnapshotHTTPError(501, "KV snapshots are not supported for models with sliding-window layers",
                                "disabled")
    service = getattr(request.app.state, "loom_snapshots", None)
    if service is None:
        service = request.app.state.loom_snapshots = Snapshots(state)
    return service


async def _prompt_ids(state: AppState, body: SaveRequest) -> list[int]:
    if body.token_ids is not None:
        vocab_size = state.engine.model_info.vocab_size
        if any(not 0 <= t < vocab_size for t in body.token_ids):
            raise SnapshotHTTPError(422, f"`token_ids` must lie in 0..{vocab_size - 1}", "validation")
        return list(body.token_ids)
    if body.messages is not None:
        messages = [m.as_template_message() for m in body.messages]
        prompt = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages, True)
        return await encode(state, prompt, add_special_tokens=False)  # the template wrote the specials
    return await encode(state, body.inputs or "")


def _error(error: SnapshotHTTPError | ShardError) -> JSONResponse:
    """The JSON error; a shard that failed the RPC itself (crashed, unreachable) is a 500."""
    if isinstance(error, ShardError):
        error = SnapshotHTTPError(500, f"the shards failed: {error}", "failed")
    note_snapshot_failure(error.error_type)
    return JSONResponse({"error": error.message, "error_type": error.error_type}, status_code=error.status)


class AnyNameConvertor(PathConvertor):
    """Like `path`, but across newlines too: a name with one must reach the validator (400)."""

    regex = r"[\s\S]*"


def build_router() -> APIRouter:
    """The snapshot routes (mounted by loom_router.api.create_app)."""
    register_url_convertor("any_name", AnyNameConvertor())  # idempotent
    router = APIRouter(tags=["Snapshots"])
    name_path = ROUTE_PREFIX + "/{name:any_name}"
    router.add_api_route(name_path, snapshot_action, methods=["POST"],
                         summary="Save (action=save) or restore (action=restore) a KV snapshot")
    router.add_api_route(name_path, delete_snapshot, methods=["DELETE"], summary="Delete a KV snapshot")
    router.add_api_route(ROUTE_PREFIX, list_snapshots, methods=["GET"],
                         summary="List KV snapshots and whether each fits the loaded model")
    return router


async def snapshot_action(name: str, action: Literal["save", "restore"], request: Request,
                          body: SaveRequest | None = None) -> Any:
    try:
        service = _service(request)
        valid_name = validate_name(name_from_request(request))
        with _span(service, action, valid_name):  # the shards' snapshot spans are its children
            if action == "restore":
                return await service.restore(valid_name)
            if body is None:
                raise SnapshotHTTPError(422, "save needs a body with `inputs`, `messages` or `token_ids`", "validation")
            return await service.save(valid_name, await _prompt_ids(get_state(request), body))
    except (SnapshotHTTPError, ShardError) as error:
        return _error(error)


def _span(service: Snapshots, action: str, name: str) -> AbstractContextManager[object]:
    tracer = service.engine.tracer
    return nullcontext() if tracer is None else tracer.span(f"snapshot.{action}", {"loom.snapshot.name": name})


async def delete_snapshot(name: str, request: Request) -> Any:
    try:
        return await _service(request).delete(validate_name(name_from_request(request)))
    except (SnapshotHTTPError, ShardError) as error:
        return _error(error)


async def list_snapshots(request: Request) -> Any:
    try:
        return {"snapshots": await _service(request).list_all()}
    except (SnapshotHTTPError, ShardError) as error:
        return _error(error)
