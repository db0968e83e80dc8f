"""JSON request bodies as Unicode text. JSON can spell half of a UTF-16 surrogate pair
(`"\\ud800"`), which Python reads into a string that no UTF-8 encoder, tokenizer or grammar
engine accepts; such a body is refused as malformed JSON (422), like any other, before a route
sees it. A body sent as another media type (`curl -d` sends a form's) is a 415, as TGI answers
it. The routes get this through their route class (`UnicodeJSONRoute`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

# A \u escape of a surrogate: only bodies holding one are searched string by string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def loads(body: bytes) -> Any:
    """json.loads, raising json.JSONDecodeError for a string holding a lone surrogate."""
    value = json.loads(body)
    escape = _SURROGATE_ESCAPE.search(body)
    if escape is not None and _has_lone_surrogate(value):
        raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate (such as \\ud800 without its "
                                   "pair), which is not Unicode text", body.decode("utf-8", "replace"),
                                   escape.start())
    return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(key) or _has_lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    return False


class UnicodeJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class UnicodeJSONRoute(APIRoute):
    """A route whose JSON body is read by `loads` (FastAPI answers its JSONDecodeError with 422)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            scope = request.scope
            if self.body_field is not None:
                content_type = request.headers.get("content-type")
                if not content_type:  # a body without a media type is read as JSON
                    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                    scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
                elif not _json_media_type(content_type):
                    raise HTTPException(415, "Expected request with `Content-Type: application/json`")
            return await handler(UnicodeJSONRequest(scope, request.receive))

        return route


def _json_media_type(content_type: str) -> bool:
    """application/json or a +json type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
