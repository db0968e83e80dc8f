"""`loom-router`: parse a RouterConfig from flags, connect to the shards, serve the HTTP API.

SIGINT/SIGTERM stop it gracefully: uvicorn stops accepting connections and lets the
in-flight requests finish (within --shutdown-timeout), then the engine drains and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from collections.abc import Sequence

import uvicorn

from loom.router.api import create_app
from loom.router.config import RouterConfig
from loom.router.engine import Engine
from loom.router.shard_client import ShardClient
from loom.router.tokenizer import load_tokenizer

log = logging.getLogger("loom.router")

HELP = {
    "model_id": "GGUF file or Hugging Face folder the shards load ('' or 'default': the embedded SmolLM2)",
    "shard_uds_paths": "unix socket of a shard rank, once per rank in rank order",
    "hostname": "address to listen on",
    "port": "port to listen on",
    "max_concurrent_requests": "requests in flight before new ones get 429",
    "max_input_tokens": "longest prompt in tokens (default: max-total-tokens - 1)",
    "max_total_tokens": "prompt + generated tokens per request (default: the model's context length)",
    "max_batch_prefill_tokens": "tokens one step may compute",
    "max_batch_total_tokens": "KV cache budget in tokens (default: what the shards' warmup reports)",
    "max_stop_sequences": "stop sequences per request",
    "max_n": "most choices per request (OpenAI n, TGI best_of)",
    "max_top_n_tokens": "most alternatives returned per token (TGI top_n_tokens, OpenAI top_logprobs)",
    "snapshot_dir": "folder for KV snapshots (feature off when unset)",
    "served_model_name": "the OpenAI `model` name (default: derived from model-id)",
}


def build_parser() -> argparse.ArgumentParser:
    """One flag per RouterConfig field (`--kebab-case`; tuple fields repeat a singular flag)."""
    parser = argparse.ArgumentParser(prog="loom-router", description="Loom's router: HTTP API, scheduler, KV "
                                     "block manager; drives the shards over gRPC.")
    for f in dataclasses.fields(RouterConfig):
        kind = str(f.type)
        default = None if f.default is dataclasses.MISSING else f.default
        if kind.startswith("tuple"):
            flag = "--" + f.name.removesuffix("s").replace("_", "-")
            parser.add_argument(flag, dest=f.name, action="append", required=True, help=HELP.get(f.name))
            continue
        if f.name == "model_id":
            default = ""
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=default,
                            type=int if kind.startswith("int") else str, help=HELP.get(f.name))
    parser.add_argument("--shard-ready-timeout", type=float, default=600.0,
                        help="seconds to wait for every shard to answer Health")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish on SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)}
    values["shard_uds_paths"] = tuple(values["shard_uds_paths"])
    return RouterConfig(**values)


async def serve(config: RouterConfig, shard_ready_timeout_s: float, shutdown_timeout_s: float,
                log_level: str) -> int:
    """Runs the router until a signal stops it; returns the exit status."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model_id)
    client = ShardClient(config.shard_uds_paths)
    try:
        await client.wait_ready(shard_ready_timeout_s)
        engine = Engine(config, client, tokenizer)
        app = create_app(engine, config, manage_engine=True)  # the engine starts before the port opens
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.hostname, port=config.port, log_level=log_level,
            timeout_graceful_shutdown=int(shutdown_timeout_s), access_log=log_level == "debug",
        ))
        await server.serve()
        return 0 if server.started else 1
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(config, args.shard_ready_timeout, args.shutdown_timeout, args.log_level))
    except Exception as error:  # startup failures: one clear line, not a traceback
        log.error("router failed: %s", error, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


if __name__ == "__main__":
    sys.exit(main())
