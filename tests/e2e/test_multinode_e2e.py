"""Tensor parallel over 2 ranks on CPU (gloo) spread beyond one launcher: as two nodes' shards on
TCP plus a router-only launcher, and as Ray actors on a local two-node Ray cluster, one rank per
node. Both must give the single-host run's tokens; a stranger at a shard's port is refused and
logged; a dying shard on Ray tears everything down."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import STARTUP_TIMEOUT_S, serving, spawn_launcher, wait_healthy
from tests.net import free_port

if TYPE_CHECKING:
    from conftest import Launcher, StartLauncher

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30"]  # the tiny model's words
SECRET = "e2e-multinode-secret"


@pytest.fixture(scope="module")
def tp_args(e2e_dir: Path) -> tuple[str, ...]:
    """A tiny random Llama (2 kv heads: it splits over 2 ranks; the embedded model does not)."""
    from test_snapshots_e2e import save_tiny_llama

    model = save_tiny_llama(e2e_dir / "tiny-llama-multinode")
    return ("--model-id", str(model), "--num-shard", "2", "--dtype", "float32", "--num-threads", "1")


def greedy(base_url: str) -> list[list[int]]:
    tokens = []
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
        response = httpx.post(f"{base_url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        tokens.append([t["id"] for t in response.json()["details"]["tokens"]])
    return tokens


@pytest.fixture(scope="module")
def single_host_tokens(e2e_dir: Path, tp_args: tuple[str, ...]) -> list[list[int]]:
    with serving(e2e_dir, *tp_args) as launcher:
        return greedy(launcher.base_url)


def wait_for_line(launcher: Launcher, text: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while text not in launcher.log():
        assert launcher.process.poll() is None, launcher.log()
        assert time.monotonic() < deadline, launcher.log()
        time.sleep(0.5)


def test_two_nodes_on_tcp_and_a_router_give_the_single_host_tokens(
        e2e_dir: Path, tp_args: tuple[str, ...], single_host_tokens: list[list[int]],
        started_launchers: list[Launcher]) -> None:
    base_port, master_port = free_port(), free_port()
    env = {"LOOM_SHARD_SECRET": SECRET}
    nodes = [spawn_launcher(e2e_dir, *tp_args, "--role", "shards", "--nnodes", "2", "--node-rank", str(rank),
                            "--shard-port", str(base_port), "--master-port", str(master_port), env=env)
             for rank in range(2)]
    started_launchers.extend(nodes)
    try:
        for node in nodes:
            wait_for_line(node, "this node's shards are serving")
        addresses = [f"127.0.0.1:{base_port + rank}" for rank in range(2)]
        router = spawn_launcher(e2e_dir, *tp_args[:2], "--role", "router", "--shard-address", addresses[0],
                                "--shard-address", addresses[1], env=env)
        started_launchers.append(router)
        wait_healthy(router)
        assert greedy(router.base_url) == single_host_tokens
        assert httpx.get(f"{router.base_url}/info", timeout=10).json()["world_size"] == 2
        stranger_knocks(addresses[1])
        wait_for_line(nodes[1], "rank 1 refused a connection from ipv4:127.0.0.1:")
        assert greedy(router.base_url)[:1] == single_host_tokens[:1]  # the router still serves
        router.stop()
    finally:
        for node in nodes:
            node.stop()


def stranger_knocks(address: str) -> None:
    import grpc

    from loom_proto import shard_pb2_grpc
    from loom_proto.codec import pb

    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            shard_pb2_grpc.ShardStub(channel).Info(pb.InfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- Ray -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Two Ray nodes on this machine, one CPU each (so STRICT_SPREAD puts one rank on each)."""
    cluster_utils = pytest.importorskip("ray.cluster_utils", reason="ray is not installed (loom-launcher[ray])")
    small = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=small)
    cluster.add_node(**small)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def test_ray_places_one_rank_per_node_and_gives_the_single_host_tokens(
        ray_cluster: str, tp_args: tuple[str, ...], single_host_tokens: list[list[int]],
        start_launcher: StartLauncher) -> None:
    launcher = start_launcher(*tp_args, "--placement", "ray", "--ray-address", ray_cluster,
                              "--ray-placement-strategy", "STRICT_SPREAD")
    placed = [line for line in launcher.log().splitlines() if "placed on node" in line]
    assert len(placed) == 2 and len({line.split("node ")[1].split()[0] for line in placed}) == 2, placed
    assert greedy(launcher.base_url) == single_host_tokens

    kill_shard(rank=1)
    assert launcher.wait(timeout=120) == 1
    log = launcher.log()
    # Whichever notices first (the launcher's poll of the actors, or the router's step or health
    # check): the launcher reports it, then stops the router, the other shard and the Ray parts.
    assert "[launcher] error: shard 1 was killed by SIGKILL (code -9)" in log or "rank 1" in log, log
    assert "[launcher] shard 1 was killed by SIGKILL (code -9)" in log and "[launcher] shard 0 exited with code" in log
    assert "Ray actors and placement group removed" in log


def kill_shard(rank: int) -> None:
    """SIGKILLs the shard process of `rank` started inside a Ray actor (found by its config)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"loom_shard.server" in argv and b"--config-json" in argv:
            config = json.loads(argv[argv.index(b"--config-json") + 1])
            if config["rank"] == rank and config["tcp_address"]:
                os.kill(int(entry.name), signal.SIGKILL)
                return
    raise AssertionError(f"no shard process of rank {rank}")
