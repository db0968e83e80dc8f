"""Request models of the TGI and OpenAI APIs, and their conversion into `GenerationParams`.

Pydantic checks types and per-field ranges; the conversion functions check what
depends on the server (`Limits`) and raise `ValidationError` (HTTP 422).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from loom_proto.step import SamplingParams
from loom_router.frontend.tools import ToolFields
from loom_router.structured.fields import ConstraintFields, TGIGrammar
from loom_router.types import GenerationParams, StopText, ValidationError

SEED_LIMIT = 2**63  # seeds are 63-bit so that seed + choice index stays a valid int64
OPENAI_MAX_TOP_LOGPROBS = 20

# Counts and sizes: the shard protocol carries them as uint32 (a larger value could not be sent,
# and would fail the step of every request in it); TGI's own bound for them is i32.
MAX_COUNT = 2**31 - 1

Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Positive = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Text = Annotated[str, Field(min_length=1)]  # an input: "" is refused, and the schema says so
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_COUNT)]], Field(min_length=1)]


def _document_nulls(schema: dict[str, Any]) -> None:
    """The JSON schema of a `_Strict` model: its optional fields take null (`_null_means_default`)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _takes_null(prop):
            continue
        kept = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **kept}


def _takes_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(branch.get("type") == "null" for branch in prop.get("anyOf", ()))


class _Strict(BaseModel):
    # strict: a string where a number belongs is a 422, not silently coerced; no Infinity or NaN
    # (JSON's 1e999 reads as Infinity): a temperature or penalty of Infinity only makes garbage
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, json_schema_extra=_document_nulls)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send `"n": null` or `"stream": null` for "unset": give those the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


@dataclass(slots=True, frozen=True)
class Limits:
    """Server-side bounds a request is checked against."""

    max_stop_sequences: int
    max_top_n_tokens: int
    max_n: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def random_seed() -> int:
    return secrets.randbits(63)


def choice_seed(seed: int, index: int) -> int:
    """Choice i of a request samples with seed + i (wrapping inside 63 bits)."""
    return (seed + index) % SEED_LIMIT


# ---------------------------------------------------------------- TGI


class TGIParameters(_Strict):
    """TGI's `parameters`, with TGI's names and ranges."""

    do_sample: bool = False
    max_new_tokens: Positive | None = None  # None: the rest of the context
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    frequency_penalty: Penalty | None = None
    return_full_text: bool | None = False
    stop: list[str] = Field(default_factory=list)
    seed: Seed | None = None
    temperature: Annotated[float, Field(gt=0.0)] | None = None
    top_k: Positive | None = None
    top_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    typical_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    truncate: Positive | None = None
    best_of: Positive | None = None
    watermark: bool = False  # true is refused: no watermarking here
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: Count | None = None
    grammar: TGIGrammar | None = None
    adapter_id: str | None = None  # a LoRA adapter's name (TGI's multi-LoRA); None or "": the base model

    @property
    def sampling(self) -> bool:
        """TGI samples when asked to or when any warper is set."""
        warpers = (self.temperature not in (None, 1.0) or self.top_k is not None
                   or self.top_p is not None or self.typical_p is not None)
        return self.do_sample or warpers


class TGIRequest(_Strict):
    inputs: Text
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TokenizeRequest(_Strict):
    inputs: Text
    parameters: TGIParameters = Field(default_factory=TGIParameters)


def check_tgi(params: TGIParameters, inputs: str, stream: bool, limits: Limits) -> None:
    """The TGI checks that depend on the server or span fields. Raises ValidationError."""
    if not inputs:
        raise ValidationError("`inputs` cannot be empty")
    if len(params.stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(params.stop)}")
    if (params.top_n_tokens or 0) > limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be <= {limits.max_top_n_tokens}. "
                              f"Given: {params.top_n_tokens}")
    best_of = params.best_of or 1
    if best_of > limits.max_n:
        raise ValidationError(f"`best_of` must be <= {limits.max_n}. Given: {best_of}")
    if best_of > 1 and not params.sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if best_of > 1 and stream:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if params.decoder_input_details and stream:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    if params.watermark:
        raise ValidationError("`watermark` is not supported: this server does not watermark its output")


def tgi_generation_params(params: TGIParameters, max_new_tokens: int, limits: Limits) -> GenerationParams:
    """TGI parameters -> one SamplingParams per `best_of` sequence."""
    seed = params.seed if params.seed is not None else random_seed()
    base = SamplingParams(
        seed=seed,
        do_sample=params.sampling,
        temperature=params.temperature if params.temperature is not None else 1.0,
        top_k=params.top_k,
        top_p=params.top_p,
        typical_p=params.typical_p,
        repetition_penalty=_unless(params.repetition_penalty, 1.0),
        frequency_penalty=params.frequency_penalty or 0.0,
        top_n_tokens=params.top_n_tokens or 0,
        eos_token_ids=limits.eos_token_ids,
    )
    n = params.best_of or 1
    return GenerationParams(
        choices=[replace(base, seed=choice_seed(seed, i)) for i in range(n)],
        max_new_tokens=max_new_tokens,
        stop_sequences=[s for s in params.stop if s],
        stop_text=StopText.KEEP_TOKEN,  # TGI's generated_text: whole tokens, the stop sequence kept
        prompt_logprobs=params.decoder_input_details,
        adapter=params.adapter_id or None,
    )


# ---------------------------------------------------------------- OpenAI


class ChoiceOverride(_Strict):
    """Loom extension: how one choice samples differently from the request's defaults."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class OpenAISampling(ChoiceOverride, ConstraintFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Positive | None = None
    n: Positive = 1
    stop: str | list[str] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Count] | None = None  # vLLM's: tokens that end a choice as EOS does
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string it matched
    min_tokens: Count = 0
    choice_params: list[ChoiceOverride] | None = None

    @property
    def stop_sequences(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_candidates(self) -> int:
        """Choices generated: `n`, or legacy completions' `best_of` (the n best are returned)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    # One prompt (text or token ids), or a list of them (at most --max-client-batch-size).
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    # OpenAI's default for legacy completions (and vLLM's): 16; 0 with echo: score the prompt, generate nothing
    max_tokens: Count = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=OPENAI_MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None  # refused (400): no fill-in-the-middle
    best_of: Positive | None = None  # choices generated; the n with the highest logprob per token are returned

    @property
    def num_candidates(self) -> int:
        return self.best_of or self.n

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_empty_prompt(cls, prompt: Any) -> Any:
        """The common mistake, in words rather than as a union's every branch."""
        if prompt == "" or prompt == [] or prompt == [""] or prompt == [[]]:
            raise ValueError("`prompt` cannot be empty")
        return prompt

    @property
    def top_n_tokens(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, for templates that use it

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant turn may hold tool calls only
            raise ValueError(f"a `{self.role}` message needs `content`")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template expects it; `developer` is OpenAI's new `system`."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            message: dict[str, Any] = {"role": role, "content": "".join(part.text for part in self.content)}
        else:
            message = {"role": role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


LOOM_TEMPLATE_VARIABLES = frozenset({"messages", "bos_token", "eos_token"})  # a template's, filled by Loom
TEMPLATE_FLAGS = frozenset({"add_generation_prompt", "continue_final_message"})


class ChatCompletionRequest(OpenAISampling, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3
    # (and the two flags below, which it may set too)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt without the assistant turn's opening, or ending inside the final
    # (assistant) message so that the answer goes on from its text (a prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=OPENAI_MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` requires `logprobs` to be true")
        return self

    @model_validator(mode="after")
    def _template_variables(self) -> ChatCompletionRequest:
        reserved = sorted(LOOM_TEMPLATE_VARIABLES & (self.chat_template_kwargs or {}).keys())
        if reserved:
            raise ValueError(f"`chat_template_kwargs` cannot set {', '.join(reserved)}: the request's own "
                             "messages and the model's tokens fill them")
        if self.continues_final_message and self.adds_generation_prompt:
            raise ValueError("`continue_final_message` and `add_generation_prompt` cannot both be true")
        return self

    @property
    def continues_final_message(self) -> bool:
        return bool((self.chat_template_kwargs or {}).get("continue_final_message", self.continue_final_message))

    @property
    def adds_generation_prompt(self) -> bool:
        """As asked (in the request or its chat_template_kwargs); unasked, unless continuing."""
        kwargs = self.chat_template_kwargs or {}
        if "add_generation_prompt" in kwargs:
            return bool(kwargs["add_generation_prompt"])
        if "add_generation_prompt" in self.model_fields_set:
            return self.add_generation_prompt
        return not self.continues_final_message

    @property
    def template_variables(self) -> dict[str, Any]:
        """chat_template_kwargs without the two flags (the template gets them as asked above)."""
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k not in TEMPLATE_FLAGS}

    @classmethod
    def translated(cls, fields: dict[str, Any]) -> ChatCompletionRequest:
        """The chat request another API's body (already validated in its own terms) runs as.
        Raises RequestValidationError (422, in that API's error shape) where a value breaks a
        bound of the chat request's."""
        try:
            return cls.model_validate(fields)
        except PydanticValidationError as error:
            raise RequestValidationError(error.errors()) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_n_tokens(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_openai(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> None:
    """The OpenAI checks that depend on the server or span fields. Raises ValidationError."""
    if req.n > limits.max_n:
        raise ValidationError(f"`n` must be <= {limits.max_n}. Given: {req.n}")
    if req.num_candidates != req.n:
        _check_best_of(req, limits)
    if req.choice_params is not None and len(req.choice_params) > req.n:
        raise ValidationError(f"`choice_params` has {len(req.choice_params)} entries, more than `n` ({req.n})")
    if len(req.stop_sequences) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(req.stop_sequences)}")
    if (req.top_n_tokens or 0) > limits.max_top_n_tokens:
        raise ValidationError(f"at most {limits.max_top_n_tokens} top logprobs are supported. "
                              f"Given: {req.top_n_tokens}")
    max_tokens = req.requested_max_tokens
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise ValidationError(f"`min_tokens` ({req.min_tokens}) must be <= `max_tokens` ({max_tokens})")
    _logit_bias(req.logit_bias, limits.vocab_size)
    outside = [t for t in req.stop_token_ids or [] if t >= limits.vocab_size]
    if outside:
        raise ValidationError(f"`stop_token_ids` must be in 0..{limits.vocab_size - 1}. Given: {outside[0]}")


def _check_best_of(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> None:
    best_of = req.num_candidates
    if best_of < req.n:
        raise ValidationError(f"`best_of` ({best_of}) must be >= `n` ({req.n})")
    if best_of > limits.max_n:
        raise ValidationError(f"`best_of` must be <= {limits.max_n}. Given: {best_of}")
    if req.stream:
        raise ValidationError("`best_of` cannot stream: the best choices are known at the end")
    if req.choice_params is not None:
        raise ValidationError("`best_of` and `choice_params` cannot be combined")


def openai_generation_params(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int,
                             limits: Limits) -> GenerationParams:
    """OpenAI request -> n SamplingParams: the request's defaults, then each choice's overrides."""
    seed = req.seed if req.seed is not None else random_seed()
    overrides = req.choice_params or []
    choices = []
    for i in range(req.num_candidates):
        override = overrides[i] if i < len(overrides) else None
        choices.append(_openai_sampling(req, override, choice_seed(seed, i), limits))
    echo_logprobs = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    return GenerationParams(
        choices=choices,
        max_new_tokens=max_new_tokens,
        stop_sequences=req.stop_sequences,
        stop_text=StopText.KEEP if req.include_stop_str_in_output else StopText.CUT,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        prompt_logprobs=echo_logprobs,
    )


def _openai_sampling(req: OpenAISampling, override: ChoiceOverride | None, seed: int,
                     limits: Limits) -> SamplingParams:
    def pick(name: str) -> Any:
        value = getattr(override, name) if override is not None else None
        return value if value is not None else getattr(req, name)

    temperature = pick("temperature")
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default samples
    top_k = pick("top_k")
    override_seed = override.seed if override is not None else None
    return SamplingParams(
        seed=override_seed if override_seed is not None else seed,
        do_sample=temperature > 0.0,
        temperature=temperature if temperature > 0.0 else 1.0,
        top_k=top_k if top_k is not None and top_k > 0 else None,  # 0 and -1 mean off (vLLM)
        top_p=_unless(pick("top_p"), 1.0),
        min_p=_unless(pick("min_p"), 0.0),
        repetition_penalty=_unless(pick("repetition_penalty"), 1.0),
        frequency_penalty=pick("frequency_penalty") or 0.0,
        presence_penalty=pick("presence_penalty") or 0.0,
        logit_bias=_logit_bias(req.logit_bias, limits.vocab_size),
        top_n_tokens=req.top_n_tokens or 0,  # type: ignore[attr-defined]
        min_new_tokens=req.min_tokens,  # masks the stop token ids too, as vLLM's min_tokens does
        eos_token_ids=tuple(dict.fromkeys([*limits.eos_token_ids, *(req.stop_token_ids or [])])),
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias maps token ids, as strings, to a bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValidationError(f"`logit_bias` keys must be token ids. Given: {key!r}") from None
        if not 0 <= token_id < vocab_size:
            raise ValidationError(f"`logit_bias` token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        out[token_id] = value
    return out


def _unless(value: float | None, neutral: float) -> float | None:
    """None when the value is absent or has no effect, so the shard skips the filter."""
    return None if value is None or value == neutral else value
