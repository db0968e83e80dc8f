"""loom-router's command line: every RouterConfig field round-trips through the launcher's flags."""

from __future__ import annotations

import dataclasses

import pytest

from loom.launcher.cli import config_flags
from loom.router.config import RouterConfig
from loom.router.main import build_parser, config_from_args


def parse(argv: list[str]) -> RouterConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_launcher_flags_round_trip() -> None:
    config = RouterConfig(model_id="/models/x.gguf", shard_uds_paths=("/tmp/a.sock", "/tmp/b.sock"),
                          hostname="127.0.0.1", port=8080, max_concurrent_requests=7, max_input_tokens=100,
                          max_total_tokens=200, max_batch_prefill_tokens=512, max_batch_total_tokens=4096,
                          max_stop_sequences=3, max_n=2, max_top_n_tokens=4, snapshot_dir="/snaps",
                          served_model_name="smol")
    argv = config_flags(config, [f.name for f in dataclasses.fields(RouterConfig)])
    assert parse(argv) == config


def test_defaults_are_the_config_defaults() -> None:
    config = parse(["--shard-uds-path", "/tmp/s.sock"])
    assert config == RouterConfig(model_id="", shard_uds_paths=("/tmp/s.sock",))


def test_invalid_values_are_rejected() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--shard-uds-path", "s", "--port", "eighty"])
    with pytest.raises(SystemExit):
        build_parser().parse_args([])  # no shard socket
    with pytest.raises(ValueError, match="max_input_tokens"):
        parse(["--shard-uds-path", "s", "--max-input-tokens", "10", "--max-total-tokens", "10"])
