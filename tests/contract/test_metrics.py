"""/metrics after a little traffic: TGI's names, labels and buckets and Loom's own agree with
what was sent; the request log line; the JSON log format; --prometheus-port's server."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest
from prometheus_client.utils import floatToGoString
from test_api import Harness, harness  # noqa: F401 (fixture)

from loom_proto.step import StepPlan, StepResult
from loom_router.observability.core_metrics import CoreMetrics
from loom_router.observability.metrics import FrontendMetrics
from loom_router.observability.metrics_server import start_metrics_server
from loom_router.observability.request_log import REQUEST_LOGGER, JsonFormatter
from loom_router.observability.tgi_metrics import DURATION_BUCKETS

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


def samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of an exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def types(text: str) -> dict[str, str]:
    return dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE "))


async def send_traffic(h: Harness) -> None:
    """4 successes (12 tokens), 1 validation failure, 1 shard failure."""
    c = h.client
    for _ in range(2):
        assert (await c.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})).status_code == 200
    stream = await c.post("/generate_stream", json={"inputs": "y z", "parameters": {"max_new_tokens": 4}})
    assert stream.status_code == 200 and stream.text.count("data:") == 4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
    assert (await c.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 0}})).status_code == 422
    await c.get("/health")  # not a generation: TGI does not count it
    h.backend.fail_steps = True
    assert (await c.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})).status_code == 424
    h.backend.fail_steps = False


async def test_the_shards_wait_counts_only_while_the_router_had_work(harness: Harness) -> None:  # noqa: F811
    shard_step = harness.backend.step
    sent: list[StepPlan] = []

    async def waiting_step(plan: StepPlan) -> StepResult:  # every step: the shard waited 2 ms for it
        sent.append(plan)
        result = await shard_step(plan)
        result.idle_ms = 2.0
        return result

    harness.backend.step = waiting_step  # type: ignore[method-assign]
    for _ in range(2):  # each a prefill and 3 decodes, after a time with nothing to run
        await asyncio.sleep(0.05)  # the engine has finished the request before and waits for work
        body = {"inputs": "x", "parameters": {"max_new_tokens": 4}}
        assert (await harness.client.post("/generate", json=body)).status_code == 200
    s = samples((await harness.client.get("/metrics")).text)
    assert sum(plan.num_requests > 0 for plan in sent) == 8
    assert s["loom_shard_idle_seconds_count"] == 6  # the decodes: the prefills came after no work
    assert s["loom_shard_idle_seconds_sum"] == pytest.approx(6 * 0.002)


async def test_tgi_and_loom_counts_match_the_traffic(harness: Harness) -> None:  # noqa: F811
    batches = {"ok": 0, "failed": 0}  # steps that ran requests (not block operations alone)
    shard_step = harness.backend.step

    async def counting_step(plan: StepPlan) -> StepResult:
        try:
            result = await shard_step(plan)
        except RuntimeError:
            batches["failed"] += plan.num_requests > 0
            raise
        batches["ok"] += plan.num_requests > 0
        return result

    harness.backend.step = counting_step  # type: ignore[method-assign]
    await send_traffic(harness)
    text = (await harness.client.get("/metrics")).text
    s = samples(text)
    assert s["tgi_request_count"] == 6
    assert s["tgi_request_success"] == 4
    assert s['tgi_request_failure{err="validation"}'] == 1
    assert s['tgi_request_failure{err="generation"}'] == 1
    assert s['tgi_request_failure{err="overloaded"}'] == 0
    for name in ("duration", "queue_duration", "validation_duration", "inference_duration",
                 "mean_time_per_token_duration"):
        assert s[f"tgi_request_{name}_count"] == 4, name
    assert s["tgi_request_generated_tokens_sum"] == 12 and s["tgi_request_generated_tokens_count"] == 4
    assert s["tgi_request_input_length_count"] == 5  # the shard failure was submitted too
    assert s["tgi_request_max_new_tokens_sum"] == 3 + 3 + 4 + 2 + 2
    assert s["loom_generated_tokens_total"] == 12
    assert s["loom_time_to_first_token_seconds_count"] == 4
    assert s["loom_inter_token_latency_seconds_count"] == 12 - 4
    steps = sum(s[f'tgi_batch_inference_count{{method="{m}"}}'] for m in ("prefill", "decode"))
    ok = sum(s.get(f'tgi_batch_inference_success{{method="{m}"}}', 0) for m in ("prefill", "decode"))
    failed = sum(s.get(f'tgi_batch_inference_failure{{method="{m}"}}', 0) for m in ("prefill", "decode"))
    assert (ok, failed) == (batches["ok"], batches["failed"]) and failed == 1 and steps == ok + failed
    assert s["loom_steps_total"] == harness.backend.num_steps > ok  # loom_steps counts block-only steps too
    assert s["loom_steps_planned_ahead_total"] == 0  # one step at a time (no --overlap-steps here)
    assert s['tgi_batch_forward_duration_count{method="prefill"}'] >= 4
    assert s["tgi_queue_size"] == 0 and s["tgi_batch_current_size"] == 0
    assert s["tgi_batch_max_total_tokens"] == harness.engine.max_batch_total_tokens
    assert s['loom_requests_finished_total{reason="length"}'] == 4
    # TGI's exact names, types and buckets: counters without `_total`, 35 duration buckets.
    t = types(text)
    assert t["tgi_request_count"] == "counter" and t["tgi_request_duration"] == "histogram"
    assert t["tgi_queue_size"] == "gauge" and "tgi_request_count_total" not in s
    les = re.findall(r'tgi_request_duration_bucket\{le="([^"]+)"\}', text)
    assert les == [floatToGoString(b) for b in DURATION_BUCKETS] + ["+Inf"]
    max_input = harness.engine.max_input_tokens
    assert f'tgi_request_input_length_bucket{{le="{floatToGoString(max_input / 100)}"}}' in text


async def test_one_log_line_per_finished_request(harness: Harness,  # noqa: F811
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        await send_traffic(harness)
    records = [r for r in caplog.records if r.name == REQUEST_LOGGER]
    assert len(records) == 5  # the validation failure never became a request
    fields = [r.fields for r in records]  # type: ignore[attr-defined]
    assert sorted(f["num_generated_tokens"] for f in fields) == [0, 2, 3, 3, 4]
    assert sorted(f["finish_reason"] for f in fields) == ["error", "length", "length", "length", "length"]
    done = [f for f in fields if f["finish_reason"] == "length"]
    assert all(f["ttft_ms"] is not None and f["queue_ms"] is not None and f["total_ms"] >= f["ttft_ms"]
               for f in done)
    assert "num_input_tokens=" in records[0].getMessage() and "ttft_ms=" in records[0].getMessage()
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["target"] == REQUEST_LOGGER and line["fields"] == fields[0] and line["level"] == "INFO"


async def test_snapshot_failures_are_counted_by_reason(harness: Harness) -> None:  # noqa: F811
    response = await harness.client.post("/snapshots/a?action=save", json={"inputs": "x"})
    assert response.status_code == 501  # no --snapshot-dir
    s = samples((await harness.client.get("/metrics")).text)
    assert s['loom_snapshot_operations_total{op="save",result="error"}'] == 1
    assert s['loom_snapshot_failures_total{op="save",reason="disabled"}'] == 1


async def test_fastapis_own_pages_are_counted_by_their_path(harness: Harness) -> None:  # noqa: F811
    assert (await harness.client.get("/openapi.json")).status_code == 200
    assert (await harness.client.get("/no/such/path")).status_code == 404
    s = samples((await harness.client.get("/metrics")).text)
    assert s['loom_http_requests_total{route="/openapi.json",status="200"}'] == 1
    assert s['loom_http_requests_total{route="unmatched",status="404"}'] == 1


async def test_prometheus_port_serves_the_same_exposition() -> None:
    frontend = FrontendMetrics()
    frontend.tgi.on_arrival()
    core = CoreMetrics()
    core.frontend_sources.append(frontend.registry)
    server = await start_metrics_server(core.render, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/metrics")
            missing = await client.get(f"http://127.0.0.1:{port}/other")
    finally:
        server.close()
    assert response.status_code == 200 and samples(response.text)["tgi_request_count"] == 1
    assert response.headers["content-type"].startswith("text/plain") and missing.status_code == 404


async def test_prometheus_port_asks_for_a_key_when_metrics_require_one() -> None:
    core = CoreMetrics()
    server = await start_metrics_server(core.render, "127.0.0.1", 0, api_keys=(b"sekrit",))
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    try:
        async with httpx.AsyncClient() as client:
            missing, wrong = await client.get(url), await client.get(url, headers={"Authorization": "Bearer nope"})
            bearer = await client.get(url, headers={"Authorization": "Bearer sekrit"})
            anthropic_style = await client.get(url, headers={"x-api-key": "sekrit"})
    finally:
        server.close()
    assert missing.status_code == wrong.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert bearer.status_code == anthropic_style.status_code == 200 and "loom_" in bearer.text


async def test_every_generating_route_is_counted_and_client_errors_are_not_failed_generations(
        harness: Harness) -> None:  # noqa: F811
    c = harness.client
    before = samples((await c.get("/metrics")).text)
    message = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert (await c.post("/v1/messages", json=message)).status_code == 200
    assert (await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})).status_code == 200
    assert (await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404
    too_big = {"inputs": "x" * (harness.router.config.payload_limit + 1)}
    assert (await c.post("/generate", json=too_big)).status_code == 413
    after = samples((await c.get("/metrics")).text)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("tgi_request_count") == 4 and delta("tgi_request_success") == 2
    assert delta("tgi_request_generated_tokens_sum") == 4
    assert delta('tgi_request_failure{err="validation"}') == 2
    assert delta('tgi_request_failure{err="generation"}') == 0


async def test_the_x_request_id_comes_back_and_names_the_log_line(harness: Harness,  # noqa: F811
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        mine = await harness.client.post("/v1/completions", json=body, headers={"X-Request-Id": "client-42"})
        made = await harness.client.post("/v1/completions", json=body)
        odd = await harness.client.post("/v1/completions", json=body, headers={"X-Request-Id": "bad id\tx"})
    assert mine.headers["x-request-id"] == "client-42"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", odd.headers["x-request-id"])  # not a token: replaced
    records = [r for r in caplog.records if r.name == REQUEST_LOGGER]
    logged = [r.fields["http_request_id"] for r in records]  # type: ignore[attr-defined]
    assert logged == ["client-42", made.headers["x-request-id"], odd.headers["x-request-id"]]
    assert "http_request_id=client-42" in records[0].getMessage()
