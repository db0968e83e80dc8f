"""The router's front door (loom_router.frontend.guard) and life cycle (loom_router.frontend.lifecycle)
through a frontend and an engine core driving a fake shard: API keys, payload limit, CORS,
readiness, drain, dead shards, and slow stream readers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fakes import FakeShardClient
from router_harness import InProcessRouter, start_router
from starlette.responses import JSONResponse

from loom_proto.config import RouterConfig
from loom_proto.step import SamplingParams
from loom_router import api_keys
from loom_router.core.engine import Engine
from loom_router.core.shard_client import ShardError
from loom_router.frontend import guard
from loom_router.tokenizer import Tokenizer
from loom_router.types import GenerationError, GenerationParams, UnavailableError

KEYS = ("sk-first-key-0123", "sk-second-key-4567")
GENERATE = {"inputs": "the quick", "parameters": {"max_new_tokens": 4}}
COMPLETION = {"prompt": "the quick", "max_tokens": 4}


def router_config(**overrides: Any) -> RouterConfig:
    fields: dict[str, Any] = dict(model_id="", shard_uds_paths=("fake.sock",), max_concurrent_requests=8,
                                  max_total_tokens=64, max_n=4)
    return RouterConfig(**{**fields, **overrides})


Serve = Callable[..., Any]


@pytest.fixture
async def serve(backend: FakeShardClient, tokenizer: Tokenizer) -> AsyncIterator[Serve]:
    """serve(**config) -> (HTTP client, the engine core's engine), started unless start=False;
    `serve.routers` holds each in-process router."""
    routers: list[InProcessRouter] = []

    async def start(start: bool = True, **overrides: Any) -> tuple[httpx.AsyncClient, Engine]:
        router = await start_router(router_config(**overrides), backend, tokenizer, start=start)
        routers.append(router)
        return router.http, router.engine

    start.routers = routers  # type: ignore[attr-defined]
    yield start
    for router in routers:
        await router.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- API keys -----------------------------------------------------------------------------


async def test_every_route_but_health_and_readiness_needs_a_key(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS)
    for method, path, body in [("POST", "/generate", GENERATE), ("POST", "/v1/completions", COMPLETION),
                               ("GET", "/info", None), ("GET", "/v1/models", None), ("GET", "/docs", None),
                               ("GET", "/openapi.json", None), ("POST", "/tokenize", {"inputs": "hi"})]:
        response = await client.request(method, path, json=body)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        if path.startswith("/v1/"):
            assert response.json()["error"]["type"] == "invalid_request_error"
        else:
            assert response.json()["error_type"] == "unauthorized"
    for path in ("/health", "/ready", "/v2/health/ready", "/metrics"):
        assert (await client.get(path)).status_code == 200, path


async def test_the_playground_page_loads_without_a_key_but_generation_does_not(serve: Serve) -> None:
    """A browser cannot send a key before it has the page; the page sends it with each API call."""
    client, _ = await serve(api_key=KEYS)
    html = {"Accept": "text/html"}
    assert (await client.get("/", headers=html)).status_code == 200
    for asset in ("/playground/app.js", "/playground/style.css"):
        assert (await client.get(asset)).status_code == 200, asset
    assert (await client.get("/playground/secret.txt")).status_code == 401  # only the page's own files
    assert (await client.post("/", json=GENERATE)).status_code == 401  # POST / is TGI's generate
    assert (await client.post("/", json=GENERATE, headers=bearer(KEYS[0]))).status_code == 200


async def test_each_key_opens_the_routes_and_a_wrong_one_does_not(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS)
    for key in KEYS:
        for headers in (bearer(key), {"x-api-key": key}):  # Anthropic's header too
            response = await client.post("/generate", json=GENERATE, headers=headers)
            assert response.status_code == 200, response.text
    for headers in (bearer("sk-first-key-012"), bearer(KEYS[0] + "x"), {"Authorization": KEYS[0]},
                    {"Authorization": f"Basic {KEYS[0]}"}, bearer(""), {"x-api-key": ""}, {"x-api-key": "nope"},
                    {"Authorization": "Basic x", "x-api-key": KEYS[0]}):
        assert (await client.post("/generate", json=GENERATE, headers=headers)).status_code == 401


async def test_keys_from_a_file_and_the_flag_together(serve: Serve, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# ops keys\n\n  sk-from-file  \n")
    client, _ = await serve(api_key=KEYS[:1], api_key_file=str(key_file))
    for key in (KEYS[0], "sk-from-file"):
        assert (await client.get("/info", headers=bearer(key))).status_code == 200
    assert (await client.get("/info", headers=bearer("# ops keys"))).status_code == 401


async def test_a_key_file_without_a_key_is_refused_at_start(serve: Serve, tmp_path: Path) -> None:
    """A key file of comments and blank lines would leave every route open."""
    key_file = tmp_path / "keys"
    key_file.write_text("# keys go here\n\n   \n")
    with pytest.raises(ValueError, match="no API key"):
        await serve(api_key_file=str(key_file))


@pytest.mark.parametrize("authorization", ["Bearer", "Bearer ", "Bearer    ", "bearer \t"])
async def test_an_empty_token_never_matches_even_a_blank_key(authorization: str) -> None:
    """The guard itself refuses an empty token, whatever keys it was given."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await JSONResponse({"ok": True})(scope, receive, send)

    policy = guard.GuardPolicy((b"",), frozenset(), 1000, lambda: True)
    transport = httpx.ASGITransport(app=guard.Guard(app, policy))
    async with httpx.AsyncClient(transport=transport, base_url="http://loom") as client:
        response = await client.get("/info", headers={"Authorization": authorization})
    assert response.status_code == 401


async def test_metrics_can_require_the_key(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS, metrics_require_api_key=True)
    assert (await client.get("/metrics")).status_code == 401
    assert (await client.get("/metrics", headers=bearer(KEYS[1]))).status_code == 200


async def test_every_key_is_compared_in_constant_time(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = api_keys.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    client, _ = await serve(api_key=KEYS)
    assert (await client.get("/info", headers=bearer(KEYS[0]))).status_code == 200
    # no early exit on the first match: the time does not tell which key matched
    assert compared == [(KEYS[0].encode(), key.encode()) for key in KEYS]


async def test_a_repeated_authorization_header_is_judged_by_its_first(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS)
    first_good = [("authorization", f"Bearer {KEYS[0]}"), ("authorization", "Bearer wrong")]
    first_bad = [("authorization", "Bearer wrong"), ("authorization", f"Bearer {KEYS[0]}")]
    assert (await client.get("/info", headers=first_good)).status_code == 200
    assert (await client.get("/info", headers=first_bad)).status_code == 401


async def test_a_request_refused_for_its_key_is_no_snapshot_failure(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS)
    assert (await client.get("/snapshots")).status_code == 401
    metrics = (await client.get("/metrics", headers=bearer(KEYS[0]))).text
    assert "loom_snapshot_failures_total{" not in metrics and "loom_snapshot_operations_total{" not in metrics
    assert 'loom_http_requests_total{route="unmatched",status="401"} 1.0' in metrics


async def test_keys_never_reach_the_logs(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client, _ = await serve(api_key=KEYS)
    await client.post("/generate", json=GENERATE, headers=bearer(KEYS[0]))
    await client.post("/generate", json=GENERATE, headers=bearer("sk-wrong-guess-999"))
    assert caplog.records  # something was logged, and no key in it
    assert not any(secret in caplog.text for secret in (*KEYS, "sk-wrong-guess-999"))
    assert KEYS[0] not in repr(router_config(api_key=KEYS)) and KEYS[0] not in router_config(
        api_key=KEYS).model_dump_json()


# ---- payload limit, CORS, snapshot routes -------------------------------------------------


async def test_a_body_past_the_payload_limit_gets_413_in_each_api_shape(serve: Serve) -> None:
    client, _ = await serve(payload_limit=1000)
    big = {"inputs": "the " * 300, "parameters": {"max_new_tokens": 2}}
    response = await client.post("/generate", json=big)
    assert response.status_code == 413 and response.json()["error_type"] == "payload_too_large"
    response = await client.post("/v1/completions", json={"prompt": "the " * 300})
    assert response.status_code == 413 and "--payload-limit" in response.json()["error"]["message"]
    assert (await client.post("/generate", json=GENERATE)).status_code == 200


async def _run_guard(headers: list[tuple[bytes, bytes]], chunks: list[bytes], limit: int) -> tuple[int, int]:
    """Drives the bare middleware: (status sent, body chunks it read)."""
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    policy = guard.GuardPolicy((), frozenset(), limit, lambda: True)
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": headers}
    await guard.Guard(app, policy)(scope, receive, send)
    return sent[0]["status"], read


async def test_the_limit_stops_reading_before_the_whole_body() -> None:
    # Content-Length announces too much: nothing is read at all
    assert await _run_guard([(b"content-length", b"1000000000")], [b"x" * 1000] * 1000, 4000) == (413, 0)
    # chunked, no length: reading stops at the chunk that passes the limit
    assert await _run_guard([], [b"x" * 1000] * 1000, 4000) == (413, 5)


async def test_cors_answers_preflight_for_allowed_origins_even_with_keys(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS, cors_allow_origin=("https://app.example",))
    # the headers the official JS SDKs send (openai's and anthropic's)
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-retry-count,"
                                                   "anthropic-version,x-api-key"}
    response = await client.options("/generate", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    response = await client.post("/generate", json=GENERATE,
                                 headers={"Origin": "https://app.example", **bearer(KEYS[0])})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    response = await client.options("/generate", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


async def test_no_cors_headers_unless_asked(serve: Serve) -> None:
    client, _ = await serve()
    response = await client.post("/generate", json=GENERATE, headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in response.headers


async def test_snapshot_routes_can_be_turned_off(serve: Serve, tmp_path: Path) -> None:
    client, _ = await serve(snapshot_dir=str(tmp_path), snapshot_routes=False)
    assert (await client.get("/snapshots")).status_code == 404
    assert not any(path.startswith("/snapshots") for path in (await client.get("/openapi.json")).json()["paths"])
    client, _ = await serve(snapshot_dir=str(tmp_path))
    assert any(path.startswith("/snapshots") for path in (await client.get("/openapi.json")).json()["paths"])


# ---- readiness, drain, dead shards --------------------------------------------------------


async def test_ready_fails_before_warmup_and_from_the_first_instant_of_a_drain(serve: Serve) -> None:
    client, _ = await serve(start=False)
    router = serve.routers[-1]
    for path in ("/ready", "/v2/health/ready"):
        assert (await client.get(path)).status_code == 503
    await router.start()
    assert (await client.get("/ready")).status_code == 200
    await router.begin_drain()  # the engine core's drain, as its frontend sees it
    assert (await client.get("/ready")).status_code == 503
    assert (await client.get("/v2/health/ready")).json()["error_type"] == "unavailable"
    response = await client.post("/generate", json=GENERATE)
    assert response.status_code == 503 and response.json()["error_type"] == "unavailable"
    assert (await client.post("/v1/completions", json=COMPLETION)).json()["error"]["type"] == "server_error"
    assert (await client.get("/health")).status_code == 200  # alive, just not taking work


async def test_a_request_that_reaches_a_draining_core_first_is_refused_as_unavailable(serve: Serve) -> None:
    """The frontend learns of a drain a moment after the core: a request sent in between is
    refused by the core itself, with the same 503 (a shutting-down server is not overloaded)."""
    _, engine = await serve()
    client = serve.routers[-1].client
    engine.begin_drain()
    assert not client.draining  # the frontend has not heard yet
    with pytest.raises(UnavailableError, match="shutting down"):
        await client.submit([1, 2, 3], GenerationParams(max_new_tokens=4, choices=[SamplingParams(seed=1)]))


async def test_drain_lets_in_flight_streams_finish(serve: Serve, backend: FakeShardClient) -> None:
    client, engine = await serve()
    backend.step_delay_s = 0.01
    body = {"inputs": "the quick", "parameters": {"max_new_tokens": 20}}
    stream = asyncio.create_task(client.post("/generate_stream", json=body))
    while not engine.stats().num_running:
        await asyncio.sleep(0.005)
    await engine.drain(timeout_s=30)
    events = [json.loads(line[5:]) for line in (await stream).text.splitlines() if line.startswith("data:")]
    assert len(events) == 20 and events[-1]["generated_text"] is not None
    assert engine.stats().num_blocks_used == 0


async def test_past_the_drain_timeout_streams_end_with_an_error_event(serve: Serve, backend: FakeShardClient) -> None:
    client, engine = await serve()
    backend.step_delay_s = 0.05
    body = {"inputs": "the quick", "parameters": {"max_new_tokens": 50}}
    streams = [asyncio.create_task(client.post("/generate_stream", json=body)),
               asyncio.create_task(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 50,
                                                                         "stream": True}))]
    while engine.stats().num_running < 2:
        await asyncio.sleep(0.005)
    await engine.drain(timeout_s=0.2)
    tgi, openai = [(await s).text for s in streams]
    assert "--graceful-termination-timeout" in json.loads(tgi.strip().splitlines()[-1][5:])["error"]
    assert "--graceful-termination-timeout" in openai
    assert engine.stats().num_blocks_used == 0 and engine.stats().requests_finished["error"] == 2


async def test_a_dead_shard_ends_streams_and_turns_new_requests_away(serve: Serve,
                                                                     backend: FakeShardClient) -> None:
    client, engine = await serve()
    backend.step_delay_s = 0.01
    stream = asyncio.create_task(client.post("/generate_stream", json={
        "inputs": "the quick", "parameters": {"max_new_tokens": 40}}))
    while not engine.stats().num_running:
        await asyncio.sleep(0.005)

    async def dead(plan: Any) -> Any:
        raise ShardError(0, "UNAVAILABLE", "failed to connect to all addresses")

    backend.step = dead  # type: ignore[method-assign]
    last = json.loads((await stream).text.strip().splitlines()[-1][5:])
    assert last["error_type"] == "generation" and "UNAVAILABLE" in last["error"]
    assert (await client.post("/generate", json=GENERATE)).status_code == 503
    assert (await client.get("/ready")).status_code == 503


async def test_a_dead_shard_is_not_stepped_into_again_and_again(serve: Serve, backend: FakeShardClient,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """After the shards stop answering the engine backs off (it once logged 295 failed steps in
    0.3 s), says 503, and goes back to work once they answer again."""
    client, engine = await serve()
    calls = 0

    async def dead(plan: Any) -> Any:
        nonlocal calls
        calls += 1
        backend.shard.known_ids.update(r.request_id for r in plan.new_requests)  # released later: it may have run
        raise ShardError(0, "UNAVAILABLE", "failed to connect to all addresses")

    step, backend.step = backend.step, dead  # type: ignore[method-assign]
    backend.healthy = False
    assert (await client.post("/generate", json=GENERATE)).status_code == 424  # its step found the shard dead
    await asyncio.sleep(1.5)
    assert calls <= 2, calls
    assert caplog.text.count("step failed") <= 2
    for path in ("/health", "/ready"):
        assert (await client.get(path)).status_code == 503, path
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 503
    backend.step, backend.healthy = step, True  # type: ignore[method-assign]
    deadline = asyncio.get_running_loop().time() + 10
    while not engine.accepting:
        assert asyncio.get_running_loop().time() < deadline, "the engine did not come back"
        await asyncio.sleep(0.05)
    response = await client.post("/generate", json=GENERATE)
    assert response.status_code == 200, response.text
    assert engine.scheduler.block_manager.num_used_blocks == 0


async def test_a_frozen_shard_turns_new_requests_away_at_once(serve: Serve, backend: FakeShardClient) -> None:
    """A shard that stops answering mid-step (SIGSTOP) holds its step; new requests must not join it."""
    client, engine = await serve()
    thawed = asyncio.Event()
    step = backend.step

    async def frozen(plan: Any) -> Any:
        await thawed.wait()
        return await step(plan)

    backend.step = frozen  # type: ignore[method-assign]
    backend.healthy = False  # its Health times out too
    held = asyncio.create_task(client.post("/generate", json=GENERATE))
    deadline = asyncio.get_running_loop().time() + 10
    while engine.accepting:  # noticed by the engine itself, without a request's help
        assert asyncio.get_running_loop().time() < deadline, "a frozen shard went unnoticed"
        await asyncio.sleep(0.05)
    start = asyncio.get_running_loop().time()
    refused = await client.post("/generate", json=GENERATE)
    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
    assert asyncio.get_running_loop().time() - start < 0.5
    assert (await client.get("/ready")).status_code == 503
    backend.healthy = True
    thawed.set()  # SIGCONT: the held request finishes and work goes on
    assert (await held).status_code == 200
    deadline = asyncio.get_running_loop().time() + 10
    while not engine.accepting:
        assert asyncio.get_running_loop().time() < deadline, "the engine did not come back"
        await asyncio.sleep(0.05)
    assert (await client.post("/generate", json=GENERATE)).status_code == 200


# ---- slow readers ---------------------------------------------------------------------------


async def test_a_stream_nobody_reads_is_cancelled_at_its_buffer_bound(serve: Serve, backend: FakeShardClient) -> None:
    _, engine = await serve(stream_buffer_events=8)
    backend.step_delay_s = 0.005  # the frontend learns of the overflow while the request still runs
    client = serve.routers[-1].client
    params = GenerationParams(max_new_tokens=40, choices=[SamplingParams(seed=1)], ignore_eos=True)
    stream = await client.submit([1, 2, 3], params)  # never read while it runs
    other = await client.submit([1, 2, 3], GenerationParams(max_new_tokens=40, choices=[SamplingParams(seed=2)],
                                                            ignore_eos=True))
    events = [event async for event in other]  # another stream is not held back
    assert len(events) == 40
    with pytest.raises(GenerationError, match="read too slowly"):
        async for _ in stream:
            pass
    assert stream.overflowed and engine.stats().num_blocks_used == 0
    assert engine.stats().requests_finished.get("cancelled") == 1


async def test_the_metrics_count_the_guards_refusals(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS, payload_limit=100)
    await client.post("/generate", json=GENERATE)
    await client.post("/generate", json={"inputs": "x" * 200}, headers=bearer(KEYS[0]))
    metrics = (await client.get("/metrics")).text
    assert 'loom_http_requests_total{route="unmatched",status="401"} 1.0' in metrics
    assert 'loom_http_requests_total{route="unmatched",status="413"} 1.0' in metrics


async def test_a_request_admitted_while_the_shard_is_checked_gets_503_not_424(
        serve: Serve, backend: FakeShardClient) -> None:
    """After a failed step the engine asks the shards for their health; a request that came in
    meanwhile cannot run on a dead shard either: it gets 503 (retry elsewhere), holding nothing."""
    client, engine = await serve()
    backend.fail_steps = True
    checking = asyncio.Event()

    async def slow_unhealthy() -> bool:
        checking.set()
        await asyncio.sleep(0.5)
        return False

    backend.health = slow_unhealthy  # type: ignore[method-assign]
    first = asyncio.create_task(client.post("/generate", json=GENERATE))
    await asyncio.wait_for(checking.wait(), 10)
    second = await client.post("/generate", json=GENERATE)
    assert (await first).status_code == 424
    assert second.status_code == 503, second.text
    assert second.json()["error_type"] == "unavailable"
    assert not engine.accepting and engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("healthy", [True, False])
async def test_after_a_failed_step_a_failing_health_check_turns_new_requests_away(
        serve: Serve, backend: FakeShardClient, healthy: bool) -> None:
    client, engine = await serve()
    backend.fail_steps = True  # not UNAVAILABLE: e.g. a collective broken by a peer's death
    backend.healthy = healthy
    response = await client.post("/generate", json=GENERATE)
    assert response.status_code == 424
    backend.fail_steps = False
    assert (await client.post("/generate", json=GENERATE)).status_code == (200 if healthy else 503)
    assert engine.accepting is healthy


async def test_the_guard_answers_each_api_in_its_own_error_shape(serve: Serve) -> None:
    client, _ = await serve(api_key=KEYS, payload_limit=1000)
    message = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    anthropic_401 = await client.post("/v1/messages", json=message)
    assert anthropic_401.status_code == 401
    assert anthropic_401.json()["type"] == "error" and anthropic_401.json()["error"]["type"] == "authentication_error"
    too_large = await client.post("/v1/messages", json={**message, "system": "x" * 2000}, headers=bearer(KEYS[0]))
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    openai_401 = await client.post("/v1/responses", json={"input": "Hi"})
    assert openai_401.status_code == 401 and "message" in openai_401.json()["error"]
