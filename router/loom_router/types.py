"""Types both kinds of router process share: a validated request, what a frontend streams, the
engine's counters, and the errors with their HTTP meaning.

The API modules (TGI and OpenAI) validate a request into `GenerationParams`, submit it through
the frontend's engine client (loom_router.frontend.engine_client) and read `ChoiceEvent`s from
the returned stream; the engine core never sees HTTP and the API never sees blocks.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom_proto.step import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from loom_router.structured.spec import ConstraintSpec


class StopText(enum.Enum):
    """Where a choice's text ends when a stop sequence matches."""

    CUT = "cut"  # before the stop sequence (OpenAI's)
    KEEP = "keep"  # with it (vLLM's include_stop_str_in_output)
    KEEP_TOKEN = "keep_token"  # with the rest of the token that completed it: whole tokens (TGI's)


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"

    @property
    def openai(self) -> str:
        return "length" if self is FinishReason.LENGTH else "stop"


@dataclass(slots=True)
class GenerationParams:
    """A validated request. `choices[i]` is how choice i samples (len == n)."""

    choices: list[SamplingParams]
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    stop_text: StopText = StopText.CUT  # where the text ends at a stop sequence
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: end the choice as EOS does
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # TGI decoder_input_details / OpenAI echo with logprobs
    constraint: ConstraintSpec | None = None  # constrained decoding: compiled by the engine core
    skip_special_tokens: bool = True  # False: control tokens stay in the text (a tool-call marker)
    adapter: str | None = None  # the LoRA adapter's name (OpenAI `model`, TGI `adapter_id`); None: the base model

    @property
    def n(self) -> int:
        return len(self.choices)


@dataclass(slots=True)
class GeneratedToken:
    token_id: int
    text: str  # the text this token adds to the output ("" while a character's bytes are incomplete)
    logprob: float
    special: bool
    top_tokens: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceEvent:
    """One step's news for one choice.

    `text` is the output text that became final with this token: the
    incremental detokenizer holds back incomplete UTF-8 and any tail that could
    still grow into a stop sequence, and a matched stop sequence is cut.
    """

    index: int  # which choice (0..n-1)
    token: GeneratedToken
    text: str
    finish_reason: FinishReason | None = None
    num_generated: int = 0  # tokens generated so far by this choice


@dataclass(slots=True)
class PromptInfo:
    """Known once the prompt was prefilled; read by the API for usage/details."""

    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] = field(default_factory=list)  # None for the first token
    # With top_n_tokens: the alternatives at each prompt position (None where its logprob is None)
    prompt_top_tokens: list[list[TokenLogprob] | None] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's counters and gauges, read by the metrics collector at scrape time."""

    num_waiting: int = 0
    num_running: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_cached: int = 0  # free but holding a reusable prefix
    prompt_tokens_computed: int = 0  # counters from here on
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swapped_bytes: int = 0
    steps: int = 0
    steps_planned_ahead: int = 0  # --overlap-steps: of them, planned and sent while the step before ran
    spec_draft_tokens: int = 0  # --speculate: drafted tokens verified, and those kept
    spec_accepted_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason / "cancelled" / "error"
    num_host_blocks_total: int = 0  # the host-RAM swap pool
    num_host_blocks_used: int = 0
    block_size: int = 0
    max_batch_total_tokens: int = 0
    shard_healthy: list[bool] = field(default_factory=list)  # by rank, as the last health check saw it
    adapter_requests: dict[str, int] = field(default_factory=dict)  # LoRA adapter name -> requests admitted
    adapter_prompt_tokens: dict[str, int] = field(default_factory=dict)  # -> their prompt tokens
    adapter_generated_tokens: dict[str, int] = field(default_factory=dict)  # -> tokens generated with it


@dataclass(slots=True)
class StepRecord:
    """One engine step as the metrics see it (handed to `Engine.step_observers`)."""

    method: str  # "prefill" when the step computed prompt tokens, else "decode" (TGI's label)
    ok: bool
    duration_s: float  # as the router waited for it
    forward_s: float | None  # rank 0's forward pass, None when the step failed
    rank_total_s: list[float] = field(default_factory=list)  # each rank's whole step
    idle_s: float | None = None  # rank 0's wait for the step while the router had work (StepResult.idle_ms)


class ValidationError(ValueError):
    """The request cannot be served as asked (HTTP 422)."""


class BadRequestError(ValueError):
    """The request asks for something that cannot be done, e.g. a bad LoRA adapter (HTTP 400)."""


class NotFoundError(LookupError):
    """The request names a model or adapter that is not served (HTTP 404)."""


class OverloadedError(RuntimeError):
    """Too many requests in flight (HTTP 429)."""


class ShardDivergence(Exception):
    """The ranks of a tensor-parallel group ended a step differently (some ran it, some failed
    or never answered): their KV and request state may differ, so no later step is safe."""


class GenerationError(RuntimeError):
    """The shards failed while generating (HTTP 424)."""


class UnavailableError(GenerationError):
    """A shard is down: the request cannot run here (HTTP 503; retry on another replica)."""


def shutting_down() -> UnavailableError:
    """What a draining server answers a new request, in the engine core and in a frontend alike."""
    return UnavailableError("the server is shutting down; retry on another replica")


class APIError(ValidationError):
    """A refusal of an API's own, with its status and machine-readable `code` (OpenAI's
    model_not_found, context_length_exceeded); 422 where an API has no shape for it."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


class SnapshotHTTPError(Exception):
    """A snapshot operation failed: its HTTP status, message and error_type (the body's)."""

    def __init__(self, status: int, message: str, error_type: str = "snapshot") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


# The engine's errors and the HTTP status each maps to (a subclass's entry wins over its base's).
ERROR_STATUS: dict[type[Exception], int] = {
    ValidationError: 422, OverloadedError: 429, GenerationError: 424, UnavailableError: 503,
    BadRequestError: 400, NotFoundError: 404,
}


def status_of(error: Exception) -> int:
    """The HTTP status of an engine error (how the core tells a frontend which one it was)."""
    for kind in type(error).__mro__:
        if kind in ERROR_STATUS:
            return ERROR_STATUS[kind]
    return 500


# What a client should not read of a server-side failure: source locations and files ("[/pytorch/
# .../pair.cc:534]", "/tmp/loom-shard-0.sock") and peer addresses ("[10.0.0.5]:29500").
_INTERNALS = re.compile(r"(?:\b(?:unix|ipv4|ipv6):)?(?:\[?(?<![\w/])(?:/[\w.\-]+){2,}(?::\d+)?\]?"
                        r"|\[?\b\d{1,3}(?:\.\d{1,3}){3}\b\]?(?::\d+)?|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\](?::\d+)?)")


def client_text(error: object) -> str:
    """A failure's text for a client: its first line without file paths or peer addresses (the
    server log keeps the whole text)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return re.sub(r" {2,}", " ", re.sub(r":\s*:", ":", _INTERNALS.sub("", first))).strip()


def error_for_status(status: int, message: str) -> Exception:
    """The engine error a status stands for, with the core's message (the inverse of status_of)."""
    kinds = {code: kind for kind, code in ERROR_STATUS.items()}
    return kinds.get(status, GenerationError)(message)
