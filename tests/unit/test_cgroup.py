"""A container's memory limit and CPU quota, read from cgroup v1 and v2 trees laid out as the
kernel (and Docker, Kubernetes) lay them out."""

from __future__ import annotations

from pathlib import Path

from loom_proto.cgroup import cpu_quota, memory_headroom, usable_cpus

GIB = 2**30


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _self(tmp_path: Path, lines: str) -> Path:
    path = tmp_path / "self_cgroup"
    path.write_text(lines)
    return path


def test_v2_pod_limit_is_the_tightest_level_less_its_working_set(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root, {"cgroup.controllers": "cpu memory", "memory.max": "max"})
    _write(root / "kubepods" / "pod1", {"memory.max": str(16 * GIB), "memory.current": str(2 * GIB)})
    _write(root / "kubepods" / "pod1" / "ctr", {
        "memory.max": str(8 * GIB), "memory.current": str(3 * GIB),
        "memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\n", "cpu.max": "400000 100000"})
    self_cgroup = _self(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert memory_headroom(root, self_cgroup) == 8 * GIB - (3 * GIB - GIB)  # dropped page cache is free
    assert cpu_quota(root, self_cgroup) == 4.0
    assert usable_cpus(64, root, self_cgroup) == 4 and usable_cpus(2, root, self_cgroup) == 2


def test_v1_container_sees_its_own_group_at_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"  # Docker on v1: /proc/self/cgroup names the host's path, not mounted here
    _write(root / "memory", {"memory.limit_in_bytes": str(4 * GIB), "memory.usage_in_bytes": str(GIB),
                             "memory.stat": "cache 0\ntotal_inactive_file 0\n"})
    _write(root / "cpu", {"cpu.cfs_quota_us": "150000", "cpu.cfs_period_us": "100000"})
    self_cgroup = _self(tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert memory_headroom(root, self_cgroup) == 3 * GIB
    assert cpu_quota(root, self_cgroup) == 1.5 and usable_cpus(16, root, self_cgroup) == 2


def test_no_limit_anywhere_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "memory" / "job", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "5"})
    _write(root / "cpu", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    self_cgroup = _self(tmp_path, "4:memory:/job\n1:cpu:/\n")
    assert memory_headroom(root, self_cgroup) is None and cpu_quota(root, self_cgroup) is None
    assert usable_cpus(8, root, self_cgroup) == 8
    v2 = tmp_path / "v2"
    _write(v2, {"cgroup.controllers": "cpu memory", "memory.max": "max", "cpu.max": "max 100000"})
    assert memory_headroom(v2, _self(tmp_path, "0::/\n")) is None and cpu_quota(v2, _self(tmp_path, "0::/\n")) is None
    assert memory_headroom(tmp_path / "absent", tmp_path / "absent_self") is None  # no cgroups at all


def test_usage_past_the_limit_leaves_no_headroom(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root, {"cgroup.controllers": "memory", "memory.max": str(GIB), "memory.current": str(2 * GIB)})
    assert memory_headroom(root, _self(tmp_path, "0::/\n")) == 0


def test_the_cpu_kv_pools_and_the_cpu_count_follow_the_container(monkeypatch) -> None:
    from loom_proto import cgroup
    from loom_shard.runtime import kv_cache

    monkeypatch.setattr(kv_cache, "memory_headroom", lambda: GIB)
    assert kv_cache.available_ram_bytes() == GIB  # not the node's MemAvailable
    monkeypatch.setattr(kv_cache, "memory_headroom", lambda: None)
    assert kv_cache.available_ram_bytes() > 0
    monkeypatch.setattr(cgroup, "usable_cpus", lambda affinity: min(affinity, 1))
    assert cgroup.available_cpus() == 1  # the launcher's threads and the router's frontends count these
