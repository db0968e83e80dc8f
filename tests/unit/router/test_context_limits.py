"""A request's context limits from the flags and the model: defaults, and what is refused or
warned about at start."""

from __future__ import annotations

import logging

import pytest

from loom_proto.config import RouterConfig
from loom_router.core.engine import context_limits, fit_kv_cache


def config(**limits: int) -> RouterConfig:
    return RouterConfig(shard_uds_paths=("s",), **limits)


def test_the_models_context_by_default_and_the_flags_within_it() -> None:
    assert context_limits(config(), 8192) == (8192, 8191)
    assert context_limits(config(max_total_tokens=2048), 8192) == (2048, 2047)
    assert context_limits(config(max_input_tokens=1000), 8192) == (8192, 1000)


def test_input_that_leaves_no_room_for_output_is_refused_against_the_models_context() -> None:
    with pytest.raises(ValueError, match=r"--max-input-tokens \(9000\) must be below .* \(8192: --max-total-tokens"):
        context_limits(config(max_input_tokens=9000), 8192)


def test_a_total_past_the_models_context_is_served_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert context_limits(config(max_total_tokens=100_000), 8192) == (100_000, 99_999)
    assert "past the model's context (8192 tokens)" in caplog.text


def test_a_default_context_past_the_kv_cache_is_lowered_to_what_one_request_can_hold(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert fit_kv_cache(config(), 8192, 8191, 2048) == (2048, 2047)
    assert "the KV cache holds 2048 for one request" in caplog.text
    assert fit_kv_cache(config(), 1024, 1023, 2048) == (1024, 1023)  # it fits: unchanged


@pytest.mark.parametrize("limits", [{"max_total_tokens": 4096}, {"max_input_tokens": 3000}])
def test_limits_a_flag_sets_are_kept_with_a_warning(limits: dict, caplog: pytest.LogCaptureFixture) -> None:
    total, max_input = limits.get("max_total_tokens", 8192), limits.get("max_input_tokens", 8191)
    with caplog.at_level(logging.WARNING):
        assert fit_kv_cache(config(**limits), total, max_input, 2048) == (total, max_input)
    assert "the KV cache holds 2048 for one" in caplog.text
