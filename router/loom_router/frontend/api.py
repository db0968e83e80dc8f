"""A frontend's HTTP app: error handling, the text-generation-inference routes, and beside them
OpenAI's (completions, openai_api, responses_api) and Anthropic's (anthropic_api) routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loom_proto.config import RouterConfig
from loom_router.frontend import (
    anthropic_api,
    completions,
    embeddings,
    guard,
    lora_routes,
    openai_api,
    openapi_errors,
    playground,
    responses_api,
    snapshots,
)
from loom_router.frontend.api_errors import api_error_response
from loom_router.frontend.gateway import add_gateway_routes
from loom_router.frontend.http_common import (
    AppState,
    ChoiceResult,
    ClientDisconnected,
    EventStreamResponse,
    Generation,
    batches,
    check_input_chars,
    encode,
    generate,
    get_state,
    served_model_name,
    shown_model_id,
    sse,
    submit,
)
from loom_router.frontend.json_body import UnicodeJSONRoute
from loom_router.frontend.lifecycle import add_readiness_routes
from loom_router.frontend.text import token_spans, token_texts
from loom_router.frontend.validation import (
    TGIParameters,
    TGIRequest,
    TokenizeRequest,
    check_tgi,
    tgi_generation_params,
)
from loom_router.observability.metrics import FrontendMetrics, MetricsMiddleware
from loom_router.structured.fields import tgi_constraint_spec
from loom_router.tokenizer import ChatTemplateError
from loom_router.types import (
    APIError,
    BadRequestError,
    ChoiceEvent,
    GeneratedToken,
    GenerationError,
    GenerationParams,
    NotFoundError,
    OverloadedError,
    SnapshotHTTPError,
    UnavailableError,
    ValidationError,
)


def _version() -> str:
    try:
        return version("loom-router")
    except PackageNotFoundError:  # run from a source tree without installing
        return "0+unknown"


VERSION = _version()
CLIENT_CLOSED_REQUEST = 499  # nginx's code: nobody reads it, but the access log should say so


def create_app(engine: Any, config: RouterConfig, metrics: FrontendMetrics | None = None) -> FastAPI:
    """A frontend's FastAPI app around its engine client (loom_router.frontend.engine_client),
    started and connected to the engine core already."""
    metrics = metrics or FrontendMetrics()
    app = FastAPI(title="Loom", version=VERSION,
                  description="LLM serving: text-generation-inference and OpenAI compatible APIs")
    app.router.route_class = UnicodeJSONRoute  # a lone surrogate in a JSON body is a 422, as malformed JSON
    app.state.loom = AppState(config, engine, metrics, served_model_name(config))
    _add_error_handlers(app)
    openapi_errors.install(app)  # documents every error status; FastAPI's own errors in Loom's shapes
    _add_tgi_routes(app)
    add_readiness_routes(app)
    add_gateway_routes(app, VERSION)
    app.include_router(completions.router)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(embeddings.router)
    app.include_router(lora_routes.router)
    if config.snapshot_routes:
        app.include_router(snapshots.build_router())
    app.include_router(playground.build_router())  # GET / for browsers; POST / stays TGI's
    guard.install(app, config, engine)  # API keys, size limit, draining: counted by the metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    guard.install_cors(app, config)  # outermost: a browser's preflight carries no key
    return app


# ---- errors -----------------------------------------------------------------------------


def error_response(request: Request, status: int, message: str, error_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """TGI's `{"error", "error_type"}`, or OpenAI's `{"error": {...}}` on the /v1 routes."""
    response = api_error_response(request.url.path, status, message, param, code)
    if response is not None:
        return response
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status)


PYTHON_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes", "literal"})


def describe_validation_errors(errors: Any) -> tuple[str, str | None]:
    """Pydantic's errors as one readable line, and the first offending field. A value that
    fits no branch of a union is one error naming the field (not a branch per type)."""
    parts: dict[str | None, list[str]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = error.get("ctx", {}).get("error", error.get("msg"))
            parts.setdefault(None, []).append(f"the body is not valid JSON: {reason}")
            continue
        loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_branch(p)]
        messages = parts.setdefault(".".join(loc) or None, [])
        if error.get("msg") not in messages:
            messages.append(str(error.get("msg")))
    described = [f"`{param}`: {' or '.join(messages)}" if param else "; ".join(messages)
                 for param, messages in parts.items()]
    return "; ".join(described) or "invalid request", next((p for p in parts if p), None)


def _is_union_branch(part: object) -> bool:
    """Pydantic names the union branch a value failed in its error's location (`str`,
    `list[TextPart]`, `constrained-str`, a model's class name): not a field of the request."""
    if not isinstance(part, str):
        return False
    return any(c in part for c in "[]-(),") or part[:1].isupper() or part in PYTHON_TYPE_NAMES


def _validation_message(message: str) -> str:
    prefix = "Input validation error: "
    return message if message.startswith(prefix) else prefix + message


# The engine's errors, the status and error_type each maps to (a subclass's entry wins over its base's).
ENGINE_ERRORS: dict[type[Exception], tuple[int, str]] = {
    ValidationError: (422, "validation"),
    ChatTemplateError: (422, "validation"),
    OverloadedError: (429, "overloaded"),
    GenerationError: (424, "generation"),
    UnavailableError: (503, "unavailable"),
    BadRequestError: (400, "bad_request"),
    NotFoundError: (404, "not_found"),
}


def _engine_error_handler(status: int, kind: str) -> Any:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        message = _validation_message(str(exc)) if isinstance(exc, ValidationError) else str(exc)
        if isinstance(exc, NotFoundError) and not request.url.path.endswith("_lora_adapter"):
            # a request's `model` that names no adapter: OpenAI's model_not_found
            return error_response(request, status, message, kind, "model", "model_not_found")
        return error_response(request, status, message, kind)

    return handle


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SnapshotHTTPError)
    async def _snapshot(request: Request, exc: SnapshotHTTPError) -> JSONResponse:
        return snapshots.error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        response = api_error_response(request.url.path, 422, message, param)
        if response is not None:
            return response
        return error_response(request, 422, _validation_message(message), "validation")

    for error_type, (status, kind) in ENGINE_ERRORS.items():
        app.add_exception_handler(error_type, _engine_error_handler(status, kind))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        response = api_error_response(request.url.path, exc.status, str(exc), exc.param, exc.code)
        if response is not None:
            return response
        return error_response(request, 422, _validation_message(str(exc)), "validation")

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


# ---- TGI --------------------------------------------------------------------------------


def _add_tgi_routes(app: FastAPI) -> None:
    @app.post("/generate", tags=["TGI"], summary="Generate tokens")
    async def generate_route(body: TGIRequest, request: Request) -> dict[str, Any]:
        return await _generate(get_state(request), request, body)

    @app.post("/generate_stream", tags=["TGI"], summary="Generate a stream of tokens (SSE)")
    async def generate_stream_route(body: TGIRequest, request: Request) -> Response:
        return await _generate_stream(get_state(request), body)

    @app.post("/", tags=["TGI"], summary="TGI's compatibility route: generate, or stream with `stream: true`")
    async def compat_route(body: TGIRequest, request: Request) -> Any:
        state = get_state(request)
        if body.stream:
            return await _generate_stream(state, body)
        return [await _generate(state, request, body)]

    @app.get("/info", tags=["TGI"], summary="Model and server limits")
    async def info_route(request: Request) -> dict[str, Any]:
        return _info(get_state(request))

    @app.get("/health", tags=["TGI"], summary="200 when the engine core and every shard are healthy, else 503",
             response_class=Response, responses={200: {"description": "healthy (an empty body, as TGI's)"}})
    async def health_route(request: Request) -> Response:
        if await get_state(request).engine.health():
            return Response(status_code=200)
        return error_response(request, 503, "unhealthy: the engine or a shard is down", "unhealthy")

    @app.post("/tokenize", tags=["TGI"], summary="Tokenize a text")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
        state = get_state(request)
        if not body.inputs:
            raise ValidationError("`inputs` cannot be empty")
        check_input_chars(state, len(body.inputs))
        # Spans and their JSON in a thread: a long input is a long answer (the loop serves /health).
        content = await asyncio.to_thread(_tokenize_json, state.tokenizer, body.inputs, body.parameters.truncate)
        return Response(content, media_type="application/json")

    @app.get("/metrics", tags=["Monitoring"], summary="Prometheus metrics", response_class=Response,
             responses={200: {"description": "the Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_route(request: Request) -> Response:
        # Every process's metrics, rendered by the engine core (which refreshes loom_shard_healthy first).
        content = await get_state(request).engine.call("metrics", timeout_s=30.0)
        return Response(content, media_type=CONTENT_TYPE_LATEST)


async def _prepare(state: AppState, body: TGIRequest, stream: bool) -> tuple[list[int], GenerationParams]:
    params = body.parameters
    limits = state.limits()
    check_tgi(params, body.inputs, stream, limits)
    ids = await encode(state, body.inputs, truncate=params.truncate)  # TGI keeps the end of the input
    max_new_tokens = state.engine.validate_lengths(len(ids), params.max_new_tokens, params.best_of or 1)
    gen_params = tgi_generation_params(params, max_new_tokens, limits)
    gen_params.constraint = tgi_constraint_spec(params.grammar)  # compiled by the engine core
    return ids, gen_params


async def _generate(state: AppState, request: Request, body: TGIRequest) -> dict[str, Any]:
    ids, gen_params = await _prepare(state, body, stream=False)
    generation = await generate(state, request, ids, gen_params)
    prompt_texts: list[str] = []
    if body.parameters.decoder_input_details:
        prompt_texts = await asyncio.to_thread(token_texts, state.tokenizer, ids)  # long prompts: off the loop
    return _tgi_response(state, body, ids, gen_params, generation, prompt_texts)


def _tgi_response(state: AppState, body: TGIRequest, ids: list[int], gen_params: GenerationParams,
                  generation: Generation, prompt_texts: list[str]) -> dict[str, Any]:
    params = body.parameters
    # best_of: the sequence with the highest total logprob wins, as in TGI
    ranked = sorted(generation.choices, key=lambda c: c.logprob_sum, reverse=True)
    best = ranked[0]
    out: dict[str, Any] = {"generated_text": _full_text(params, body.inputs, best.text)}
    if not (params.details or params.decoder_input_details):  # TGI: either asks for the details
        return out
    prefill = _prefill(ids, prompt_texts, generation.prompt.prompt_logprobs) if params.decoder_input_details else []
    details = _sequence(state, body, gen_params, best, prefill)
    del details["generated_text"]
    if len(ranked) > 1:
        details["best_of_sequences"] = [_sequence(state, body, gen_params, c, prefill) for c in ranked[1:]]
    out["details"] = details
    return out


def _sequence(state: AppState, body: TGIRequest, gen_params: GenerationParams, choice: ChoiceResult,
              prefill: list[dict[str, Any]]) -> dict[str, Any]:
    """TGI's BestOfSequence (Details plus the text)."""
    params = body.parameters
    return {
        "generated_text": _full_text(params, body.inputs, choice.text),
        "finish_reason": choice.finish_reason.value if choice.finish_reason else None,
        "generated_tokens": len(choice.tokens),
        "seed": _reported_seed(params, gen_params, choice.index),
        "prefill": prefill,
        "tokens": [_token(state, t) for t in choice.tokens],
        "top_tokens": [_top_tokens(state, t) for t in choice.tokens] if params.top_n_tokens else [],
    }


async def _generate_stream(state: AppState, body: TGIRequest) -> Response:
    ids, gen_params = await _prepare(state, body, stream=True)
    stream, timer = await submit(state, ids, gen_params)
    return EventStreamResponse(_tgi_events(state, body, ids, gen_params, batches(stream, timer)), stream.cancel)


async def _tgi_events(state: AppState, body: TGIRequest, ids: list[int], gen_params: GenerationParams,
                      events: AsyncIterator[list[ChoiceEvent]]) -> AsyncIterator[bytes]:
    """TGI's stream: one event per token; the events waiting together go out in one write."""
    parts: list[str] = []
    try:
        async for batch in events:
            chunk = []
            for event in batch:
                parts.append(event.text)
                chunk.append(sse(_tgi_event(state, body, ids, gen_params, event, parts)))
            yield b"".join(chunk)
    except GenerationError as e:
        yield sse({"error": str(e), "error_type": "generation"})


def _tgi_event(state: AppState, body: TGIRequest, ids: list[int], gen_params: GenerationParams,
               event: ChoiceEvent, parts: list[str]) -> dict[str, Any]:
    params = body.parameters
    payload: dict[str, Any] = {
        "index": event.num_generated,
        "token": _token(state, event.token),
        "top_tokens": _top_tokens(state, event.token) if params.top_n_tokens else [],
        "generated_text": None,
        "details": None,
    }
    if event.finish_reason is not None:
        payload["generated_text"] = _full_text(params, body.inputs, "".join(parts))
        if params.details:
            payload["details"] = {
                "finish_reason": event.finish_reason.value,
                "generated_tokens": event.num_generated,
                "seed": _reported_seed(params, gen_params, 0),
                "input_length": len(ids),
            }
    return payload


def _full_text(params: TGIParameters, inputs: str, text: str) -> str:
    return inputs + text if params.return_full_text else text


def _reported_seed(params: TGIParameters, gen_params: GenerationParams, index: int) -> int | None:
    """TGI reports the seed only when the tokens were sampled."""
    return gen_params.choices[index].seed if params.sampling else None


def _token(state: AppState, token: GeneratedToken) -> dict[str, Any]:
    """TGI's Token: a special token's text is the token itself (`</s>`), though the generated
    text leaves it out."""
    text = state.tokenizer.decode([token.token_id]) if token.special else token.text
    return {"id": token.token_id, "text": text, "logprob": token.logprob, "special": token.special}


def _top_tokens(state: AppState, token: GeneratedToken) -> list[dict[str, Any]]:
    tok = state.tokenizer
    return [{"id": t.token_id, "text": tok.decode([t.token_id]), "logprob": t.logprob,
             "special": tok.is_special(t.token_id)} for t in token.top_tokens]


def _prefill(ids: list[int], texts: list[str], logprobs: list[float | None]) -> list[dict[str, Any]]:
    padded = list(logprobs) + [None] * (len(ids) - len(logprobs))
    return [{"id": i, "text": text, "logprob": lp} for i, text, lp in zip(ids, texts, padded)]


def _tokenize_json(tokenizer: Any, inputs: str, truncate: int | None) -> bytes:
    return orjson.dumps(token_spans(tokenizer, inputs, truncate))


def _info(state: AppState) -> dict[str, Any]:
    engine, config = state.engine, state.config
    model = engine.model_info
    return {
        "model_id": shown_model_id(config),
        "model_sha": model.weights_hash if model else None,
        "model_dtype": model.dtype if model else None,
        "model_device_type": model.device if model else None,
        "model_quantization": model.quantization if model else None,
        "cpu_kernels": model.cpu_kernels or None if model else None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_best_of": config.max_n,
        "max_stop_sequences": config.max_stop_sequences,
        "max_input_tokens": engine.max_input_tokens,
        "max_input_length": engine.max_input_tokens,  # TGI 1.x name
        "max_total_tokens": engine.max_total_tokens,
        "max_batch_total_tokens": engine.max_batch_total_tokens,
        "max_batch_prefill_tokens": engine.max_batch_prefill_tokens,
        "max_top_n_tokens": config.max_top_n_tokens,
        "max_n": config.max_n,
        "max_client_batch_size": config.max_client_batch_size,
        "validation_workers": config.api_workers or 1,  # the frontends, which validate and tokenize
        "block_size": model.block_size if model else None,
        "world_size": model.world_size if model else None,
        "served_model_name": state.model_name,
        "router": "loom-router",
        "version": VERSION,
        "sha": None,
        "docker_label": None,
    }
