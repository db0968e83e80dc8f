"""loom-router's command line: every RouterConfig field round-trips through its flags and JSON; a
signal while it starts stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom_proto.config import RouterConfig, option, parse_config, public_json
from loom_router.main import DESCRIPTION
from tests.net import free_port


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


def test_a_signal_while_waiting_for_the_shards_stops_cleanly(tmp_path: Path) -> None:
    """Nothing left behind (its private folder for the frontends' sockets) and exit 0, as when serving."""
    config = RouterConfig(model_id="", shard_uds_paths=(str(tmp_path / "no-shard.sock"),), hostname="127.0.0.1",
                          port=free_port(), shard_ready_timeout=60.0)
    router = subprocess.Popen([sys.executable, "-m", "loom_router.main", "--config-json", public_json(config)],
                              env={**os.environ, "TMPDIR": str(tmp_path)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("loom-router-*")) and time.monotonic() < deadline:
        time.sleep(0.05)  # it made its folder: it is waiting for the shard
    assert list(tmp_path.glob("loom-router-*")), "the router never started waiting"
    router.send_signal(signal.SIGTERM)
    assert router.wait(timeout=10) == 0, router.stderr.read() if router.stderr else ""
    assert not list(tmp_path.glob("loom-router-*"))
