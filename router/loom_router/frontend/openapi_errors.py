"""Every error Loom can answer, written into its OpenAPI document (with the body shape: TGI's
`{"error", "error_type"}`, OpenAI's `{"error": {...}}` on /v1), and FastAPI's own errors
(a body it cannot parse, an unknown path) answered in those shapes too. The property-based
test (tests/contract/test_fuzz.py) holds the server to this document."""

from __future__ import annotations

import functools
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loom_router.frontend import api_errors, openai_api
from loom_router.frontend.api_errors import api_error_response

TGI_ERROR = {"type": "object", "required": ["error", "error_type"],
             "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}

ANY_ROUTE = {401: "no valid API key (with --api-key)", 503: "draining, or a shard is down"}
WITH_BODY = {400: "the body cannot be parsed", 413: "the body is larger than --payload-limit",
             415: "the body is not sent as application/json", 422: "invalid parameters"}
GENERATION = {424: "the generation failed on the shards", 429: "too many requests in flight"}
GENERATION_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                              "/v1/messages", "/v1/responses"})
# Routes answering server-sent events: always (/generate_stream), or with `stream: true`.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
SSE = {"content": {"text/event-stream": {"schema": SSE_EVENT}}}  # before OpenAPI 3.2: one event's schema
STREAMING_PATHS = {"/generate_stream": False, "/": True, "/v1/completions": True, "/v1/chat/completions": True,
                   "/v1/messages": True, "/v1/responses": True}
# GET / is the playground's page (POST / is TGI's generate).
UNKNOWN_MODEL = {404: "an unknown `model` (model_not_found)"}
UNKNOWN_ADAPTER = {404: "no LoRA adapter of the name `parameters.adapter_id` gives"}
EXTRA = {("get", "/"): {406: "the client's Accept takes no text/html"},
         ("post", "/"): UNKNOWN_ADAPTER,
         ("post", "/generate"): UNKNOWN_ADAPTER,
         ("post", "/generate_stream"): UNKNOWN_ADAPTER,
         ("post", "/v1/embeddings"): UNKNOWN_MODEL,
         ("get", "/v1/models/{model_id}"): UNKNOWN_MODEL,
         ("post", "/v1/completions"): UNKNOWN_MODEL | {400: "the prompt is longer than the context "
                                                            "(context_length_exceeded), or `suffix`"},
         ("post", "/v1/chat/completions"): UNKNOWN_MODEL | {400: "the messages are longer than the context "
                                                                 "(context_length_exceeded)"},
         ("post", "/v1/messages"): UNKNOWN_MODEL | {400: "the messages are longer than the context"},
         ("post", "/v1/messages/count_tokens"): UNKNOWN_MODEL,
         ("post", "/v1/responses"): UNKNOWN_MODEL | {400: "the input is longer than the context "
                                                          "(context_length_exceeded)",
                                                     404: "an unknown `model` or `previous_response_id`"},
         ("get", "/v1/responses/{response_id}"): {404: "no such stored response"},
         ("delete", "/v1/responses/{response_id}"): {404: "no such stored response"}}
SNAPSHOTS = {400: "invalid snapshot name", 404: "no such snapshot", 409: "the snapshot does not fit this model",
             501: "snapshots are off (no --snapshot-dir)"}


def install(app: FastAPI) -> None:
    app.openapi = lambda: _document(app)  # type: ignore[method-assign]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's `{"detail"}` errors (unparsable body, unknown path, wrong method) in Loom's shapes."""
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    response = api_error_response(request.url.path, exc.status_code, message)
    if response is None:
        error_type = {405: "method_not_allowed", 406: "not_acceptable"}.get(exc.status_code, "http")
        response = JSONResponse({"error": message, "error_type": error_type}, status_code=exc.status_code)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # Starlette names one route's methods; a path may have several routes
        allowed = documented_methods(request.app, request.url.path)
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
    return response


def documented_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the OpenAPI document lists for a request path (its templates' parameters
    match any text, as the snapshot name's does)."""
    for template, operations in app.openapi()["paths"].items():
        if _template_regex(template).fullmatch(path):
            return sorted(method.upper() for method in operations)
    return []


@functools.lru_cache(maxsize=64)
def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(template)))


def _document(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = FastAPI.openapi(app)
    for path, operations in schema["paths"].items():
        body = OPENAI_ERROR if openai_api.is_openai_path(path) else TGI_ERROR
        if api_errors.is_anthropic_path(path):
            body = ANTHROPIC_ERROR
        for method, operation in operations.items():
            errors = dict(ANY_ROUTE)
            if method in ("post", "put", "patch"):
                errors |= WITH_BODY
            if path in GENERATION_PATHS and method == "post":
                errors |= GENERATION
            errors |= {status: f"{errors[status]}; {description}" if status in errors else description
                       for status, description in EXTRA.get((method, path), {}).items()}
            if openai_api.is_openai_path(path) and 422 in errors:  # OpenAI and Anthropic answer 400 for it
                errors[400] = f"{errors.pop(422)}; {errors.get(400, '')}".rstrip("; ")
            if path.startswith("/snapshots"):
                errors |= SNAPSHOTS | {503: "not enough free KV blocks, or draining"}
            responses = operation.setdefault("responses", {})
            if path in STREAMING_PATHS and method == "post":
                ok = responses["200"]
                ok["content"] = {**(ok["content"] if STREAMING_PATHS[path] else {}), **SSE["content"]}
            for status, description in errors.items():
                responses[str(status)] = {"description": description,
                                          "content": {"application/json": {"schema": body}}}
    app.openapi_schema = schema
    return schema
