"""`loom-launcher --placement ray`: the shards as Ray actors in one placement group on a Ray
cluster (one bundle per rank: a GPU where the shards use CUDA, CPUs otherwise), the router here,
on the node the operator runs the launcher on, driving them over TCP with a fresh shard secret.

Ray places and starts; the launcher supervises as it does locally: when a shard, its actor or
the router dies, everything is torn down (router, actors, placement group) and it exits non-zero.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from loom_launcher.cli import ROUTER_EXIT_MARGIN_S, child_env, health_url, router_spec
from loom_launcher.ray_shard import ShardHost
from loom_launcher.supervisor import (
    POLL_INTERVAL_S,
    ChildExited,
    ExitStatus,
    Log,
    StartupTimeout,
    StopRequested,
    Supervisor,
    how_it_ended,
    http_ok,
    log_to_stderr,
)
from loom_proto.config import LauncherSettings, public_json, secrets_json

SHARD_STOP_TIMEOUT_S = 10.0
ACTOR_POLL_TIMEOUT_S = 10.0


class ShardDied(Exception):
    pass


@dataclass(slots=True)
class RayShards:
    """The placement group and one actor per rank, in rank order (filled in as they come)."""

    placement_group: Any
    actors: list[Any] = field(default_factory=list)
    # per rank: (node id, IP, its gRPC port, a spare port: rank 0's is the rendezvous)
    nodes: list[tuple[str, str, int, int]] = field(default_factory=list)


def uses_gpus(settings: LauncherSettings, cluster_gpus: float) -> bool:
    if settings.device == "auto":
        return cluster_gpus >= settings.num_shard
    return settings.device == "cuda"


def bundle(settings: LauncherSettings, gpus: bool) -> dict[str, float]:
    """One rank's resources: a GPU (and a CPU to drive it), or the CPU threads it computes with."""
    if gpus:
        return {"GPU": 1.0, "CPU": 1.0}
    return {"CPU": float(settings.num_threads or 1)}


def reserve(settings: LauncherSettings, log: Log) -> RayShards:
    """Asks for a placement group of one bundle per rank."""
    import ray
    from ray.util.placement_group import placement_group

    gpus = uses_gpus(settings, ray.cluster_resources().get("GPU", 0.0))
    bundles = [bundle(settings, gpus) for _ in range(settings.num_shard)]
    log(f"[launcher] asking Ray for a placement group of {len(bundles)} bundle(s) {bundles[0]} "
        f"({settings.ray_placement_strategy})")
    # A name of its own: several Loom deployments may share one cluster.
    name = f"loom-shards-{secrets.token_hex(4)}"
    return RayShards(placement_group(bundles, strategy=settings.ray_placement_strategy, name=name))


def place(settings: LauncherSettings, shards: RayShards, log: Log) -> None:
    """Once the group is placed: one ShardHost actor in each bundle, and where each landed."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = shards.placement_group
    ray.get(group.ready(), timeout=settings.startup_timeout)
    actor_class = ray.remote(ShardHost)
    for rank, resources in enumerate(group.bundle_specs):
        shards.actors.append(actor_class.options(  # type: ignore[attr-defined]
            num_cpus=resources.get("CPU", 0.0), num_gpus=resources.get("GPU", 0.0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(rank))
    shards.nodes = ray.get([actor.node.remote() for actor in shards.actors], timeout=settings.startup_timeout)
    for rank, (node_id, ip, _, _) in enumerate(shards.nodes):
        log(f"[launcher] rank {rank} placed on node {node_id} ({ip})")


def start_shards(settings: LauncherSettings, shards: RayShards, log: Log) -> list[str]:
    """Starts every rank's shard (rendezvous at rank 0's node); returns their TCP addresses."""
    import ray

    _, master_ip, _, master_port = shards.nodes[0]
    ranked = settings.model_copy(update={"master_addr": master_ip, "master_port": master_port})
    addresses: list[str] = []
    starts = []
    threads = settings.num_threads or 1
    for rank, (actor, (_, ip, port, _)) in enumerate(zip(shards.actors, shards.nodes, strict=True)):
        address = f"{ip}:{port}"
        # One rank per actor: its GPU (if any) is the only one Ray makes visible to it.
        config = ranked.shard_config(rank, tcp_address=address).model_copy(update={"local_rank": 0})
        env = child_env({}, threads)
        starts.append(actor.start.remote(public_json(config), secrets_json(config), env))
        addresses.append(address)
    ray.get(starts, timeout=settings.startup_timeout)
    ready = ray.get([actor.wait_ready.remote(settings.startup_timeout) for actor in shards.actors])
    for rank, ok in enumerate(ready):
        if not ok:
            lines = "\n".join(f"  {line}" for line in ray.get(shards.actors[rank].last_lines.remote()))
            raise ShardDied(f"shard {rank} did not become ready; its last lines:\n{lines}")
    log(f"[launcher] {len(addresses)} shard(s) ready on Ray at {', '.join(addresses)}")
    return addresses


def check_shards(shards: RayShards) -> None:
    """Raises ShardDied when a shard exited or its actor (or node) is gone."""
    import ray

    try:
        codes = ray.get([actor.returncode.remote() for actor in shards.actors], timeout=ACTOR_POLL_TIMEOUT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
        raise ShardDied(f"a shard's Ray actor is gone or unresponsive: {type(error).__name__}: {error}") from None
    for rank, code in enumerate(codes):
        if code is not None:
            lines = "\n".join(f"  {line}" for line in ray.get(shards.actors[rank].last_lines.remote()))
            raise ShardDied(f"shard {rank} {how_it_ended(code)}; its last lines:\n{lines}")


def tear_down(shards: RayShards | None, log: Log) -> None:
    """Stops every shard, kills the actors and removes the placement group, whatever state they are in."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if shards is None:
        return
    stops = [actor.stop.remote(SHARD_STOP_TIMEOUT_S) for actor in shards.actors]
    for rank, stop in enumerate(stops):
        try:
            code = ray.get(stop, timeout=SHARD_STOP_TIMEOUT_S + 5)
            log(f"[launcher] shard {rank} {'was not started' if code is None else how_it_ended(code)}")
        except Exception as error:  # a dead actor or node: nothing left to stop there
            log(f"[launcher] shard {rank}: {type(error).__name__}")
    for actor in shards.actors:
        ray.kill(actor)
    remove_placement_group(shards.placement_group)
    log("[launcher] Ray actors and placement group removed")


def supervise(settings: LauncherSettings, shards: RayShards, addresses: Sequence[str],
              supervisor: Supervisor, log: Log) -> None:
    """Starts the router here and watches it and the shards until stop or a death."""
    router = settings.router_config(tuple(addresses))
    env = child_env(os.environ, settings.num_threads or 1)
    supervisor.spawn(router_spec(router, env))
    url = health_url(router)
    deadline = time.monotonic() + settings.startup_timeout
    supervisor.wait_ready([], deadline, f"router at {url}", is_ready=lambda: http_ok(url))
    log(f"[launcher] Loom is serving on Ray; health at {url}")
    next_check = 0.0
    while True:
        supervisor.check()
        if time.monotonic() >= next_check:
            check_shards(shards)
            next_check = time.monotonic() + 1.0
        supervisor.stop.wait(POLL_INTERVAL_S)


MISSING_RAY_STATUS = 2  # as a usage error


def serve_on_ray(settings: LauncherSettings, stop: threading.Event, log: Log = log_to_stderr) -> int:
    try:
        import ray
    except ImportError:
        log("[launcher] error: --placement ray needs Ray: pip install 'loom-launcher[ray]'")
        return MISSING_RAY_STATUS

    try:
        secret = settings.resolved_shard_secret() or secrets.token_urlsafe(32)
    except ValueError as error:  # an unreadable --shard-secret-file
        log(f"[launcher] error: {error}")
        return int(ExitStatus.CHILD_FAILED)
    # The secret itself travels to the actors (a secret file on this node is not on theirs).
    settings = settings.model_copy(update={"shard_secret": SecretStr(secret), "shard_secret_file": None})
    ray.init(address=settings.ray_address, log_to_driver=True, namespace="loom")
    supervisor = Supervisor(stop, log)
    shards: RayShards | None = None
    status = ExitStatus.OK
    try:
        shards = reserve(settings, log)
        place(settings, shards, log)
        addresses = start_shards(settings, shards, log)
        supervise(settings, shards, addresses, supervisor, log)
    except StopRequested:
        pass
    except ChildExited as died:
        log(f"[launcher] error: {died}; its last lines:\n{died.child.last_output()}")
        status = ExitStatus.CHILD_FAILED
    except ShardDied as died:
        log(f"[launcher] error: {died}")
        status = ExitStatus.CHILD_FAILED
    except (StartupTimeout, ray.exceptions.GetTimeoutError) as timeout:
        log(f"[launcher] error: {timeout}; raise --startup-timeout, or check that the cluster has the "
            "resources the placement group asks for")
        status = ExitStatus.STARTUP_TIMEOUT
    finally:  # also on an unexpected error: never leave actors or a placement group behind
        supervisor.terminate(supervisor.children, settings.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S)
        tear_down(shards, log)
        ray.shutdown()
    return int(status)
