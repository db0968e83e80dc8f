"""The router's front door, one ASGI middleware ahead of every route: API keys, the request
size limit, refusing new work while the engine drains or a shard is down, and HEAD answered as
GET (uvicorn sends the headers without the body: uptime checks and load balancers probe so).
CORS sits outside it (a browser's preflight carries no key), and so do the metrics (they count
the guard's refusals too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom_proto.config import RouterConfig
from loom_router.api_keys import is_a_key, load_api_keys, presented_key
from loom_router.frontend.api_errors import api_error_response
from loom_router.frontend.playground import is_public

HEALTH_PATHS = frozenset({"/health", "/ready", "/v2/health/ready"})  # always open: orchestrators probe them
METRICS_PATH = "/metrics"
CORS_METHODS = ("GET", "POST", "DELETE")
CORS_HEADERS = ("*",)  # whatever a preflight lists: the SDKs' own (x-stainless-*, anthropic-version, x-api-key)


class PayloadTooLarge(Exception):
    pass


@dataclass(slots=True, frozen=True)
class GuardPolicy:
    api_keys: tuple[bytes, ...]  # empty: no access control
    open_paths: frozenset[str]  # answered without a key, and even while draining
    payload_limit: int  # bytes
    is_accepting: Callable[[], bool]  # False: new work gets 503 (draining, a shard down)


def install(app: FastAPI, config: RouterConfig, engine: Any) -> None:
    """Adds the guard (before the metrics middleware, which then counts its answers too)."""
    open_paths = HEALTH_PATHS if config.metrics_require_api_key else HEALTH_PATHS | {METRICS_PATH}
    policy = GuardPolicy(load_api_keys(config), open_paths, config.payload_limit,
                         is_accepting=lambda: getattr(engine, "accepting", True))
    app.add_middleware(Guard, policy=policy)


def install_cors(app: FastAPI, config: RouterConfig) -> None:
    """CORS, outside everything else (add it last)."""
    if config.cors_allow_origin:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allow_origin),
                           allow_methods=CORS_METHODS, allow_headers=CORS_HEADERS)


class Guard:
    def __init__(self, app: ASGIApp, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":
            await self._as_get(scope, receive, send)
            return
        path: str = scope["path"]
        if path not in self.policy.open_paths:
            # The playground's page and files hold no secret, and a browser cannot send a key
            # before it has the page: it sends the key with each API call instead.
            if self.policy.api_keys and not is_public(scope["method"], path) and not self._authorized(scope):
                await _reject(scope, receive, send, 401, "a valid API key is required: "
                              "send `Authorization: Bearer <key>`", "unauthorized",
                              {"WWW-Authenticate": "Bearer"})
                return
            if not self.policy.is_accepting():
                await _reject(scope, receive, send, 503, "the server is shutting down or a shard is down; "
                              "retry on another replica", "unavailable")
                return
        try:
            body = await _read_body(scope, receive, self.policy.payload_limit)
        except PayloadTooLarge:
            await _reject(scope, receive, send, 413, f"the request body is larger than "
                          f"--payload-limit ({self.policy.payload_limit} bytes)", "payload_too_large")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _as_get(self, scope: Scope, receive: Receive, send: Send) -> None:
        """HEAD as GET, on a copy of the scope (uvicorn's own says HEAD: it sends no body); the
        route it matched is copied back for the metrics outside."""
        inner = {**scope, "method": "GET"}
        try:
            await self(inner, receive, send)
        finally:
            scope.update({key: inner[key] for key in ("route", "endpoint", "path_params") if key in inner})

    def _authorized(self, scope: Scope) -> bool:
        return is_a_key(presented_key(scope["headers"]), self.policy.api_keys)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refused (PayloadTooLarge) as soon as Content-Length or the bytes
    received so far pass `limit`: a huge upload is never read in full."""
    length = _header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge()
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left mid-upload
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the client's next messages
    (its disconnect), which the routes watch to cancel abandoned work."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str, error_type: str,
                  headers: dict[str, str] | None = None) -> None:
    """TGI's error body, or OpenAI's or Anthropic's on their routes."""
    response = api_error_response(scope["path"], status, message)
    if response is None:
        response = JSONResponse({"error": message, "error_type": error_type}, status_code=status)
    response.headers.update(headers or {})
    await response(scope, receive, send)
