"""What this process's control groups allow it (Linux, cgroup v1 and v2): a container's memory
limit and CPU quota. /proc/meminfo and the CPU affinity mask show the whole node: a pod limited
to 8 GiB and 4 CPUs on a 256 GiB, 64-core node sees 256 GiB and 64 CPUs there, and a KV pool
or a thread count sized from those is killed or starved.

Each level from the process's group up to the root of its hierarchy may set a limit; the
tightest counts. Without a cgroup filesystem (not Linux, a bare host) there is no limit (None).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
NO_LIMIT_V1 = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def memory_headroom(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Bytes the process's cgroups still allow it: the tightest limit less that group's usage,
    page cache it may drop (inactive files) not counted as used; None where nothing limits it."""
    headrooms = [_memory_headroom(group, v2) for group, v2 in _groups(root, self_cgroup, "memory")]
    limited = [h for h in headrooms if h is not None]
    return max(0, min(limited)) if limited else None


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """CPUs the tightest CFS quota of the process's cgroups allows (quota / period); None without one."""
    quotas = [q for group, v2 in _groups(root, self_cgroup, "cpu") if (q := _cpu_quota(group, v2)) is not None]
    return min(quotas) if quotas else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by a container's CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        return usable_cpus(len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def usable_cpus(affinity: int, root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs a process can keep busy: its affinity mask, capped by its cgroups' quota."""
    quota = cpu_quota(root, self_cgroup)
    return max(1, min(affinity, math.ceil(quota))) if quota is not None else affinity


def _groups(root: Path, self_cgroup: Path, controller: str) -> Iterator[tuple[Path, bool]]:
    """(folder, is v2) of each level holding the controller, from the process's group to the
    hierarchy's root (a container's own filesystem shows its group at the root)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return
    unified = (root / "cgroup.controllers").exists()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if unified and controllers == "":
            yield from _levels(root, path, True)
        elif not unified and controller in controllers.split(","):
            yield from _levels(root / controller, path, False)


def _levels(base: Path, path: str, v2: bool) -> Iterator[tuple[Path, bool]]:
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = base.joinpath(*parts[:depth])
        if folder.is_dir():
            yield folder, v2


def _memory_headroom(group: Path, v2: bool) -> int | None:
    limit = _read_int(group / ("memory.max" if v2 else "memory.limit_in_bytes"))
    if limit is None or limit >= NO_LIMIT_V1:
        return None
    usage = _read_int(group / ("memory.current" if v2 else "memory.usage_in_bytes")) or 0
    reclaimable = _stat(group / "memory.stat", "inactive_file" if v2 else "total_inactive_file")
    return limit - max(0, usage - reclaimable)


def _cpu_quota(group: Path, v2: bool) -> float | None:
    if v2:
        try:
            quota_text, period_text = (group / "cpu.max").read_text().split()
        except (OSError, ValueError):
            return None
        quota, period = _int(quota_text), _int(period_text)
    else:
        quota, period = _read_int(group / "cpu.cfs_quota_us"), _read_int(group / "cpu.cfs_period_us")
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return quota / period


def _read_int(path: Path) -> int | None:
    try:
        return _int(path.read_text().strip())
    except OSError:
        return None


def _int(text: str) -> int | None:
    """An integer, or None for "max" (v2's no limit) or anything else."""
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
