"""`loom-launcher`: parse flags (or LOOM_* environment variables), build every config once,
then start the shards and the router and supervise them (see supervisor.py).

This is the one place in Loom that reads os.environ.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from loom.launcher.supervisor import ProcessSpec, install_signal_handlers, serve
from loom.router.config import RouterConfig
from loom.shard.config import DTYPES, ShardConfig

ENV_PREFIX = "LOOM_"
SHARD_READY_MARKER = "loom-shard ready"
SHARD_MODULE = "loom.shard.server"
ROUTER_MODULE = "loom.router.main"
ROUTER_EXIT_MARGIN_S = 10.0
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 2048


@dataclass(slots=True, frozen=True)
class Flag:
    name: str  # snake_case; the flag is --kebab-case, the variable LOOM_UPPER_SNAKE
    type: Callable[[str], object]
    default: object
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("model_id", str, "", "GGUF file or Hugging Face folder; empty: the embedded SmolLM2-135M"),
    Flag("num_shard", int, 1, "tensor-parallel shards (processes)"),
    Flag("hostname", str, "0.0.0.0", "address the HTTP server binds"),
    Flag("port", int, 3000, "HTTP port"),
    Flag("max_concurrent_requests", int, 128, "requests in flight before 429"),
    Flag("max_input_tokens", int, None, "longest prompt; default: max-total-tokens - 1"),
    Flag("max_total_tokens", int, None, "prompt + generated tokens per request; "
         "default: the model's context length"),
    Flag("max_batch_prefill_tokens", int, None, "prompt tokens computed in one step; default: "
         f"{DEFAULT_MAX_BATCH_PREFILL_TOKENS}, or max-batch-total-tokens when smaller"),
    Flag("max_batch_total_tokens", int, None, "KV cache size in tokens, shared by all requests; "
         "default: sized from free memory at warmup"),
    Flag("max_stop_sequences", int, 4, "stop sequences per request"),
    Flag("max_n", int, 16, "completions per request (n / best_of)"),
    Flag("max_top_n_tokens", int, 5, "alternatives per token (top_n_tokens / top_logprobs)"),
    Flag("served_model_name", str, None, "model name in OpenAI responses; "
         "default: derived from model-id"),
    Flag("dtype", str, None, "weights and activations dtype; default: fastest that passes "
         "parity on the device", choices=DTYPES),
    Flag("device", str, "auto", "auto: cuda when available, else cpu",
         choices=("auto", "cpu", "cuda")),
    Flag("block_size", int, 16, "tokens per KV cache block"),
    Flag("memory_fraction", float, 0.9, "share of free GPU memory the KV cache may take"),
    Flag("cpu_kv_cache_bytes", int, None, "KV cache size on CPU when max-batch-total-tokens "
         "is unset; default: a share of free RAM"),
    Flag("host_kv_cache_bytes", int, None, "host-RAM pool for preempted requests' KV; "
         "default: a share of free RAM"),
    Flag("snapshot_dir", str, None, "folder for KV snapshots; unset: snapshots off"),
    Flag("shard_uds_path", str, "/tmp/loom-server", "unix socket prefix; rank r serves on <path>-<r>"),
    Flag("master_addr", str, "127.0.0.1", "torch.distributed rendezvous address"),
    Flag("master_port", int, 29500, "torch.distributed rendezvous port"),
    Flag("num_threads", int, None, "torch threads per shard; default: cores / num-shard"),
    Flag("startup_timeout", float, 600.0, "seconds to wait for shards and router to be ready"),
    Flag("shutdown_timeout", float, 30.0, "seconds the router may take to drain on SIGTERM"),
)


@dataclass(slots=True, frozen=True)
class LauncherConfig:
    shards: tuple[ShardConfig, ...]  # one per rank
    router: RouterConfig
    num_threads: int  # torch / OpenMP threads per shard
    startup_timeout: float
    shutdown_timeout: float

    def __post_init__(self) -> None:
        if self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be positive, got {self.startup_timeout}")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """Every flag's default comes from its LOOM_* variable when set (argparse converts it)."""
    parser = argparse.ArgumentParser(
        prog="loom-launcher", description="Start Loom's shards and router and supervise them. "
        "Every flag can also be set as LOOM_<FLAG_IN_UPPER_SNAKE_CASE>.")
    for flag in FLAGS:
        default = environ.get(flag.env_var, flag.default)
        parser.add_argument(flag.option, type=flag.type, default=default, choices=flag.choices,
                            help=f"{flag.help} [env {flag.env_var}; default {flag.default!r}]")
    return parser


def detect_device() -> str:
    import torch  # only when --device auto: a plain CPU run never pays for the import

    return "cuda" if torch.cuda.is_available() else "cpu"


def shard_socket_path(prefix: str, rank: int) -> str:
    return f"{prefix}-{rank}"


def resolve_prefill_tokens(prefill_tokens: int | None, total_tokens: int | None) -> int:
    """A prefill step's tokens must all fit in the KV cache at once: the default shrinks to
    a small cache, an explicit value that cannot fit is an error (as in TGI)."""
    if prefill_tokens is None:
        return min(DEFAULT_MAX_BATCH_PREFILL_TOKENS, total_tokens or DEFAULT_MAX_BATCH_PREFILL_TOKENS)
    if total_tokens is not None and prefill_tokens > total_tokens:
        raise ValueError(f"max_batch_prefill_tokens ({prefill_tokens}) must not exceed "
                         f"max_batch_total_tokens ({total_tokens})")
    return prefill_tokens


def flag_values(config_type: type, args: argparse.Namespace) -> dict[str, object]:
    """The parsed flags named like the config's fields; fields without a flag keep defaults."""
    names = {f.name for f in dataclasses.fields(config_type)} & set(vars(args))
    return {name: getattr(args, name) for name in names}


def build_config(args: argparse.Namespace, num_cpus: int,
                 detect: Callable[[], str] = detect_device) -> LauncherConfig:
    """Raises ValueError on an invalid combination (the configs validate themselves)."""
    if args.num_shard <= 0:
        raise ValueError(f"num_shard must be positive, got {args.num_shard}")
    prefill_tokens = resolve_prefill_tokens(args.max_batch_prefill_tokens,
                                            args.max_batch_total_tokens)
    device = detect() if args.device == "auto" else args.device
    socket_paths = tuple(shard_socket_path(args.shard_uds_path, rank)
                         for rank in range(args.num_shard))
    shards = tuple(
        ShardConfig(**{**flag_values(ShardConfig, args), "uds_path": path, "rank": rank,
                       "world_size": args.num_shard, "device": device})
        for rank, path in enumerate(socket_paths))
    router = RouterConfig(**{**flag_values(RouterConfig, args), "shard_uds_paths": socket_paths,
                             "max_batch_prefill_tokens": prefill_tokens})
    num_threads = (max(1, num_cpus // args.num_shard) if args.num_threads is None
                   else args.num_threads)
    return LauncherConfig(shards=shards, router=router, num_threads=num_threads,
                          startup_timeout=args.startup_timeout,
                          shutdown_timeout=args.shutdown_timeout)


def config_flags(config: object, names: Sequence[str]) -> list[str]:
    """`--kebab-case value` for each named field; None is left out, a tuple repeats the flag."""
    flags: list[str] = []
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        option = "--" + name.removesuffix("s").replace("_", "-") if isinstance(value, tuple) \
            else "--" + name.replace("_", "-")
        for item in value if isinstance(value, tuple) else (value,):
            flags += [option, str(item)]
    return flags


def shard_spec(config: ShardConfig, env: Mapping[str, str]) -> ProcessSpec:
    names = [f.name for f in dataclasses.fields(ShardConfig)]
    argv = (sys.executable, "-m", SHARD_MODULE, *config_flags(config, names))
    return ProcessSpec(f"shard {config.rank}", argv, env, ready_marker=SHARD_READY_MARKER)


def router_spec(config: RouterConfig, env: Mapping[str, str],
                shutdown_timeout: float) -> ProcessSpec:
    names = [f.name for f in dataclasses.fields(RouterConfig)]
    argv = (sys.executable, "-m", ROUTER_MODULE, *config_flags(config, names),
            "--shutdown-timeout", str(shutdown_timeout))
    return ProcessSpec("router", argv, env)


def child_env(environ: Mapping[str, str], num_threads: int) -> dict[str, str]:
    # Unbuffered output so readiness lines and errors reach the launcher at once.
    return {**environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(num_threads),
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
    environ = dict(os.environ)
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        config = build_config(args, available_cpus())
    except ValueError as error:
        parser.error(str(error))
    env = child_env(environ, config.num_threads)
    stop = threading.Event()
    install_signal_handlers(stop)
    # The router drains within its own timeout; the margin lets it exit before a SIGKILL.
    return serve(shards=[shard_spec(shard, env) for shard in config.shards],
                 router=router_spec(config.router, env, config.shutdown_timeout),
                 health_url=health_url(config.router), startup_timeout=config.startup_timeout,
                 shutdown_timeout=config.shutdown_timeout + ROUTER_EXIT_MARGIN_S, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
