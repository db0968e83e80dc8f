"""loom-router's command line: every RouterConfig field round-trips through its flags and JSON."""

from __future__ import annotations

import pytest

from loom_proto.config import RouterConfig, option, parse_config
from loom_router.main import DESCRIPTION


def parse(argv: list[str]) -> RouterConfig:
    return parse_config(RouterConfig, argv, "loom-router", DESCRIPTION)


def as_flags(config: RouterConfig) -> list[str]:
    """`--kebab-case value` per field, None left out, a tuple as a repeated singular flag."""
    flags: list[str] = []
    for name in RouterConfig.model_fields:
        value = getattr(config, name)
        for item in value if isinstance(value, tuple) else () if value is None else (value,):
            flags += [option(name.removesuffix("s")) if isinstance(value, tuple) else option(name), str(item)]
    return flags


CONFIG = RouterConfig(model_id="/models/x.gguf", shard_uds_paths=("/tmp/a.sock", "/tmp/b.sock"),
                      hostname="127.0.0.1", port=8080, max_concurrent_requests=7, max_input_tokens=100,
                      max_total_tokens=200, max_batch_prefill_tokens=512, max_batch_total_tokens=4096,
                      max_stop_sequences=3, max_n=2, max_top_n_tokens=4, snapshot_dir="/snaps",
                      served_model_name="smol", shard_ready_timeout=9.0, graceful_termination_timeout=4.0,
                      log_level="debug")


def test_flags_round_trip() -> None:
    assert parse(as_flags(CONFIG)) == CONFIG


def test_config_json_round_trips() -> None:
    assert parse(["--config-json", CONFIG.model_dump_json()]) == CONFIG


def test_defaults_are_the_config_defaults() -> None:
    config = parse(["--shard-uds-path", "/tmp/s.sock"])
    assert config == RouterConfig(model_id="", shard_uds_paths=("/tmp/s.sock",))


def test_invalid_values_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--shard-uds-path", "s", "--port", "eighty"])
    with pytest.raises(SystemExit):
        parse([])  # no shard socket
    with pytest.raises(SystemExit):
        parse(["--shard-uds-path", "s", "--max-input-tokens", "10", "--max-total-tokens", "10"])
    assert "max_input_tokens" in capsys.readouterr().err
