"""--placement ray without a cluster: what each rank's bundle asks for, where the shards' ports come
from, and which flag combinations are refused (the cluster itself: tests/e2e/test_multinode_e2e.py)."""

from __future__ import annotations

import socket

import pytest

from loom_launcher.cli import load_settings
from loom_launcher.ray_placement import bundle, uses_gpus
from loom_launcher.ray_shard import ShardHost, free_ports


def test_bundles_ask_for_a_gpu_with_cuda_and_cpu_threads_otherwise() -> None:
    cuda = load_settings(["--placement", "ray", "--num-shard", "2", "--device", "cuda"])
    assert uses_gpus(cuda, cluster_gpus=0.0) and bundle(cuda, gpus=True) == {"GPU": 1.0, "CPU": 1.0}
    cpu = load_settings(["--placement", "ray", "--num-shard", "2", "--device", "cpu", "--num-threads", "4"])
    assert not uses_gpus(cpu, cluster_gpus=8.0) and bundle(cpu, gpus=False) == {"CPU": 4.0}
    auto = load_settings(["--placement", "ray", "--num-shard", "2"])
    assert uses_gpus(auto, cluster_gpus=2.0) and not uses_gpus(auto, cluster_gpus=1.0)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports("127.0.0.1", 2)
    assert len(set(ports)) == 2
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_shard_host_reports_its_shards_exit(tmp_path) -> None:
    host = ShardHost(rank=0)
    assert host.returncode() is None and host.stop(1.0) is None  # nothing started yet
    host.start("{}", None, {})  # an empty config: loom-shard refuses it at once
    assert not host.wait_ready(60.0)
    assert host.returncode() == 2 and any("error" in line for line in host.last_lines())


def test_ray_placement_starts_everything_itself() -> None:
    with pytest.raises(SystemExit):
        load_settings(["--placement", "ray", "--role", "shards", "--shard-port", "7000"])


def test_without_ray_the_launcher_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import threading

    from loom_launcher.ray_placement import serve_on_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    lines: list[str] = []
    settings = load_settings(["--placement", "ray"])
    assert serve_on_ray(settings, threading.Event(), log=lines.append) == 2
    assert lines == ["[launcher] error: --placement ray needs Ray: pip install 'loom-launcher[ray]'"]
