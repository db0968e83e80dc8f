"""loom-shard's flags cover every ShardConfig field, spelled the way the launcher passes them."""

from __future__ import annotations

import dataclasses

import pytest

from loom.shard.config import ShardConfig
from loom.shard.server import parse_config


def as_flags(config: ShardConfig) -> list[str]:
    """`--kebab-case value` per field, None left out (what the launcher builds)."""
    flags: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is not None:
            flags += ["--" + field.name.replace("_", "-"), str(value)]
    return flags


def test_every_field_round_trips_through_the_flags():
    config = ShardConfig(
        model_id="/models/x.gguf", uds_path="/tmp/s-1", dtype="bfloat16", device="cuda", rank=1, world_size=2,
        master_addr="10.0.0.2", master_port=29123, block_size=32, max_batch_total_tokens=8192,
        memory_fraction=0.5, cpu_kv_cache_bytes=2**30, host_kv_cache_bytes=2**31, snapshot_dir="/snaps",
    )
    changed = [f.name for f in dataclasses.fields(ShardConfig) if getattr(config, f.name) != f.default]
    assert len(changed) == len(dataclasses.fields(ShardConfig)), "give every field a non-default value"
    assert parse_config(as_flags(config)) == config


def test_defaults_match_the_config():
    assert parse_config(["--uds-path", "/tmp/s"]) == ShardConfig(model_id="", uds_path="/tmp/s")


def test_empty_model_id_means_the_embedded_default():
    assert parse_config(["--model-id", "", "--uds-path", "/tmp/s"]).model_id == ""


def test_invalid_config_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(["--uds-path", "/tmp/s", "--block-size", "0"])
    assert exited.value.code == 2
    assert "block_size must be positive" in capsys.readouterr().err
