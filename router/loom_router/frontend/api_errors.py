"""Error bodies in the shape of the API a path belongs to: Anthropic's on /v1/messages, OpenAI's
on the other /v1 routes; TGI's routes (None here) are written by their callers."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from loom_router.frontend import openai_api

# Anthropic's error types by status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   415: "invalid_request_error", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def v1_status(status: int) -> int:
    """OpenAI's and Anthropic's APIs (and vLLM's) answer an invalid request with 400, where
    TGI's answer 422: their clients raise their BadRequestError for it."""
    return 400 if status == 422 else status


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def api_error_response(path: str, status: int, message: str, param: str | None = None,
                       code: str | None = None) -> JSONResponse | None:
    """The error in its API's shape, or None on TGI's routes."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error(status, message), status_code=v1_status(status))
    if openai_api.is_openai_path(path):
        return openai_api.error_response(v1_status(status), message, param, code)
    return None
