"""--otlp-endpoint: a request becomes a `generate` span with `queue` and `inference` children,
each step a `step` span whose context reaches the shard over gRPC, where it is the parent of a
`shard.step` span (and of snapshot spans); all exported over OTLP/HTTP to a collector (here a
local HTTP server that decodes what it gets)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fakes import FakeShardClient
from grpc_fakes import FakeRunner
from router_harness import start_router
from test_api import router_config
from test_grpc import decode_plan

from loom_router.core.shard_client import ShardClient
from loom_router.observability.tracing import configure_tracing, traces_url
from loom_router.tokenizer import Tokenizer
from loom_shard.server import ShardServicer, start_server
from loom_shard.tracing import ShardTracer
from loom_shard.tracing import configure_tracing as configure_shard_tracing
from tests.otlp_collector import Collector, attrs, by_name, exported_spans

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is part of the test extras")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    assert configure_tracing(None) is None


async def test_a_request_is_exported_as_spans(collector: Collector,
                                              backend: FakeShardClient, tokenizer: Tokenizer) -> None:  # noqa: F811
    url, received = collector
    tracer = configure_tracing(url)
    assert tracer is not None
    router = await start_router(router_config(), backend, tokenizer, tracer=tracer)
    response = await router.http.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    await router.stop()
    tracer.shutdown()  # flushes the batch
    assert [path for path, _ in received] == ["/v1/traces"]
    export = ExportTraceServiceRequest.FromString(received[0][1])
    spans = [span for rs in export.resource_spans for ss in rs.scope_spans for span in ss.spans]
    named = {span.name: span for span in spans}
    assert set(named) == {"generate", "queue", "inference"}
    root = named["generate"]
    assert named["queue"].parent_span_id == named["inference"].parent_span_id == root.span_id
    assert root.start_time_unix_nano <= named["queue"].start_time_unix_nano
    assert named["inference"].end_time_unix_nano == root.end_time_unix_nano
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["num_generated_tokens"].int_value == 3
    assert attributes["finish_reason"].string_value == "length"
    service = {a.key: a.value.string_value for a in export.resource_spans[0].resource.attributes}
    assert service["service.name"] == "loom-router"


# ---- a real shard process (the embedded model on CPU) behind the real router ----

def start_shard(socket: Path, snapshot_dir: Path, *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom_shard.server", "--uds-path", str(socket), "--device", "cpu",
         "--max-batch-total-tokens", "256", "--snapshot-dir", str(snapshot_dir), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = proc.stdout.readline() if proc.stdout else ""
    if not ready.startswith("loom-shard ready"):
        proc.kill()
        raise AssertionError(f"shard did not start: {proc.communicate()[1]}")
    return proc


def stop_shard(proc: subprocess.Popen[str]) -> str:
    """SIGTERM (the shard flushes its spans on the way out); returns its stderr."""
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    return stderr


@asynccontextmanager
async def router_over_real_shard(tmp_path: Path, tokenizer: Tokenizer, endpoint: str,
                                 shard_log: list[str]) -> AsyncIterator[httpx.AsyncClient]:
    """The router (an engine core and a frontend in process, wired as loom_router.main does) over
    one real shard process, all tracing to `endpoint`. The shard's stderr lands in shard_log at the end."""
    socket, snapshots = tmp_path / "shard.sock", tmp_path / "snapshots"
    shard = start_shard(socket, snapshots, "--otlp-endpoint", endpoint)
    try:
        client = ShardClient([str(socket)])
        await client.wait_ready(timeout_s=60.0)
        config = router_config(shard_uds_paths=(str(socket),), snapshot_dir=str(snapshots),
                               max_batch_total_tokens=256, max_total_tokens=128)
        tracer = configure_tracing(endpoint)
        assert tracer is not None
        router = await start_router(config, client, tokenizer, tracer=tracer, core_tracer=tracer)
        yield router.http
        await router.stop()
        await client.close()
        tracer.shutdown()
    finally:
        shard_log.append(stop_shard(shard))


async def generate_and_snapshot(http: httpx.AsyncClient) -> None:
    response = await http.post("/generate", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200, response.text
    saved = await http.post("/snapshots/sky?action=save", json={"inputs": "The sky is blue"})
    assert saved.status_code == 200, saved.text
    restored = await http.post("/snapshots/sky?action=restore")
    assert restored.status_code == 200, restored.text


@pytest.mark.slow  # a real shard process: ~10 s idle, more under load
async def test_a_real_shards_spans_are_children_of_the_routers_spans(
        collector: Collector, tmp_path: Path, tokenizer: Tokenizer) -> None:
    url, received = collector
    shard_log: list[str] = []
    async with router_over_real_shard(tmp_path, tokenizer, url, shard_log) as http:
        await generate_and_snapshot(http)
    assert "Traceback" not in shard_log[0], shard_log[0]
    check_spans(exported_spans(received))


def check_spans(exported: list[tuple[str, Any]]) -> None:
    for service, span in exported:
        assert service == ("loom-shard" if span.name.startswith("shard.") else "loom-router"), span.name
    spans = by_name(exported)
    router_steps = {span.span_id: span for span in spans["step"]}
    shard_steps = {span.span_id: span for span in spans["shard.step"]}
    # Every step reached the shard, as the child of the router's step span, in its trace.
    assert len(shard_steps) == len(router_steps) >= 3
    for span in shard_steps.values():
        parent = router_steps[span.parent_span_id]
        assert span.trace_id == parent.trace_id
        assert parent.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        shard, router = attrs(span), attrs(parent)
        assert shard.pop("loom.rank") == 0
        assert shard == {k: v for k, v in router.items() if k != "loom.request_ids"}
    # The request's steps name it: its prefill, then one decode token per step.
    (generate,) = spans["generate"]
    request_id = attrs(generate)["request_id"]
    served = [attrs(s) for s in sorted(router_steps.values(), key=lambda s: s.start_time_unix_nano)
              if request_id in attrs(s)["loom.request_ids"]]
    assert served[0]["loom.prefill_tokens"] == attrs(generate)["num_input_tokens"]
    assert [step["loom.decode_tokens"] for step in served[1:]] == [1, 1]
    # The phases are children of the shard's step; every step that computed has a forward.
    for name in ("shard.prepare", "shard.forward", "shard.sample"):
        for span in spans[name]:
            assert shard_steps[span.parent_span_id].trace_id == span.trace_id
    computing = [s for s in shard_steps.values() if attrs(s)["loom.num_sequences"] > 0]
    assert len(spans["shard.forward"]) == len(spans["shard.sample"]) == len(computing)
    assert len(spans["shard.prepare"]) == len(shard_steps)
    # Snapshot spans on the shard are children of the router's save / restore spans.
    (save,), (restore,) = spans["snapshot.save"], spans["snapshot.restore"]
    for name, parent in [("shard.snapshot.save", save), ("shard.snapshot.commit", save),
                         ("shard.snapshot.load", restore), ("shard.snapshot.fill", restore)]:
        assert spans[name], name
        for span in spans[name]:
            assert (span.trace_id, span.parent_span_id) == (parent.trace_id, parent.span_id), name
            assert attrs(span)["loom.snapshot.status"] == "ok"


# ---- the shard's server in process (a fake runner): context in, spans out, or nothing ----

async def serve_fake(tmp_path: Path, tracer: ShardTracer | None) -> tuple[Any, Any, FakeRunner, str]:
    runner = FakeRunner()
    path = str(tmp_path / "fake.sock")
    server, servicer = await start_server(runner, path, tracer=tracer)
    return server, servicer, runner, path


async def test_the_step_context_crosses_grpc(collector: Collector, tmp_path: Path) -> None:
    url, received = collector
    router_tracer, shard_tracer = configure_tracing(url), configure_shard_tracing(url, rank=0)
    assert router_tracer is not None and shard_tracer is not None
    server, servicer, runner, path = await serve_fake(tmp_path, shard_tracer)
    client = ShardClient([path])
    client.trace_metadata = router_tracer.grpc_metadata
    try:
        with router_tracer.step(decode_plan(), [0]):
            await client.step(decode_plan())
        await client.step(decode_plan())  # outside any router span: the shard's span is a root
    finally:
        await client.close()
        await server.stop(None)
        servicer.close()
    router_tracer.shutdown()
    shard_tracer.shutdown()
    assert runner.traced_steps == 2
    spans = by_name(exported_spans(received))
    (router_step,) = spans["step"]
    child, root = sorted(spans["shard.step"], key=lambda s: s.start_time_unix_nano)
    assert (child.trace_id, child.parent_span_id) == (router_step.trace_id, router_step.span_id)
    assert root.parent_span_id == b"" and root.trace_id != router_step.trace_id
    assert attrs(child) == {"loom.rank": 0, "loom.num_sequences": 2, "loom.prefill_tokens": 3,
                            "loom.decode_tokens": 1}
    assert attrs(router_step)["loom.request_ids"] == [0]
    assert {s.parent_span_id for s in spans["shard.forward"]} == {child.span_id, root.span_id}


async def test_tracing_off_sends_no_context_and_times_no_phase(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    original = ShardServicer.run_step  # where gRPC's Step and the step socket both arrive

    async def spy(self: ShardServicer, plan: Any, metadata: Any) -> Any:
        seen.append(tuple(metadata or ()))
        return await original(self, plan, metadata)

    monkeypatch.setattr(ShardServicer, "run_step", spy)
    server, servicer, runner, path = await serve_fake(tmp_path, None)
    client = ShardClient([path])
    try:
        assert (await client.step(decode_plan())).outputs
    finally:
        await client.close()
        await server.stop(None)
        servicer.close()
    assert runner.traced_steps == 0
    assert len(seen) == 1 and not any(key == "traceparent" for key, _ in seen[0])
