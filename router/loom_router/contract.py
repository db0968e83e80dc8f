"""The contract between the frontends and the engine core, as proto/ is between router and shards:
every message they exchange, as msgspec structs in MessagePack (no pickle), over ZeroMQ on unix
sockets. Each frontend PUSHes to the core's one PULL socket; the core PUSHes to each frontend's.

    frontend ─ Hello ─────────────────▶ core ─ Welcome (model, limits, status)
             ─ Submit ────────────────▶      ─ Admitted | Refused        (in order, per frontend)
             ─ Cancel, StopChoice ────▶
             ─ Call (health, metrics, snapshots) ─ Reply
                                       ◀──── Batch: about one per step: every output of that
                                             frontend's requests, failures, status changes

A frontend that falls behind gets fewer, larger batches (the core merges what it could not send
yet), never a dropped or reordered token. Times are time.monotonic() (CLOCK_MONOTONIC, one clock
for every process of a host).
"""

from __future__ import annotations

from typing import Any

import msgspec

from loom_proto.step import ModelInfo, SamplingParams
from loom_router.types import ValidationError

ENGINE_SOCKET = "engine.sock"  # the core's PULL socket, in the router's private folder


def frontend_socket(index: int) -> str:
    return f"frontend-{index}.sock"


# ---- frontend -> core ---------------------------------------------------------------------


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """A structured-output constraint as the API asked for it (loom_router.structured.spec)."""

    kind: str
    source: str


class Hello(msgspec.Struct, tag=True, array_like=True):
    frontend: int
    pid: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    """A validated, tokenized request; `choices[i]` is how choice i samples."""

    frontend: int
    ticket: int  # the frontend's own number for it, until Admitted gives the group id
    prompt_ids: list[int]
    choices: list[SamplingParams]
    max_new_tokens: int
    ignore_eos: bool = False
    prompt_logprobs: bool = False
    constraint: Constraint | None = None
    adapter: str | None = None  # a LoRA adapter's name; None: the base model
    pooling: int = 0  # loom_proto.step.Pooling's value: an embedding request unless 0 (NONE)
    stop_token_ids: list[int] = []  # they end a choice as EOS does, even with ignore_eos


class Cancel(msgspec.Struct, tag=True, array_like=True):
    group_ids: list[int]
    outcome: str = "cancelled"  # or "error" (a drain that ran out of time), for the counters


class StopChoice(msgspec.Struct, tag=True, array_like=True):
    """A stop string ended choice `index` at its `num_generated`-th token: stop computing it."""

    group_id: int
    index: int
    num_generated: int


class Call(msgspec.Struct, tag=True, array_like=True):
    """A request for one answer (Reply with the same call_id)."""

    frontend: int
    call_id: int
    # "health", "metrics", "snapshot_save", "snapshot_restore", "snapshot_delete", "snapshot_list",
    # "response_put", "response_get", "response_delete" (the Responses API's stored responses);
    # "lora_load" (name, path), "lora_unload" (name), "lora_list"
    method: str
    name: str = ""
    token_ids: list[int] = []
    payload: bytes = b""  # response_put: the record to store
    path: str = ""
    adapter: str | None = None  # snapshot_save: the LoRA adapter whose KV to save; None: the base model


ToCore = Hello | Submit | Cancel | StopChoice | Call


# ---- core -> frontend ---------------------------------------------------------------------


class Limits(msgspec.Struct, frozen=True, array_like=True):
    """What a request is checked against: the same answer on both sides (`check_lengths`)."""

    max_total_tokens: int
    max_input_tokens: int
    max_batch_total_tokens: int
    max_batch_prefill_tokens: int
    block_size: int
    num_usable_blocks: int
    max_num_seqs: int
    num_kv_groups: int = 1  # a block of tokens takes one block of each group


class Status(msgspec.Struct, tag=True, array_like=True):
    """Whether the core takes new requests: warmed up, not draining, loop alive, shards up."""

    accepting: bool
    draining: bool = False
    reason: str = ""


class Welcome(msgspec.Struct, tag=True, array_like=True):
    model_info: ModelInfo
    limits: Limits
    status: Status


class Admitted(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    group_id: int


class Refused(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    status: int  # the HTTP status the frontend answers: 422, 429, 503, 424
    message: str


class PromptInfo(msgspec.Struct, array_like=True):
    """Known once the prompt was prefilled: sent with a request's first token."""

    num_cached_tokens: int
    prompt_logprobs: list[float | None]
    scheduled_at: float  # the first step that ran it (TGI's queue time ends there)
    # With prompt logprobs and top_n_tokens: (token id, logprob) alternatives per prompt position
    # (None where prompt_logprobs has None).
    prompt_top_tokens: list[list[tuple[int, float]] | None] = []


class Output(msgspec.Struct, array_like=True):
    """New tokens of one choice, in order (several when a step verified drafts, or when the core
    merged steps its frontend had not taken yet)."""

    group_id: int
    index: int
    token_ids: list[int]
    logprobs: list[float]
    num_generated: int  # of the choice, counting the last of token_ids
    finish: str | None = None  # "length" or "eos_token": the core ended the choice with the last token
    top_tokens: list[list[tuple[int, float]]] | None = None  # per token, when asked for
    prompt: PromptInfo | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (it then has no token)


class Failure(msgspec.Struct, array_like=True):
    """The request ended without finishing: its stream ends with this error."""

    group_id: int
    status: int  # 424 (generation), 503 (a shard down)
    message: str


class Batch(msgspec.Struct, tag=True, array_like=True):
    outputs: list[Output] = []
    failures: list[Failure] = []
    status: Status | None = None


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None  # the call failed; `status` and `error_type` say how
    status: int = 500
    error_type: str = ""


ToFrontend = Welcome | Admitted | Refused | Batch | Reply


# ---- both sides --------------------------------------------------------------------------

to_core_decoder = msgspec.msgpack.Decoder(ToCore)
to_frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)
encoder = msgspec.msgpack.Encoder()


def check_lengths(limits: Limits, num_input_tokens: int, max_new_tokens: int | None, n: int) -> int:
    """Check a request's lengths against the limits; returns its max_new_tokens (unset: the
    whole rest of the context). Raises ValidationError (HTTP 422)."""
    if num_input_tokens == 0:
        raise ValidationError("Input validation error: `inputs` cannot be empty")
    if num_input_tokens > limits.max_input_tokens:
        raise ValidationError(f"Input validation error: `inputs` must have less than {limits.max_input_tokens + 1} "
                          f"tokens. Given: {num_input_tokens}")
    if max_new_tokens is None:
        max_new_tokens = limits.max_total_tokens - num_input_tokens
    if max_new_tokens <= 0:
        raise ValidationError(f"Input validation error: `max_new_tokens` must be strictly positive. "
                          f"Given: {max_new_tokens}")
    if num_input_tokens + max_new_tokens > limits.max_total_tokens:
        raise ValidationError(
            f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {num_input_tokens} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
    # Conservative: the n choices are counted as if they shared no prompt block.
    blocks = n * -(-(num_input_tokens + max_new_tokens) // limits.block_size) * limits.num_kv_groups
    if n > limits.max_num_seqs or blocks > limits.num_usable_blocks:
        raise ValidationError(
            f"Input validation error: {n} sequence(s) of {num_input_tokens} + {max_new_tokens} tokens "
            f"cannot fit in the KV cache ({limits.max_batch_total_tokens} tokens) even alone")
    return max_new_tokens
