"""The playground's routes: GET / serves the page to any client that takes HTML (406 to one that
does not), its files come from the installed package, and POST / stays TGI's."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from importlib.resources import files

import httpx
import pytest
from api_fakes import WORDS, FakeShardClient
from router_harness import start_router

from loom_proto.config import RouterConfig
from loom_router.frontend.playground import is_public
from loom_router.tokenizer import load_tokenizer

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    tokenizer = load_tokenizer("")
    backend = FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
    config = RouterConfig(model_id="", shard_uds_paths=("fake.sock",), max_total_tokens=64)
    router = await start_router(config, backend, tokenizer)
    try:
        yield router.http
    finally:
        await router.stop()


async def test_a_browser_gets_the_page_and_its_files(client: httpx.AsyncClient) -> None:
    page = await client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.text == files("loom_router.frontend.playground").joinpath("index.html").read_text(encoding="utf-8")
    linked = re.findall(r'(?:src|href)="(/playground/[^"]+)"', page.text)
    assert sorted(linked) == ["/playground/app.js", "/playground/style.css"]
    for path, media_type in (("/playground/app.js", "text/javascript"), ("/playground/style.css", "text/css")):
        asset = await client.get(path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media_type)
        assert len(asset.text) > 1000
    assert "cdn" not in page.text.lower() and "http" not in page.text.replace("http-equiv", "")


@pytest.mark.parametrize("name", ["index.html", "__init__.py", "..%2Fapi.py", "nothing.js"])
async def test_only_the_pages_assets_are_served(client: httpx.AsyncClient, name: str) -> None:
    assert (await client.get(f"/playground/{name}")).status_code == 404


@pytest.mark.parametrize("accept", [None, "*/*", "text/*", "text/html"])
async def test_any_client_that_takes_html_gets_the_page(client: httpx.AsyncClient, accept: str | None) -> None:
    """What the OpenAPI document says GET / answers: the page, whoever asks (curl sends */*)."""
    headers = {"Accept": accept} if accept else {}
    answer = await client.get("/", headers=headers)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("accept", ["application/json", "text/plain, application/json;q=0.5"])
async def test_a_client_that_takes_no_html_gets_406(client: httpx.AsyncClient, accept: str) -> None:
    answer = await client.get("/", headers={"Accept": accept})
    assert answer.status_code == 406 and answer.json()["error_type"] == "not_acceptable"


async def test_post_slash_still_generates(client: httpx.AsyncClient) -> None:
    response = await client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}},
                                 headers={"Accept": BROWSER_ACCEPT})
    assert response.status_code == 200
    assert isinstance(response.json()[0]["generated_text"], str)


def test_model_output_is_never_written_as_html() -> None:
    """The page sets text only: no API that parses a string as HTML appears in its script."""
    script = files("loom_router.frontend.playground").joinpath("app.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "eval("):
        assert sink not in script, sink
    assert "textContent" in script


def test_only_the_page_and_its_files_are_public() -> None:
    """What an API-key guard may serve without a key: GETs of the page and its two files."""
    assert is_public("GET", "/") and is_public("GET", "/playground/app.js") and is_public("HEAD", "/playground/style.css")
    assert not is_public("POST", "/")  # TGI's generate
    for path in ("/playground/index.html", "/playground/", "/info", "/v1/chat/completions", "/generate", "/metrics"):
        assert not is_public("GET", path), path
