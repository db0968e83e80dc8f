"""--otlp-endpoint through the real launcher with two tensor-parallel shards: the flag reaches
every process, and each step is one trace in which both ranks' `shard.step` spans are children
of the router's `step` span (the context crossed gRPC to each rank)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import StartLauncher
from test_snapshots_e2e import save_tiny_llama

from tests.otlp_collector import Collector, attrs, by_name, exported_spans

pytest.importorskip("opentelemetry.sdk", reason="the otel extras are part of the test extras")


@pytest.mark.slow
def test_two_ranks_trace_each_step_under_the_routers_span(start_launcher: StartLauncher, e2e_dir: Path,
                                                          collector: Collector) -> None:
    url, received = collector
    # A tiny random Llama (2 kv heads) splits over 2 shards; the embedded model does not.
    model = save_tiny_llama(e2e_dir / "tiny-llama-tracing")
    launcher = start_launcher("--model-id", str(model), "--dtype", "float32", "--num-shard", "2",
                              "--otlp-endpoint", url)
    response = httpx.post(f"{launcher.base_url}/v1/completions", timeout=120,
                          json={"prompt": "w1 w2 w3", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert launcher.stop() == 0  # every process flushes its spans on the way out
    exported = exported_spans(received)
    assert {service for service, _ in exported} == {"loom-router", "loom-shard"}
    spans = by_name(exported)
    (generate,) = spans["generate"]
    request_id = attrs(generate)["request_id"]
    steps = {span.span_id: span for span in spans["step"] if request_id in attrs(span)["loom.request_ids"]}
    assert len(steps) == 4  # one prefill step, then a decode step per further token
    ranks_by_step: dict[bytes, list[int]] = {}
    for span in spans["shard.step"]:
        parent = steps.get(span.parent_span_id)
        if parent is not None:
            assert span.trace_id == parent.trace_id
            ranks_by_step.setdefault(span.parent_span_id, []).append(attrs(span)["loom.rank"])
    assert {step: sorted(ranks) for step, ranks in ranks_by_step.items()} == {step: [0, 1] for step in steps}
    forwards = [s for s in spans["shard.forward"] if s.parent_span_id in {c.span_id for c in spans["shard.step"]}]
    assert len(forwards) >= 8  # both ranks' forward phase of the request's four steps
