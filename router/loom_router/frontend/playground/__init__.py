"""The built-in chat playground: a static page (HTML, CSS, JavaScript shipped as package
data, no build step) served at `GET /` to browsers; it talks to /v1/chat/completions."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

# The page's own files, by the name the page asks for; anything else is a 404.
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


PAGE_PATH = "/"
ASSET_PREFIX = "/playground/"


def is_public(method: str, path: str) -> bool:
    """Requests an API-key check must let through: the page and its files hold no secret, and
    a browser cannot send a key before it has the page. Only GETs: `POST /` is TGI's generate."""
    if method not in ("GET", "HEAD"):
        return False
    return path == PAGE_PATH or (path.startswith(ASSET_PREFIX) and path[len(ASSET_PREFIX):] in ASSETS)


def _read(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def takes_html(request: Request) -> bool:
    """Whether the client's Accept admits text/html (no Accept, */*, text/*, text/html), with a
    non-zero quality."""
    accept = request.headers.get("accept", "").strip()
    if not accept:
        return True
    for item in accept.split(","):
        media_type, *params = [part.strip() for part in item.split(";")]
        if media_type.lower() in ("text/html", "text/*", "*/*") and not any(
                p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for p in params):
            return True
    return False


def build_router() -> APIRouter:
    router = APIRouter(tags=["Playground"])

    @router.get(PAGE_PATH, summary="The chat playground, an HTML page (POST / is TGI's generate)",
                response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        if not takes_html(request):  # raised: the error reads as every other (loom_router.frontend.openapi_errors)
            raise HTTPException(status_code=406, detail="GET / answers an HTML page (the playground); "
                                "this client's Accept takes no text/html")
        return HTMLResponse(_read("index.html"), headers={"Cache-Control": "no-cache"})

    @router.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            raise HTTPException(status_code=404, detail="Not Found")
        return Response(_read(name), media_type=media_type, headers={"Cache-Control": "no-cache"})

    return router
