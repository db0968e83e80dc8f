"""KV snapshot routes, a frontend's side: names are validated strictly, a body becomes token ids
(tokenized and templated here), and the operation runs in the engine core
(loom_router.core.snapshots: every block manager change between steps, the shards doing the
copies and all the file I/O). Save a sequence's KV to `--snapshot-dir`, restore it into the
prefix cache, list and delete snapshots:

    POST   /snapshots/{name}?action=save     {"inputs"} | {"messages"} | {"token_ids"}, and "model": an adapter
    POST   /snapshots/{name}?action=restore
    DELETE /snapshots/{name}
    GET    /snapshots
"""

from __future__ import annotations

import asyncio
import re
import unicodedata
from typing import Annotated, Any, Literal
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.convertors import PathConvertor, register_url_convertor

from loom_router.frontend.http_common import AppState, encode, get_state
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.openai_api import check_model
from loom_router.frontend.validation import ChatMessage, Text, TokenIds
from loom_router.observability.metrics import note_snapshot_failure
from loom_router.types import APIError, SnapshotHTTPError

MAX_NAME_BYTES = 255
FORBIDDEN_CHARS = frozenset('/\\:*?"<>|')
INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # control, format (BOM, ZWJ...), separators
ROUTE_PREFIX = "/snapshots"
DISABLED_MESSAGE = "snapshots are off: start the server with --snapshot-dir DIR to enable them"
# A path from the root ("/tmp/x/snaps", not "a/b" or a URL's "//host/x"); group 1 is its last part.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s'\"/]+/)*([^\s'\"/]+)")  # a lone / is no path


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


# ---- routes ---------------------------------------------------------------------------------


class _SaveBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None  # a LoRA adapter's name: its KV is saved (and restored for it); else the base model's


class SaveInputs(_SaveBody):
    inputs: Text


class SaveMessages(_SaveBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # false: the messages as every later conversation that starts with them renders them (the next
    # turn's header follows, not the assistant's); true: with the assistant's header, for a
    # request of these very messages
    add_generation_prompt: bool = False


class SaveTokenIds(_SaveBody):
    token_ids: TokenIds


# Exactly one of the three, each its own shape: the OpenAPI document says so too.
SaveRequest = SaveInputs | SaveMessages | SaveTokenIds


def _enabled(request: Request) -> AppState:
    state = get_state(request)
    if not state.config.snapshot_dir:
        raise SnapshotHTTPError(501, DISABLED_MESSAGE, "disabled")
    if state.engine.model_info.num_kv_groups > 1:  # their sliding layers' early KV is not kept
        raise SnapshotHTTPError(501, "KV snapshots are not supported for models with sliding-window layers",
                                "disabled")
    return state


async def _prompt_ids(state: AppState, body: SaveRequest) -> list[int]:
    if isinstance(body, SaveTokenIds):
        vocab_size = state.engine.model_info.vocab_size
        if any(not 0 <= t < vocab_size for t in body.token_ids):
            raise SnapshotHTTPError(422, f"`token_ids` must lie in 0..{vocab_size - 1}", "validation")
        return list(body.token_ids)
    if isinstance(body, SaveMessages):
        messages = [m.as_template_message() for m in body.messages]
        prompt = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages, body.add_generation_prompt)
        return await encode(state, prompt, add_special_tokens=False)  # the template wrote the specials
    return await encode(state, body.inputs)


def error_response(error: SnapshotHTTPError) -> JSONResponse:
    """The JSON error, counted by its reason."""
    note_snapshot_failure(error.error_type)
    return JSONResponse({"error": redact_paths(error.message), "error_type": error.error_type},
                        status_code=error.status)


def redact_paths(message: str) -> str:
    """Absolute paths (an OSError's, from the shards) cut to their last part: a client learns
    which file, not where the server keeps it."""
    return ABSOLUTE_PATH.sub(lambda match: match.group(1), message)


class AnyNameConvertor(PathConvertor):
    """Like `path`, but across newlines too: a name with one must reach the validator (400)."""

    regex = r"[\s\S]*"


def build_router() -> APIRouter:
    """The snapshot routes (mounted by loom_router.frontend.api.create_app)."""
    register_url_convertor("any_name", AnyNameConvertor())  # idempotent
    router = APIRouter(tags=["Snapshots"], route_class=UnicodeJSONRoute)
    name_path = ROUTE_PREFIX + "/{name:any_name}"
    router.add_api_route(name_path, snapshot_action, methods=["POST"],
                         summary="Save (action=save) or restore (action=restore) a KV snapshot")
    router.add_api_route(name_path, delete_snapshot, methods=["DELETE"], summary="Delete a KV snapshot")
    router.add_api_route(ROUTE_PREFIX, list_snapshots, methods=["GET"],
                         summary="List KV snapshots and whether each fits the loaded model")
    return router


async def snapshot_action(name: str, action: Literal["save", "restore"], request: Request,
                          body: SaveRequest = Body(None)) -> Any:  # restore takes none
    """SnapshotHTTPError (loom_router.frontend.api renders it) or the engine core's answer."""
    state = _enabled(request)
    valid_name = validate_name(name_from_request(request))
    if action == "restore":
        return await state.engine.call("snapshot_restore", valid_name)
    if body is None:
        raise SnapshotHTTPError(422, "save needs a body with `inputs`, `messages` or `token_ids`", "validation")
    token_ids = await _prompt_ids(state, body)
    state.engine.validate_lengths(len(token_ids), 1, 1)  # ValidationError: 422
    return await state.engine.call("snapshot_save", valid_name, token_ids, adapter=_adapter(state, body.model))


def _adapter(state: AppState, model: str | None) -> str | None:
    """The LoRA adapter `model` names (the engine core answers 404 for an unknown one), None for
    the base model; with LoRA off, a name other than the served model's is a 404."""
    try:
        return check_model(state, model)
    except APIError as error:
        raise SnapshotHTTPError(404, str(error), "not_found") from None


async def delete_snapshot(name: str, request: Request) -> Any:
    state = _enabled(request)
    return await state.engine.call("snapshot_delete", validate_name(name_from_request(request)))


async def list_snapshots(request: Request) -> Any:
    return await _enabled(request).engine.call("snapshot_list")
