"""loom-shard's flags cover every ShardConfig field, and the launcher's JSON round-trips."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from loom_proto.config import ShardConfig, option
from loom_shard.server import parse_config


def as_flags(config: ShardConfig) -> list[str]:
    """`--kebab-case value` per field, None left out."""
    flags: list[str] = []
    for name in ShardConfig.model_fields:
        value = getattr(config, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, tuple):  # a list flag: repeated
            flags += [item for one in value for item in (option(name), one)]
        elif value is not None:
            flags += [option(name), str(value)]
    return flags


CONFIG = ShardConfig(
    model_id="/models/x.gguf", uds_path="/tmp/s-1", dtype="bfloat16", device="cuda", rank=1, world_size=2,
    master_addr="10.0.0.2", master_port=29123, block_size=32, max_batch_total_tokens=8192,
    memory_fraction=0.5, cuda_graphs=False, launch_ahead=True, cpu_kv_cache_bytes=2**30, host_kv_cache_bytes=2**31,
    snapshot_dir="/snaps",
    otlp_endpoint="http://collector:4318", quantize="none", cpu_kernels="avx2", local_rank=0,
    shard_secret_file="/etc/loom/secret", enable_lora=True,
    lora_adapter=("sql=/adapters/sql", "chat=/adapters/chat"), max_lora_rank=32, max_loras_per_batch=2, task="embed",
)
# A shard serves on a unix socket or on TCP, never both: the TCP fields in a config of their own.
TCP_CONFIG = CONFIG.model_copy(update={"uds_path": None, "tcp_address": "0.0.0.0:7001",
                                       "shard_secret": SecretStr("s3cret"), "shard_secret_file": None})


def test_every_field_round_trips_through_the_flags():
    changed = {name for config in (CONFIG, TCP_CONFIG)
               for name, field in ShardConfig.model_fields.items() if getattr(config, name) != field.default}
    assert changed == set(ShardConfig.model_fields), "give every field a non-default value"
    for config in (CONFIG, TCP_CONFIG):
        assert parse_config(as_flags(config)) == config
    assert parse_config(["--config-json", CONFIG.model_dump_json()]) == CONFIG


def test_defaults_match_the_config():
    assert parse_config(["--uds-path", "/tmp/s"]) == ShardConfig(model_id="", uds_path="/tmp/s")


def test_empty_model_id_means_the_embedded_default():
    assert parse_config(["--model-id", "", "--uds-path", "/tmp/s"]).model_id == ""


def test_invalid_config_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(["--uds-path", "/tmp/s", "--block-size", "0"])
    assert exited.value.code == 2
    assert "--block-size" in capsys.readouterr().err


def test_cpu_kernels_choices_are_the_builds_the_shard_knows():
    from loom_shard import kernels

    assert ShardConfig.model_fields["cpu_kernels"].annotation.__args__ == kernels.CHOICES
