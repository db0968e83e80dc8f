"""`loom-launcher`: read the flags (or LOOM_* environment variables) into the one settings
model, derive each process's config from it, then start the shards and the router and
supervise them (see supervisor.py). Each child gets its config as JSON, not as flags.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from collections.abc import Mapping, Sequence

from pydantic import SecretStr

from loom_launcher.supervisor import ProcessSpec, install_signal_handlers, json_log_to_stderr, log_to_stderr, serve
from loom_proto.cgroup import available_cpus
from loom_proto.config import (
    SECRET_FIELDS,
    LauncherSettings,
    RouterConfig,
    ShardConfig,
    env_var,
    parse_config,
    public_json,
    secrets_json,
)
from loom_proto.http_socket import check_http_port
from loom_proto.step_channel import SOCKET_SUFFIX, refuse_live_socket

SHARD_READY_MARKER = "loom-shard ready"
SHARD_MODULE = "loom_shard.server"
ROUTER_MODULE = "loom_router.main"
ROUTER_EXIT_MARGIN_S = 10.0
# glibc's malloc asks for transparent huge pages (madvise) for what it maps: the shard's weights,
# KV cache and activations then cost one TLB entry per 2 MiB instead of per 4 KiB. Decode reads
# all of them every step, and a TLB miss under a VM's nested paging is dear (bench/BENCHMARKS.md).
# glibc before 2.35, other C libraries and THP set to "never" ignore it.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
DESCRIPTION = ("Start Loom's shards and router and supervise them. "
               "Every flag can also be set as LOOM_<FLAG_IN_UPPER_SNAKE_CASE>.")


def load_settings(argv: Sequence[str] | None) -> LauncherSettings:
    """Flags over LOOM_* variables over defaults; exits with status 2 on invalid values."""
    return parse_config(LauncherSettings, argv, "loom-launcher", DESCRIPTION)


def child_argv(module: str, config: ShardConfig | RouterConfig) -> tuple[tuple[str, ...], str | None]:
    """A child's argv and what goes to its stdin: the argv holds no secret (any user may read a
    command line), the API keys and the shard secret go to its stdin."""
    argv = (sys.executable, "-m", module, "--config-json", public_json(config))
    hidden = secrets_json(config)
    if hidden is None:
        return argv, None
    return (*argv, "--secrets-on-stdin"), hidden + "\n"


def shard_spec(config: ShardConfig, env: Mapping[str, str]) -> ProcessSpec:
    argv, stdin_text = child_argv(SHARD_MODULE, config)
    return ProcessSpec(f"shard {config.rank}", argv, env, ready_marker=SHARD_READY_MARKER, stdin_text=stdin_text)


def router_spec(config: RouterConfig, env: Mapping[str, str]) -> ProcessSpec:
    argv, stdin_text = child_argv(ROUTER_MODULE, config)
    return ProcessSpec("router", argv, env, stdin_text=stdin_text)


def with_shard_secret(settings: LauncherSettings) -> LauncherSettings:
    """Shards on TCP started here with their router: a fresh secret unless the operator gave one
    (nodes of a multi-node deployment must share the operator's)."""
    if settings.shard_port is None or settings.role != "all" or settings.resolved_shard_secret() is not None:
        return settings
    return settings.model_copy(update={"shard_secret": SecretStr(secrets.token_urlsafe(32))})


def threads_per_shard(settings: LauncherSettings, num_cpus: int) -> int:
    if settings.num_threads is not None:
        return settings.num_threads
    return max(1, num_cpus // settings.shards_per_node)


def child_env(environ: Mapping[str, str], num_threads: int) -> dict[str, str]:
    # Unbuffered output so readiness lines and errors reach the launcher at once. The
    # secrets' variables stay here: the router gets the keys on stdin, the shards not at all.
    secret_vars = {env_var(name) for name in SECRET_FIELDS}
    kept = {name: value for name, value in environ.items() if name not in secret_vars}
    return {**kept, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(num_threads),
            "MKL_NUM_THREADS": str(num_threads), "GLIBC_TUNABLES": with_huge_pages(kept.get("GLIBC_TUNABLES", ""))}


def with_huge_pages(tunables: str) -> str:
    """GLIBC_TUNABLES with malloc on transparent huge pages, unless the operator chose otherwise."""
    if HUGE_PAGES_TUNABLE in tunables:
        return tunables
    return ":".join(filter(None, [tunables, f"{HUGE_PAGES_TUNABLE}=1"]))


def health_url(config: RouterConfig) -> str:
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(config.hostname,
                                                                         config.hostname)
    return f"http://{host}:{config.port}/health"


def check_shard_sockets(settings: LauncherSettings) -> None:
    """The unix sockets the shards started here will serve on must not be another server's
    (a second launcher on this host needs its own --shard-uds-path). Raises OSError."""
    if settings.role == "router" or settings.shard_port is not None or settings.placement == "ray":
        return
    for path in settings.socket_paths():
        for socket_path in (path, path + SOCKET_SUFFIX):
            try:
                refuse_live_socket(socket_path)
            except OSError:
                raise OSError(f"another server's shard serves on {socket_path}: give this one its own "
                              f"--shard-uds-path (now {settings.shard_uds_path})") from None


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    try:
        settings = with_shard_secret(settings)
    except ValueError as error:  # an unreadable --shard-secret-file
        print(f"loom-launcher: error: {error}", file=sys.stderr)
        return 2
    router = None if settings.role == "shards" else settings.router_config()
    try:  # before minutes of loading a model
        if router is not None:
            check_http_port(router.hostname, router.port)
        check_shard_sockets(settings)
    except OSError as error:
        print(f"loom-launcher: error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    log = json_log_to_stderr if settings.json_output else log_to_stderr
    install_signal_handlers(stop, log)
    if settings.placement == "ray":
        from loom_launcher.ray_placement import serve_on_ray  # the ray extra: imported only here

        return serve_on_ray(settings, stop, log)
    env = child_env(os.environ, threads_per_shard(settings, available_cpus()))
    shards = [] if settings.role == "router" else [shard_spec(settings.shard_config(rank), env)
                                                   for rank in settings.local_ranks()]
    # The router drains within its own timeout; the margin lets it exit before a SIGKILL.
    return serve(shards=shards, router=None if router is None else router_spec(router, env),
                 health_url=None if router is None else health_url(router),
                 startup_timeout=settings.startup_timeout,
                 shutdown_timeout=settings.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S, stop=stop, log=log)


if __name__ == "__main__":
    sys.exit(main())
