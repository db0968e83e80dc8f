"""POST /v1/embeddings, OpenAI's shape: `input` a string, a list of strings, a list of token ids or
a list of such lists; `dimensions` (cut, then normalized again when the model normalizes) and
`encoding_format` float or base64 (little-endian float32, as OpenAI sends it). Each input is one
request to the engine core, a prefill that samples nothing, batched with everything else."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from loom_router.frontend.http_common import AppState, encode, get_state
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.openai_api import check_model
from loom_router.frontend.pooling import EmbeddingSpec, PoolingConfigError, embedding_spec, finish_vector
from loom_router.types import BadRequestError, ValidationError

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=UnicodeJSONRoute)

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str | None = None
    dimensions: Annotated[int, Field(gt=0)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


@router.post("/embeddings", summary="Embeddings of texts or token ids (embedding models, or --task embed)")
async def embeddings_route(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    spec = _spec(state)
    if body.dimensions is not None and body.dimensions > state.engine.model_info.hidden_size:
        raise ValidationError(f"`dimensions` must be at most {state.engine.model_info.hidden_size}. "
                              f"Given: {body.dimensions}")
    prompts = await _prompts(state, body.input)
    adapter = check_model(state, body.model)
    # At most a quarter of --max-concurrent-requests in flight per HTTP request: a long list of
    # inputs waits its turn rather than overflowing the engine's limit (429) on its own.
    window = asyncio.Semaphore(max(1, state.config.max_concurrent_requests // 4))

    async def embed(ids: list[int]) -> list[float]:
        async with window:
            return await state.engine.embed(ids, spec.pooling, adapter)

    vectors = await asyncio.gather(*(embed(ids) for ids in prompts))
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(finish_vector(v, spec.normalize, body.dimensions), body.encoding_format)}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in prompts)
    return {"object": "list", "data": data, "model": adapter or state.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _spec(state: AppState) -> EmbeddingSpec:
    try:
        spec = embedding_spec(state.config.model_id, state.config.task)
    except PoolingConfigError as error:
        raise BadRequestError(str(error)) from None
    if spec is None:
        raise BadRequestError("this model does not serve embeddings: start it with --task embed, or serve a "
                              "folder with a sentence-transformers configuration (modules.json)")
    return spec


async def _prompts(state: AppState, inputs: Any) -> list[list[int]]:
    """Every input as token ids, each checked against the context length."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    vocab_size = state.engine.model_info.vocab_size
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise ValidationError("`input` cannot contain an empty string")
            ids = await encode(state, item, field="input")
        else:
            ids = list(item)
            if any(i >= vocab_size for i in ids):
                raise ValidationError(f"`input` token ids must be in 0..{vocab_size - 1}")
        state.engine.validate_lengths(len(ids), 1, 1)
        prompts.append(ids)
    return prompts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
