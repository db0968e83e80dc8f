"""The shard's tracing pieces: the runner's phase instants, the step counts, the missing SDK."""

from __future__ import annotations

import logging
import sys

import pytest

from loom_proto.step import NewRequest, RunningRequest, SamplingParams, StepPlan
from loom_proto.tracing import SHARD_FORWARD_SPAN, SHARD_PREPARE_SPAN, SHARD_SAMPLE_SPAN, StepCounts
from loom_shard.tracing import StepPhases, configure_tracing
from tests.unit.shard.conftest import random_tokens
from tests.unit.shard.test_runner import runner  # noqa: F401 (the fixture)

GREEDY = SamplingParams(seed=0)


def test_the_runner_records_its_phases_in_order_and_outputs_do_not_change(runner) -> None:  # noqa: F811
    tokens = random_tokens(6, 3)
    plain = runner.step(StepPlan(new_requests=[NewRequest(1, tokens, 6, 0, 6, [0, 1], GREEDY)]))
    phases = StepPhases()
    traced = runner.step(StepPlan(new_requests=[NewRequest(2, tokens, 6, 0, 6, [2, 3], GREEDY)]), phases)
    assert traced.outputs[0].token_id == plain.outputs[0].token_id
    assert phases.start is not None and phases.forward_start is not None
    assert phases.sample_start is not None and phases.end is not None
    assert phases.start <= phases.forward_start <= phases.sample_start <= phases.end
    assert [name for name, _, _ in phases.spans()] == [SHARD_PREPARE_SPAN, SHARD_FORWARD_SPAN, SHARD_SAMPLE_SPAN]


def test_a_step_without_sequences_has_no_forward_phase(runner) -> None:  # noqa: F811
    phases = StepPhases()
    runner.step(StepPlan(released_ids=[7]), phases)
    assert [name for name, _, _ in phases.spans()] == [SHARD_PREPARE_SPAN]


def test_step_counts_split_prefill_and_decode() -> None:
    plan = StepPlan(new_requests=[NewRequest(1, [1, 2, 3, 4], 4, 1, 3, [0], GREEDY)],
                    running_requests=[RunningRequest(2, 1), RunningRequest(3, 5), RunningRequest(4, 1)])
    assert StepCounts.of(plan) == StepCounts(num_sequences=4, prefill_tokens=8, decode_tokens=2)
    assert StepCounts.of(StepPlan()) == StepCounts(0, 0, 0)


def test_no_endpoint_is_no_tracer() -> None:
    assert configure_tracing(None, rank=0) is None


def test_a_missing_sdk_is_one_warning_and_no_tracer(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="loom_shard.tracing"):
        assert configure_tracing("http://collector:4318", rank=1) is None
    assert len(caplog.records) == 1
    assert "rank 1" in caplog.text and "loom-shard[otel]" in caplog.text
