"""`loom-launcher`: read the flags (or LOOM_* environment variables) into the one settings
model, derive each process's config from it, then start the shards and the router and
supervise them (see supervisor.py). Each child gets its config as JSON, not as flags.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence

from loom_launcher.supervisor import ProcessSpec, install_signal_handlers, serve
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

SHARD_READY_MARKER = "loom-shard ready"
SHARD_MODULE = "loom_shard.server"
ROUTER_MODULE = "loom_router.main"
ROUTER_EXIT_MARGIN_S = 10.0
DESCRIPTION = ("Start Loom's shards and router and supervise them. "
               "Every flag can also be set as LOOM_<FLAG_IN_UPPER_SNAKE_CASE>.")


def load_settings(argv: Sequence[str] | None) -> LauncherSettings:
    """Flags over LOOM_* variables over defaults; exits with status 2 on invalid values."""
    return parse_config(LauncherSettings, argv, "loom-launcher", DESCRIPTION)


def shard_spec(config: ShardConfig, env: Mapping[str, str]) -> ProcessSpec:
    argv = (sys.executable, "-m", SHARD_MODULE, "--config-json", public_json(config))
    return ProcessSpec(f"shard {config.rank}", argv, env, ready_marker=SHARD_READY_MARKER)


def router_spec(config: RouterConfig, env: Mapping[str, str]) -> ProcessSpec:
    """The router's argv holds no secret (any user may read a command line): the API keys
    go to its stdin."""
    argv = (sys.executable, "-m", ROUTER_MODULE, "--config-json", public_json(config))
    secrets = secrets_json(config)
    if secrets is None:
        return ProcessSpec("router", argv, env)
    return ProcessSpec("router", (*argv, "--secrets-on-stdin"), env, stdin_text=secrets + "\n")


def threads_per_shard(settings: LauncherSettings, num_cpus: int) -> int:
    if settings.num_threads is not None:
        return settings.num_threads
    return max(1, num_cpus // settings.num_shard)


def child_env(environ: Mapping[str, str], num_threads: int) -> dict[str, str]:
    # Unbuffered output so readiness lines and errors reach the launcher at once. The
    # secrets' variables stay here: the router gets the keys on stdin, the shards not at all.
    secret_vars = {env_var(name) for name in SECRET_FIELDS}
    kept = {name: value for name, value in environ.items() if name not in secret_vars}
    return {**kept, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(num_threads),
            "MKL_NUM_THREADS": str(num_threads)}


def health_url(config: RouterConfig) -> str:
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(config.hostname,
                                                                         config.hostname)
    return f"http://{host}:{config.port}/health"


def available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    env = child_env(os.environ, threads_per_shard(settings, available_cpus()))
    router = settings.router_config()
    stop = threading.Event()
    install_signal_handlers(stop)
    # The router drains within its own timeout; the margin lets it exit before a SIGKILL.
    return serve(shards=[shard_spec(settings.shard_config(rank), env) for rank in range(settings.num_shard)],
                 router=router_spec(router, env), health_url=health_url(router),
                 startup_timeout=settings.startup_timeout,
                 shutdown_timeout=settings.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
