"""LoRA adapters over HTTP, with vLLM's names and bodies: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind the API key, like every route but /health and /ready), the
adapters in /v1/models, and which adapter a request names (OpenAI `model`, TGI `adapter_id`).
The engine core owns the adapters (loom_router.core.adapters); these only ask it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from loom_router.frontend.http_common import AppState, get_state
from loom_router.types import BadRequestError

router = APIRouter(prefix="/v1", tags=["LoRA"])


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


@router.post("/load_lora_adapter", summary="Load a PEFT LoRA adapter while serving (400: a bad adapter)",
             response_class=PlainTextResponse)
async def load_route(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    if body.lora_name in state.model_names:  # `model` would then name two models
        raise BadRequestError(f"'{body.lora_name}' is the served model's name; give the adapter another")
    name = await state.engine.call("lora_load", body.lora_name, path=body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter", summary="Unload a LoRA adapter (after the requests using it finish)",
             response_class=PlainTextResponse, responses={404: {"description": "no adapter of that name"}})
async def unload_route(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    name = await get_state(request).engine.call("lora_unload", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def adapter_models(state: AppState) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters (vLLM's shape: `parent` is the base model)."""
    if not state.config.enable_lora:
        return []
    adapters = await state.engine.call("lora_list", timeout_s=10.0)
    return [{"id": name, "object": "model", "created": 0, "owned_by": "loom", "root": path,
             "parent": state.model_name, "max_model_len": state.engine.max_total_tokens}
            for name, path in adapters]
