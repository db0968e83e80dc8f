"""What a cache-aware gateway in front of several replicas reads of a worker, in the names it
reads: SGLang's router (sglang-router / SGLang Model Gateway) and vLLM's router ask each worker
for `/server_info` (or `/get_server_info`), `/model_info` (or `/get_model_info`) and
`/get_load`, and probe `/health` (served by the TGI routes).

`/get_load` answers SGLang's shape, one entry per data-parallel rank (Loom has one):
`num_reqs` (running + waiting), `num_waiting_reqs`, `num_tokens` (KV tokens in use), plus
`num_running_reqs` and `kv_cache_usage` (0..1) for gateways that balance on them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from loom_router.frontend.http_common import AppState, get_state

LOAD_TIMEOUT_S = 5.0  # gateways poll with a few seconds' timeout; answer within it or fail


def add_gateway_routes(app: FastAPI, version: str) -> None:
    @app.get("/get_load", tags=["Gateway"], summary="Load per data-parallel rank (SGLang's shape)")
    async def load_route(request: Request) -> list[dict[str, Any]]:
        load = await get_state(request).engine.call("load", timeout_s=LOAD_TIMEOUT_S)
        return [load_entry(load)]

    @app.get("/server_info", tags=["Gateway"], summary="Server limits (SGLang's names)")
    @app.get("/get_server_info", tags=["Gateway"], summary="Server limits (SGLang's older path)")
    async def server_info_route(request: Request) -> dict[str, Any]:
        return server_info(get_state(request), version)

    @app.get("/model_info", tags=["Gateway"], summary="Model description (SGLang's names)")
    @app.get("/get_model_info", tags=["Gateway"], summary="Model description (SGLang's older path)")
    async def model_info_route(request: Request) -> dict[str, Any]:
        return model_info(get_state(request))


def load_entry(load: dict[str, int]) -> dict[str, Any]:
    """The engine core's load report (loom_router.core.server.load_report) as one DP rank."""
    total = load["num_tokens_total"]
    return {
        "dp_rank": 0,
        "num_reqs": load["num_running"] + load["num_waiting"],
        "num_waiting_reqs": load["num_waiting"],
        "num_running_reqs": load["num_running"],
        "num_tokens": load["num_tokens_used"],
        "kv_cache_usage": load["num_tokens_used"] / total if total else 0.0,
    }


def server_info(state: AppState, version: str) -> dict[str, Any]:
    engine, config = state.engine, state.config
    return {
        "model_path": config.model_id or state.model_name,
        "served_model_name": state.model_name,
        "tokenizer_path": config.model_id or state.model_name,
        "dp_size": 1,
        "tp_size": engine.model_info.world_size if engine.model_info else None,
        "max_total_tokens": engine.max_batch_total_tokens,
        "max_prefill_tokens": engine.max_batch_prefill_tokens,
        "max_running_requests": config.max_concurrent_requests,
        "context_length": engine.max_total_tokens,
        "version": version,
        "engine": "loom",
    }


def model_info(state: AppState) -> dict[str, Any]:
    model = state.engine.model_info
    architecture = model.architecture if model else None
    return {
        "model_path": state.config.model_id or state.model_name,
        "tokenizer_path": state.config.model_id or state.model_name,
        "is_generation": True,
        "model_type": architecture,
        "architectures": [architecture] if architecture else [],
    }
