"""Loom's one configuration model: every flag defined once (name, type, default, help), its
environment variable `LOOM_<NAME>` read by pydantic-settings in the launcher only, validated
once, and handed to each process as JSON (`--config-json`), never re-parsed from a rebuilt argv.

    ModelFlags              what shards and router both need (model, KV budget, snapshots)
    ├── ShardFlags          -> ShardConfig  (+ socket, rank, world size: set per rank)
    └── RouterFlags         -> RouterConfig (+ the shards' sockets)
    LauncherSettings = ShardFlags + RouterFlags + the launcher's own flags, from argv and env
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "LOOM_"
# Prompt tokens one step computes by default: on a GPU 2048 take milliseconds; on a CPU (about a
# millisecond per token on two cores) 512 keep every running stream's next token and a new
# request's first one within one short step (bench/BENCHMARKS.md, CPUs).
DEFAULT_MAX_BATCH_PREFILL_TOKENS = {"cuda": 2048, "cpu": 512}
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
Positive = Annotated[int, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # JSON, which hands configs on, has no inf
# A list flag also read from one environment variable as comma-separated values.
StrList = Annotated[tuple[str, ...], NoDecode]
SecretList = Annotated[tuple[SecretStr, ...], NoDecode]
# Never on a command line (`ps` shows it to every user): the launcher hands these on stdin.
SECRET_FIELDS = frozenset({"api_key", "shard_secret"})
DEFAULT_PAYLOAD_LIMIT = 2_000_000  # bytes, as TGI


def read_api_key_file(path: str) -> list[str]:
    """The keys of an --api-key-file: one per line, blank lines and # comments skipped. Raises
    ValueError for a file that cannot be read or holds no key (it would leave every route open)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"--api-key-file {path} cannot be read: {error.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no API key")
    return keys


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelFlags(Frozen):
    model_id: str = Field("", description="GGUF file or Hugging Face folder; empty: the embedded SmolLM2-135M")
    max_batch_total_tokens: Positive | None = Field(
        None, description="KV cache size in tokens, shared by all requests; default: sized from free memory at warmup")
    snapshot_dir: str | None = Field(None, description="folder for KV snapshots; unset: snapshots off")
    otlp_endpoint: str | None = Field(None, description="OpenTelemetry collector (OTLP/HTTP, e.g. "
                                      "http://collector:4318): spans per request and per step, router and "
                                      "shards; needs the SDK installed (the otel extras)")
    shard_secret: SecretStr | None = Field(
        None, description="shared secret the router presents to every shard and a shard demands of every "
        "call (required for shards on TCP); env or --shard-secret-file, never on a command line")
    shard_secret_file: str | None = Field(None, description="file holding the shard secret (its first line)")

    @field_validator("shard_secret")
    @classmethod
    def _no_blank_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and not secret.get_secret_value().strip():
            raise ValueError("a blank shard secret (from an empty or unset variable?) is refused")
        return secret

    def resolved_shard_secret(self) -> str | None:
        """The secret from the flag or the environment, else the file's first line; None: no secret."""
        if self.shard_secret is not None:
            return self.shard_secret.get_secret_value()
        if self.shard_secret_file is None:
            return None
        return read_secret_file(self.shard_secret_file)

    enable_lora: bool = Field(False, description="serve LoRA adapters (on when --lora-adapter is given): "
                              "--lora-adapter at start, /v1/load_lora_adapter while serving")
    lora_adapter: StrList = Field((), description="NAME=PATH of a PEFT LoRA folder loaded at start (repeat the "
                                  "flag; env: comma-separated)")
    max_lora_rank: Positive = Field(16, description="highest LoRA rank an adapter may have")
    max_loras_per_batch: Positive = Field(4, description="distinct adapters in one step, and adapters resident "
                                          "on the device (the rest wait in host memory, least recently used "
                                          "evicted first)")
    task: Literal["generate", "embed"] = Field(
        "generate", description="embed: serve /v1/embeddings (pooling from the folder's sentence-transformers "
        "config, else last token, normalized); a folder with that config serves embeddings either way")

    @field_validator("lora_adapter", mode="before")
    @classmethod
    def _split_adapters(cls, value: Any) -> Any:
        if isinstance(value, str):  # from an environment variable
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    @field_validator("lora_adapter")
    @classmethod
    def _name_equals_path(cls, adapters: tuple[str, ...]) -> tuple[str, ...]:
        for item in adapters:
            name, _, path = item.partition("=")
            if not name.strip() or not path.strip():
                raise ValueError(f"{item!r} must be NAME=PATH")
        return adapters

    @model_validator(mode="after")
    def _lora_on_with_adapters(self) -> ModelFlags:
        if self.lora_adapter and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        return self


class ShardFlags(ModelFlags):
    dtype: Dtype | None = Field(None, description="weights and activations dtype (float16: CUDA only); default: "
                                "bfloat16 (float32 on a CPU without native bfloat16 and --cpu-kernels off)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    quantize: Literal["auto", "none"] = Field(
        "auto", description="auto: a GGUF's Q4_1/Q8_0 weights stay quantized (CPU, one rank); "
        "none: dequantized to the dtype (the parity reference)")
    cpu_kernels: Literal["auto", "avx512", "avx2", "off"] = Field(
        "auto", description="Loom's C++ CPU kernels: auto picks the best build this CPU runs (AVX-512 VNNI, "
        "else AVX2); off: torch's paths (slower, bfloat16 linears not batch-invariant)")
    block_size: Positive = Field(16, description="tokens per KV cache block")
    memory_fraction: float = Field(0.9, gt=0, le=1, description="share of free GPU memory the KV cache may take")
    cuda_graphs: bool = Field(True, description="replay steps as CUDA graphs captured at warmup "
                              "(CUDA with triton only)")
    launch_ahead: bool | None = Field(
        None, description="launch a step while the one before it still computes on the device, its decodes "
        "reading that step's tokens there (same tokens); default: on CUDA (the host prepares the next step "
        "while the GPU computes), off on CPU (where launching a step computes it)")
    cpu_kv_cache_bytes: Positive | None = Field(
        None, description="KV cache size on CPU when max-batch-total-tokens is unset; default: a share of free RAM")
    host_kv_cache_bytes: int | None = Field(
        None, ge=0, description="host-RAM pool for preempted requests' KV; default: a share of free RAM")
    master_addr: str = Field("127.0.0.1", description="torch.distributed rendezvous address")
    master_port: int = Field(29500, gt=0, lt=65536, description="torch.distributed rendezvous port")


class ShardConfig(ShardFlags):
    """One shard process (one tensor-parallel rank), serving on a unix socket or on TCP."""

    uds_path: str | None = Field(None, description="unix socket this shard serves on")
    tcp_address: str | None = Field(None, description="host:port this shard serves on over TCP (needs the "
                                    "shard secret)")
    rank: int = Field(0, ge=0, description="tensor-parallel rank")
    local_rank: int | None = Field(None, ge=0, description="this rank's GPU index on its node; default: rank")
    world_size: Positive = Field(1, description="tensor-parallel ranks in all")

    @model_validator(mode="after")
    def _rank_in_world(self) -> ShardConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if (self.uds_path is None) == (self.tcp_address is None):
            raise ValueError("a shard serves on exactly one of uds_path and tcp_address")
        if self.tcp_address is not None:
            split_host_port(self.tcp_address)
            if self.shard_secret is None and self.shard_secret_file is None:
                raise ValueError("a shard on TCP needs the shard secret (LOOM_SHARD_SECRET or "
                                 "--shard-secret-file): its port must accept only its router")
        return self

    @property
    def gpu_index(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank


class RouterFlags(ModelFlags):
    hostname: str = Field("0.0.0.0", description="address the HTTP server binds")
    port: int = Field(3000, ge=0, lt=65536, description="HTTP port")
    max_concurrent_requests: Positive = Field(128, description="requests in flight before 429")
    max_input_tokens: Positive | None = Field(None, description="longest prompt; default: max-total-tokens - 1")
    max_total_tokens: Positive | None = Field(
        None, description="prompt + generated tokens per request; default: the model's context length")
    max_input_chars: Positive | None = Field(
        None, description="longest input in characters, refused (422) before tokenizing; "
        "default: 32 x max-input-tokens")
    max_batch_prefill_tokens: Positive | None = Field(
        None, description="prompt tokens computed in one step; default: "
        f"{DEFAULT_MAX_BATCH_PREFILL_TOKENS['cuda']} on CUDA shards, {DEFAULT_MAX_BATCH_PREFILL_TOKENS['cpu']} on CPU "
        "ones, or max-batch-total-tokens when smaller")
    max_stop_sequences: int = Field(4, ge=0, description="stop sequences per request")
    max_n: Positive = Field(16, description="completions per request (n / best_of)")
    max_top_n_tokens: int = Field(5, ge=0, description="alternatives per token (top_n_tokens / top_logprobs)")
    max_client_batch_size: Positive = Field(32, description="prompts in one /v1/completions request (`prompt` "
                                            "as a list), computed concurrently")
    served_model_name: str | None = Field(None, description="model name in OpenAI responses; "
                                          "default: derived from model-id")
    shard_ready_timeout: Seconds = Field(600.0, description="seconds the router waits for every shard's Health")
    graceful_termination_timeout: Seconds = Field(
        30.0, description="seconds in-flight requests may take to finish after SIGTERM; the rest then end "
        "with an error event")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="router log level")
    json_output: bool = Field(False, description="every log line (launcher, router, shards) one JSON object")
    prometheus_port: int | None = Field(None, ge=0, lt=65536, description="also serve /metrics on this port; "
                                        "unset: only on the HTTP port")
    api_key: SecretList = Field((), description="a client must send `Authorization: Bearer <key>` with one of "
                                "these keys (repeat the flag; env: comma-separated); /health and /ready stay open")
    api_key_file: str | None = Field(None, description="file of API keys, one per line, read by the router at start")
    metrics_require_api_key: bool = Field(False, description="true: /metrics asks for the API key too")
    payload_limit: Positive = Field(DEFAULT_PAYLOAD_LIMIT, description="largest request body in bytes (413 past it)")
    header_timeout: Seconds = Field(10.0, description="seconds a client may take to send a request's line and "
                                    "headers (from connecting, or from its first byte); past it the connection "
                                    "is closed (slow-loris)")
    body_timeout: Seconds = Field(60.0, description="seconds a client may take to send a request's body once "
                                  "its headers are in; past it the connection is closed")
    keep_alive_timeout: Seconds = Field(5.0, description="seconds an idle keep-alive connection stays open "
                                        "between requests")
    max_connections: Positive = Field(1024, description="open HTTP connections (or requests in progress) past "
                                      "which a new request gets 503 at once")
    cors_allow_origin: StrList = Field((), description="origins browsers may call from (repeat the flag; "
                                       "env: comma-separated); none: no CORS headers")
    snapshot_routes: bool = Field(True, description="false: no /snapshots routes even with --snapshot-dir")
    stream_buffer_events: Positive = Field(
        1024, description="events a stream may queue for a client that reads slowly; past it the request "
        "is cancelled")
    stream_interval: Positive = Field(
        1, description="tokens a stream collects before they are sent together (the first token and the "
        "last always go at once); 1: every token as it comes")
    api_workers: Positive | None = Field(
        None, description="frontend processes (HTTP, validation, tokenization, streaming) in front of the "
        "engine core; default: from the CPU cores (1 to 8)")
    overlap_steps: bool | None = Field(
        None, description="plan and send the next decode step while the shards compute the current one "
        "(one step of lookahead; same tokens); default: on where the shards run on CUDA (the router's "
        "work per step then hides behind the GPU's) and --speculate is 0, off on CPU (router and shard "
        "share the cores)")
    speculate: int = Field(0, ge=0, description="tokens drafted per decode step by prompt lookup (n-gram "
                           "speculative decoding, verified in the same step; same tokens); 0: off. Not combined "
                           "with an explicit --overlap-steps true (speculation then stays off)")
    speculate_ngram_max: Positive = Field(3, description="longest n-gram looked up for drafts (--speculate)")
    speculate_ngram_min: Positive = Field(1, description="shortest n-gram looked up for drafts (--speculate)")
    shard_addresses: StrList = Field((), description="host:port of a shard rank on TCP (repeat the flag, in rank "
                                     "order; env: comma-separated): drive shards on other hosts instead of "
                                     "starting them here")

    @field_validator("cors_allow_origin", "shard_addresses", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):  # from an environment variable
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    @field_validator("api_key_file")
    @classmethod
    def _key_file_holds_a_key(cls, path: str | None) -> str | None:
        """Read at start, so that a missing or keyless file stops the launcher before any model loads."""
        if path is not None:
            read_api_key_file(path)
        return path

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        # Blank items are kept, so that `LOOM_API_KEY=` or `k1,` is refused below, not read as "no key".
        return tuple(item.strip() for item in value.split(",")) if isinstance(value, str) else value

    @field_validator("api_key")
    @classmethod
    def _no_blank_key(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        """A blank key (an unset variable expanded into `--api-key ''`) would let an empty token in."""
        for key in keys:
            value = key.get_secret_value()
            if not value.strip():
                raise ValueError("a blank API key (from an empty or unset variable?) is refused: give a key, "
                                 "or leave --api-key out to serve without keys")
            if value != value.strip():
                raise ValueError("an API key must not begin or end with whitespace (a token never does)")
        return keys

    def prefill_budget(self, device: str) -> int:
        """--max-batch-prefill-tokens, or the default for shards on `device` ("cpu", "cuda:0"); a
        prefill step's tokens must all fit in the KV cache at once (as in TGI)."""
        if self.max_batch_prefill_tokens is not None:
            return self.max_batch_prefill_tokens
        default = DEFAULT_MAX_BATCH_PREFILL_TOKENS["cuda" if device.startswith("cuda") else "cpu"]
        return min(default, self.max_batch_total_tokens or default)

    @model_validator(mode="after")
    def _token_limits(self) -> RouterFlags:
        total, prefill = self.max_batch_total_tokens, self.max_batch_prefill_tokens
        if total is not None and prefill is not None and prefill > total:
            raise ValueError(f"max_batch_prefill_tokens ({self.max_batch_prefill_tokens}) must not exceed "
                             f"max_batch_total_tokens ({total})")
        if self.speculate_ngram_min > self.speculate_ngram_max:
            raise ValueError(f"speculate_ngram_min ({self.speculate_ngram_min}) must not exceed "
                             f"speculate_ngram_max ({self.speculate_ngram_max})")
        if (self.max_input_tokens is not None and self.max_total_tokens is not None
                and self.max_input_tokens >= self.max_total_tokens):
            raise ValueError(f"max_input_tokens ({self.max_input_tokens}) must be below "
                             f"max_total_tokens ({self.max_total_tokens})")
        if self.metrics_require_api_key and not (self.api_key or self.api_key_file):
            raise ValueError("metrics_require_api_key needs a key to require: give --api-key or --api-key-file")
        return self


class RouterConfig(RouterFlags):
    """The router: its engine core process (`loom-router`), which starts its frontends. Its shards
    are on unix sockets (`shard_uds_paths`) or on TCP (`shard_addresses`), in rank order."""

    shard_uds_paths: tuple[str, ...] = Field((), description="unix socket of a shard rank, once per rank in "
                                             "rank order")
    drives_shards: ClassVar[bool] = True  # the engine core does; its frontends never talk to a shard

    @model_validator(mode="after")
    def _one_kind_of_shard(self) -> RouterConfig:
        if not self.drives_shards:
            return self
        if bool(self.shard_uds_paths) == bool(self.shard_addresses):
            raise ValueError("give the shards' unix sockets (--shard-uds-path) or their TCP addresses "
                             "(--shard-address), one of the two")
        for address in self.shard_addresses:
            split_host_port(address)
        if self.shard_addresses and self.shard_secret is None and self.shard_secret_file is None:
            raise ValueError("shards on TCP need the shard secret (LOOM_SHARD_SECRET or --shard-secret-file)")
        return self

    def shard_targets(self) -> tuple[str, ...]:
        """The gRPC target of each rank, in rank order."""
        if self.shard_addresses:
            return self.shard_addresses
        return tuple(f"unix://{path}" for path in self.shard_uds_paths)


class FrontendConfig(RouterConfig):
    """One frontend process, started by the engine core with its own index and sockets. It knows
    nothing of the shards: neither where they are nor their secret."""

    drives_shards: ClassVar[bool] = False
    SHARD_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"shard_uds_paths", "shard_addresses", "shard_secret", "shard_secret_file"})

    frontend_index: int = Field(0, ge=0, description="this frontend's number (its socket's name)")
    ipc_folder: str = Field(description="the router's private folder of sockets (the engine core's and "
                            "the frontends')")
    listen_fd: int = Field(ge=0, description="the HTTP listening socket, bound by the engine core and inherited")
    metrics_folder: str | None = Field(None, description="prometheus_client's multiprocess folder")


class LauncherSettings(BaseSettings, ShardFlags, RouterFlags):
    """Every flag of `loom-launcher`; the values not given on the command line come from
    LOOM_* environment variables (this is the one place Loom reads os.environ)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    num_shard: Positive = Field(1, description="tensor-parallel shards (processes) in all, on every node")
    shard_uds_path: str = Field("/tmp/loom-server", description="unix socket prefix; rank r serves on <path>-<r>")
    num_threads: Positive | None = Field(None, description="torch threads per shard; default: cores / num-shard")
    startup_timeout: Seconds = Field(600.0, description="seconds to wait for shards and router to be ready")
    role: Literal["all", "shards", "router"] = Field(
        "all", description="all: shards and router here; shards: only this node's shards (--nnodes, --node-rank, "
        "TCP on --shard-port); router: only the router, driving the shards at --shard-address")
    nnodes: Positive = Field(1, description="nodes the shards are spread over (--role shards), num-shard / nnodes each")
    node_rank: int = Field(0, ge=0, description="this node's number, 0 to nnodes - 1: it runs ranks "
                           "node-rank x (num-shard / nnodes) onward")
    shard_host: str = Field("127.0.0.1", description="address shards on TCP bind (0.0.0.0: every interface)")
    shard_port: int | None = Field(None, gt=0, lt=65536, description="shards serve on TCP: rank r on shard-port + r "
                                   "(with the shard secret); unset: unix sockets")
    placement: Literal["local", "ray"] = Field("local", description="local: shards are processes on this host; ray: "
                                               "Ray actors in a placement group on a Ray cluster (the ray extra)")
    ray_address: str = Field("auto", description="the Ray cluster to join (--placement ray)")
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how the placement group's bundles (one per rank) land on nodes (--placement ray)")

    @model_validator(mode="after")
    def _topology(self) -> LauncherSettings:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} outside nnodes {self.nnodes}")
        if self.num_shard % self.nnodes:
            raise ValueError(f"num_shard ({self.num_shard}) must be a multiple of nnodes ({self.nnodes})")
        if self.role == "shards" and self.shard_port is None:
            raise ValueError("--role shards serves the shards on TCP: give --shard-port")
        if self.role == "router" and not self.shard_addresses:
            raise ValueError("--role router drives remote shards: give --shard-address once per rank")
        if self.role != "router" and self.shard_addresses:
            raise ValueError("--shard-address is for --role router (shards started elsewhere)")
        if self.role == "all" and self.nnodes > 1:
            raise ValueError("--nnodes > 1 needs --role shards on every node and --role router once "
                             "(or --placement ray)")
        if self.placement == "ray" and self.role != "all":
            raise ValueError("--placement ray starts every part itself: leave --role at all")
        return self

    @property
    def shards_per_node(self) -> int:
        return self.num_shard // self.nnodes

    def local_ranks(self) -> range:
        """The ranks this node starts."""
        first = self.node_rank * self.shards_per_node
        return range(first, first + self.shards_per_node)

    def socket_paths(self) -> tuple[str, ...]:
        return tuple(f"{self.shard_uds_path}-{rank}" for rank in range(self.num_shard))

    def tcp_address(self, rank: int, host: str | None = None) -> str:
        assert self.shard_port is not None
        return f"{host or self.shard_host}:{self.shard_port + rank}"

    def shard_config(self, rank: int, tcp_address: str | None = None) -> ShardConfig:
        """Rank `rank`'s config: on TCP at `tcp_address` (default: from --shard-port), else a unix socket."""
        if tcp_address is None and self.shard_port is not None:
            tcp_address = self.tcp_address(rank)
        where = {"tcp_address": tcp_address} if tcp_address else {"uds_path": self.socket_paths()[rank]}
        return ShardConfig(**_values(self, ShardFlags), **where, rank=rank, world_size=self.num_shard,
                           local_rank=rank - self.local_ranks().start)

    def router_config(self, shard_addresses: tuple[str, ...] | None = None) -> RouterConfig:
        """The router's config: the shards at `shard_addresses` (default: --shard-address, or this host's
        TCP ports with --shard-port, else the unix sockets)."""
        values = _values(self, RouterFlags)
        if shard_addresses is None and self.shard_port is not None and not self.shard_addresses:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.shard_host, self.shard_host)
            shard_addresses = tuple(self.tcp_address(rank, host) for rank in range(self.num_shard))
        if shard_addresses is not None:
            values["shard_addresses"] = shard_addresses
        if values["shard_addresses"]:
            return RouterConfig(**values)
        return RouterConfig(**values, shard_uds_paths=self.socket_paths())


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) into its parts; ValueError with the address otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def read_secret_file(path: str) -> str:
    """A secret file's first line; ValueError when it is missing or blank."""
    try:
        with open(path, encoding="utf-8") as file:
            secret = file.readline().strip()
    except OSError as error:
        raise ValueError(f"cannot read the secret file {path}: {error.strerror}") from None
    if not secret:
        raise ValueError(f"the secret file {path} is empty")
    return secret


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra` added, for a child process it starts."""
    return {**os.environ, **extra}


def _values(model: BaseModel, fields_of: type[BaseModel]) -> dict[str, Any]:
    return {name: getattr(model, name) for name in fields_of.model_fields}


# ---- the command line: argparse flags generated from the fields --------------------------------

M = TypeVar("M", bound=BaseModel)


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values of a Literal (or Optional Literal) annotation, for --help and argparse."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            if get_origin(arg) is Literal:
                return get_args(arg)
    return None


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line (argparse prints the whole usage first: dozens of flags here)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser(model: type[BaseModel], prog: str, description: str) -> argparse.ArgumentParser:
    """One `--kebab-case` flag per field (a tuple field repeats a singular flag), plus
    `--config-json` for a whole config handed over by the launcher. Values stay strings:
    the model converts and validates them."""
    parser = OneLineErrors(prog=prog, description=description)
    parser.add_argument("--config-json", help="the whole configuration as JSON (how the launcher hands it over)")
    settings = issubclass(model, BaseSettings)
    for name, field in model.model_fields.items():
        default = "required" if field.is_required() else repr(field.default)
        env = f"env {env_var(name)}; " if settings else ""
        help_text = f"{field.description} [{env}default {default}]"
        if get_origin(field.annotation) is tuple:
            parser.add_argument(option(singular(name)), dest=name, action="append",
                                default=argparse.SUPPRESS, help=help_text)
        elif _is_switch(field.annotation):  # as TGI's: `--json-output` or `--json-output false`
            parser.add_argument(option(name), dest=name, default=argparse.SUPPRESS, nargs="?", const="true",
                                help=help_text)
        else:
            parser.add_argument(option(name), dest=name, default=argparse.SUPPRESS,
                                choices=_choices(field.annotation), help=help_text)
    return parser


def _is_switch(annotation: object) -> bool:
    """A bool field, or one that may also stay unset (None: decided at run time)."""
    return annotation is bool or (get_origin(annotation) in (typing.Union, types.UnionType)
                                  and set(get_args(annotation)) == {bool, type(None)})


def singular(name: str) -> str:
    """A repeatable flag's name: shard_uds_paths -> shard_uds_path, shard_addresses -> shard_address."""
    return name[:-2] if name.endswith("sses") else name.removesuffix("s")


def public_json(config: BaseModel) -> str:
    """The config as JSON for a child's argv: every field but the secrets."""
    return config.model_dump_json(exclude=set(SECRET_FIELDS))


def secrets_json(config: BaseModel) -> str | None:
    """The secrets the argv leaves out, as JSON for the child's stdin; None when there are none."""
    secrets: dict[str, Any] = {}
    for name in sorted(SECRET_FIELDS):
        value = getattr(config, name, None)
        if isinstance(value, SecretStr):
            secrets[name] = value.get_secret_value()
        elif value:
            secrets[name] = [item.get_secret_value() for item in value]
    return json.dumps(secrets) if secrets else None


def parse_config(model: type[M], argv: Sequence[str] | None, prog: str, description: str) -> M:
    """The model from flags (or --config-json, plus the secrets as JSON on stdin with
    --secrets-on-stdin); exits with status 2 and one line on bad input."""
    parser = build_parser(model, prog, description)
    parser.add_argument("--secrets-on-stdin", action="store_true", default=argparse.SUPPRESS,
                        help="read the secret fields (API keys) as one JSON object from stdin")
    args = vars(parser.parse_args(argv))
    config_json = args.pop("config_json", None)
    secrets = json.loads(sys.stdin.readline()) if args.pop("secrets_on_stdin", False) else {}
    try:
        if config_json is not None:
            return model.model_validate({**json.loads(config_json), **secrets})
        return model(**args, **secrets)
    except ValidationError as error:
        parser.error(validation_message(error))
    raise AssertionError("unreachable")  # parser.error exits


def validation_message(error: ValidationError) -> str:
    """One line per invalid field: `--flag: reason`."""
    lines = []
    for item in error.errors():
        where = option(str(item["loc"][0])) if item["loc"] else "config"
        lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)
