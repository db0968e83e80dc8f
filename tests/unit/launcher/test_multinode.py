"""The launcher across nodes: which ranks a node starts, TCP addresses, the router alone driving
remote shards, and the shard secret travelling on stdin (made fresh when one host runs it all)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from loom_launcher.cli import child_env, load_settings, router_spec, shard_spec, threads_per_shard, with_shard_secret
from loom_proto.config import RouterConfig, ShardConfig, parse_config

SECRET = "node-shared-secret"


def test_a_shards_node_starts_its_ranks_on_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_SHARD_SECRET", SECRET)
    node = load_settings(["--role", "shards", "--num-shard", "4", "--nnodes", "2", "--node-rank", "1",
                          "--shard-port", "7000", "--shard-host", "0.0.0.0", "--master-addr", "10.0.0.1"])
    assert list(node.local_ranks()) == [2, 3]
    configs = [node.shard_config(rank) for rank in node.local_ranks()]
    assert [(c.rank, c.local_rank, c.world_size) for c in configs] == [(2, 0, 4), (3, 1, 4)]
    assert [c.tcp_address for c in configs] == ["0.0.0.0:7002", "0.0.0.0:7003"]
    assert all(c.uds_path is None and c.master_addr == "10.0.0.1" for c in configs)
    assert threads_per_shard(node, num_cpus=8) == 4  # cores split among this node's shards only


def test_the_router_alone_drives_remote_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_SHARD_SECRET", SECRET)
    router = load_settings(["--role", "router", "--shard-address", "10.0.0.1:7000",
                            "--shard-address", "10.0.0.2:7001"]).router_config()
    assert router.shard_targets() == ("10.0.0.1:7000", "10.0.0.2:7001")
    monkeypatch.setenv("LOOM_SHARD_ADDRESSES", "h0:7000,h1:7001")
    assert load_settings(["--role", "router"]).router_config().shard_addresses == ("h0:7000", "h1:7001")


@pytest.mark.parametrize("argv", [["--role", "shards"],  # no --shard-port
                                  ["--role", "router"],  # no --shard-address
                                  ["--nnodes", "2", "--num-shard", "2"],  # several nodes need roles
                                  ["--role", "shards", "--shard-port", "7000", "--nnodes", "2", "--num-shard", "3"],
                                  ["--role", "shards", "--shard-port", "7000", "--nnodes", "2", "--node-rank", "2",
                                   "--num-shard", "2"],
                                  ["--shard-address", "h:1"]])  # an address without --role router
def test_inconsistent_topologies_are_refused(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LOOM_SHARD_SECRET", SECRET)
    with pytest.raises(SystemExit) as exit_info:
        load_settings(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_one_host_on_tcp_gets_a_fresh_secret_on_stdin_never_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = with_shard_secret(load_settings(["--num-shard", "2", "--shard-port", "7100"]))
    secret = settings.resolved_shard_secret()
    assert secret and len(secret) >= 32
    shard = shard_spec(settings.shard_config(1), {})
    router = router_spec(settings.router_config(), {})
    for spec in (shard, router):
        assert not any(secret in arg for arg in spec.argv) and spec.argv[-1] == "--secrets-on-stdin"
        assert spec.stdin_text is not None and secret in spec.stdin_text
    monkeypatch.setattr(sys, "stdin", io.StringIO(shard.stdin_text))
    parsed = parse_config(ShardConfig, list(shard.argv[3:]), "loom-shard", "")
    assert parsed.resolved_shard_secret() == secret and parsed.tcp_address == "127.0.0.1:7101"
    monkeypatch.setattr(sys, "stdin", io.StringIO(router.stdin_text))
    parsed_router = parse_config(RouterConfig, list(router.argv[3:]), "loom-router", "")
    assert parsed_router.shard_targets() == ("127.0.0.1:7100", "127.0.0.1:7101")
    assert "shard_secret" not in json.loads(router.argv[4])  # the argv JSON leaves it out
    assert "LOOM_SHARD_SECRET" not in child_env({"LOOM_SHARD_SECRET": secret}, num_threads=1)


def test_a_secret_file_is_read_and_an_empty_one_refused(tmp_path) -> None:
    good, empty = tmp_path / "secret", tmp_path / "empty"
    good.write_text(SECRET + "\n")
    empty.write_text("\n")
    assert ShardConfig(tcp_address="h:1", shard_secret_file=str(good)).resolved_shard_secret() == SECRET
    with pytest.raises(ValueError, match="is empty"):
        ShardConfig(tcp_address="h:1", shard_secret_file=str(empty)).resolved_shard_secret()
    with pytest.raises(ValueError, match="cannot read"):
        ShardConfig(tcp_address="h:1", shard_secret_file=str(tmp_path / "missing")).resolved_shard_secret()
