"""Protobuf <-> dataclass conversion for the shard protocol, used only at the gRPC edges.

`to_pb(obj)` turns any dataclass of loom_proto.step into its message;
`from_pb(msg)` turns a message back. Optional proto fields carry the `None`s.
Snapshot replies carry a status enum, mapped by name (`SNAPSHOT_<NAME>` <-> `SnapshotStatus.<NAME>`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from functools import singledispatch
from typing import Any

try:
    from loom_proto import shard_pb2 as pb
except ImportError as error:  # the stubs are generated, never committed
    raise ImportError(
        f"Loom's protobuf stubs are missing or broken ({error}): run `python proto/generate.py` (make does it)"
    ) from error

from loom_proto.snapshot import Manifest, SnapshotEntry, SnapshotError, SnapshotReply, SnapshotStatus
from loom_proto.step import (
    Fork,
    ModelInfo,
    NewRequest,
    Pooling,
    RunningRequest,
    SamplingParams,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenLogprob,
    TokenSample,
    WarmupResult,
)

__all__ = ["from_pb", "pb", "snapshot_reply_from_pb", "snapshot_status_to_pb", "to_pb", "unencodable_requests"]

_OPTIONAL_SAMPLING = ("top_k", "top_p", "typical_p", "min_p", "repetition_penalty")


@singledispatch
def to_pb(obj: Any) -> Any:
    """The protobuf message for a step dataclass."""
    raise TypeError(f"no protobuf message for {type(obj).__name__}")


# Dataclasses whose message has exactly their scalar fields: copied field by field.
_FLAT_MESSAGES: dict[type, Any] = {TokenLogprob: pb.TokenLogprob, WarmupResult: pb.WarmupResult}


def _flat_to_pb(obj: Any) -> Any:
    return _FLAT_MESSAGES[type(obj)](**{f.name: getattr(obj, f.name) for f in fields(obj)})


def _flat_from_pb(cls: type) -> Callable[[Any], Any]:
    return lambda msg: cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


for _cls in _FLAT_MESSAGES:
    to_pb.register(_cls, _flat_to_pb)


_INFO_SCALARS = tuple(f.name for f in fields(ModelInfo) if f.name != "kv_group_windows")


@to_pb.register
def _model_info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    groups = [pb.KVGroupWindow(window=window) for window in info.kv_group_windows]  # None leaves it unset
    return pb.ModelInfo(**{name: getattr(info, name) for name in _INFO_SCALARS}, kv_group_windows=groups)


def _model_info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    windows = tuple(_optional(g, "window") for g in m.kv_group_windows) or (None,)  # an older shard: one group
    return ModelInfo(**{name: getattr(m, name) for name in _INFO_SCALARS}, kv_group_windows=windows)


@to_pb.register
def _sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        seed=p.seed,
        do_sample=p.do_sample,
        temperature=p.temperature,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logit_bias=p.logit_bias,
        top_n_tokens=p.top_n_tokens,
        min_new_tokens=p.min_new_tokens,
        eos_token_ids=p.eos_token_ids,
    )
    for name in _OPTIONAL_SAMPLING:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


@to_pb.register
def _fork_to_pb(f: Fork) -> pb.Fork:
    return pb.Fork(request_id=f.request_id, sampling=to_pb(f.sampling), block_table=f.block_table)


@to_pb.register
def _new_request_to_pb(r: NewRequest) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=r.request_id,
        token_ids=r.token_ids,
        num_prompt_tokens=r.num_prompt_tokens,
        num_cached=r.num_cached,
        num_compute=r.num_compute,
        block_table=r.block_table,
        sampling=to_pb(r.sampling),
        prompt_logprobs=r.prompt_logprobs,
        forks=[_fork_to_pb(f) for f in r.forks],
        lora_id=r.lora_id,
        pooling=r.pooling.value,
    )


@to_pb.register
def _running_request_to_pb(r: RunningRequest) -> pb.RunningRequest:
    return pb.RunningRequest(
        request_id=r.request_id,
        num_compute=r.num_compute,
        new_block_ids=r.new_block_ids,
        forks=[_fork_to_pb(f) for f in r.forks],
        draft_token_ids=r.draft_token_ids,
    )


def _pairs_to_pb(pairs: Iterable[tuple[int, int]]) -> list[pb.BlockPair]:
    return [pb.BlockPair(src=src, dst=dst) for src, dst in pairs]


@to_pb.register
def _plan_to_pb(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(
        new_requests=[to_pb(r) for r in plan.new_requests],
        running_requests=[_running_request_to_pb(r) for r in plan.running_requests if not r.plain_decode],
        released_ids=plan.released_ids,
        swap_out=_pairs_to_pb(plan.swap_out),
        swap_in=_pairs_to_pb(plan.swap_in),
        allowed_token_masks=plan.allowed_token_masks,
        decode_ids=[r.request_id for r in plan.running_requests if r.plain_decode],
    )


def unencodable_requests(plan: StepPlan) -> dict[int, str]:
    """The plan's requests whose messages protobuf cannot build (a value out of its field's
    range), by request id, each with the reason. Only what a request brought (a new request
    in full, the sampling of a fork) can be at fault; the rest is the router's own counting."""
    bad: dict[int, str] = {}
    parts: list[tuple[int, Any]] = [(r.request_id, r) for r in plan.new_requests]
    parts += [(r.request_id, fork) for r in plan.running_requests for fork in r.forks]
    for request_id, part in parts:
        try:
            to_pb(part)
        except (ValueError, TypeError) as error:
            bad.setdefault(request_id, str(error))
    return bad


@to_pb.register
def _seq_output_to_pb(o: SeqOutput) -> pb.SeqOutput:
    # proto3 `optional`: passing None to the constructor leaves the field unset.
    return pb.SeqOutput(
        request_id=o.request_id,
        token_id=o.token_id,
        logprob=o.logprob,
        top_tokens=[_flat_to_pb(t) for t in o.top_tokens],
        prompt_logprobs=o.prompt_logprobs,
        draft_samples=[pb.TokenSample(token_id=d.token_id, logprob=d.logprob,
                                      top_tokens=[_flat_to_pb(t) for t in d.top_tokens])
                       for d in o.draft_samples],
        prompt_top_tokens=[pb.TokenList(tokens=[_flat_to_pb(t) for t in top]) for top in o.prompt_top_tokens],
        embedding=o.embedding,
    )


def _sampled_only(o: SeqOutput) -> bool:
    """Is the output one sampled token and its log-probability, nothing else (a plain decode)?"""
    return o.token_id is not None and o.logprob is not None and not (
        o.top_tokens or o.prompt_logprobs or o.draft_samples or o.prompt_top_tokens or o.embedding is not None)


@to_pb.register
def _step_result_to_pb(r: StepResult) -> pb.StepResult:
    sampled: list[SeqOutput] = []
    others: list[SeqOutput] = []
    for o in r.outputs:
        (sampled if _sampled_only(o) else others).append(o)
    return pb.StepResult(
        outputs=[_seq_output_to_pb(o) for o in others],
        forward_ms=r.forward_ms,
        total_ms=r.total_ms,
        idle_ms=r.idle_ms,
        sampled_request_ids=[o.request_id for o in sampled],
        sampled_token_ids=[o.token_id for o in sampled],
        sampled_logprobs=[o.logprob for o in sampled],
    )


def _optional(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        seed=m.seed,
        do_sample=m.do_sample,
        temperature=m.temperature,
        top_k=_optional(m, "top_k"),
        top_p=_optional(m, "top_p"),
        typical_p=_optional(m, "typical_p"),
        min_p=_optional(m, "min_p"),
        repetition_penalty=_optional(m, "repetition_penalty"),
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
        logit_bias=dict(m.logit_bias),
        top_n_tokens=m.top_n_tokens,
        min_new_tokens=m.min_new_tokens,
        eos_token_ids=tuple(m.eos_token_ids),
    )


def _fork_from_pb(m: pb.Fork) -> Fork:
    return Fork(request_id=m.request_id, sampling=_sampling_from_pb(m.sampling), block_table=list(m.block_table))


def _new_request_from_pb(m: pb.NewRequest) -> NewRequest:
    return NewRequest(
        request_id=m.request_id,
        token_ids=list(m.token_ids),
        num_prompt_tokens=m.num_prompt_tokens,
        num_cached=m.num_cached,
        num_compute=m.num_compute,
        block_table=list(m.block_table),
        sampling=_sampling_from_pb(m.sampling),
        prompt_logprobs=m.prompt_logprobs,
        forks=[_fork_from_pb(f) for f in m.forks],
        lora_id=_optional(m, "lora_id"),
        pooling=Pooling(m.pooling),
    )


def _running_request_from_pb(m: pb.RunningRequest) -> RunningRequest:
    return RunningRequest(
        request_id=m.request_id,
        num_compute=m.num_compute,
        new_block_ids=list(m.new_block_ids),
        forks=[_fork_from_pb(f) for f in m.forks],
        draft_token_ids=list(m.draft_token_ids),
    )


def _pairs_from_pb(pairs: Iterable[pb.BlockPair]) -> list[tuple[int, int]]:
    return [(p.src, p.dst) for p in pairs]


def _plan_from_pb(m: pb.StepPlan) -> StepPlan:
    """The running requests' messages first, then the decode_ids column's."""
    running = [_running_request_from_pb(r) for r in m.running_requests]
    running += [RunningRequest(request_id, 1) for request_id in m.decode_ids]
    return StepPlan(
        new_requests=[_new_request_from_pb(r) for r in m.new_requests],
        running_requests=running,
        released_ids=list(m.released_ids),
        swap_out=_pairs_from_pb(m.swap_out),
        swap_in=_pairs_from_pb(m.swap_in),
        allowed_token_masks=dict(m.allowed_token_masks),
    )


def _seq_output_from_pb(m: pb.SeqOutput) -> SeqOutput:
    # Once per sequence and step, so every field read counts (each builds a upb wrapper): presence
    # is asked only of a zero (an unset optional reads as 0), empty repeated fields are not copied.
    token_id, logprob = m.token_id, m.logprob
    if token_id == 0 and not m.HasField("token_id"):
        token_id = None
    if logprob == 0.0 and not m.HasField("logprob"):
        logprob = None
    top_tokens, prompt_logprobs, draft_samples = m.top_tokens, m.prompt_logprobs, m.draft_samples
    prompt_top, embedding = m.prompt_top_tokens, m.embedding
    return SeqOutput(
        m.request_id, token_id, logprob,
        [TokenLogprob(t.token_id, t.logprob) for t in top_tokens] if top_tokens else [],
        list(prompt_logprobs) if prompt_logprobs else [],
        [TokenSample(d.token_id, d.logprob, [TokenLogprob(t.token_id, t.logprob) for t in d.top_tokens])
         for d in draft_samples] if draft_samples else [],
        [[TokenLogprob(t.token_id, t.logprob) for t in top.tokens] for top in prompt_top] if prompt_top else [],
        list(embedding) if embedding else None,
    )


def _step_result_from_pb(m: pb.StepResult) -> StepResult:
    """The columns' outputs first, then the messages' (the router finds outputs by request id)."""
    outputs = list(map(SeqOutput, m.sampled_request_ids, m.sampled_token_ids, m.sampled_logprobs))
    if m.outputs:
        outputs += [_seq_output_from_pb(o) for o in m.outputs]
    return StepResult(outputs=outputs, forward_ms=m.forward_ms, total_ms=m.total_ms, idle_ms=m.idle_ms)


_FROM_PB: dict[type, Callable[[Any], Any]] = {
    pb.SamplingParams: _sampling_from_pb,
    pb.Fork: _fork_from_pb,
    pb.NewRequest: _new_request_from_pb,
    pb.RunningRequest: _running_request_from_pb,
    pb.StepPlan: _plan_from_pb,
    pb.TokenLogprob: _flat_from_pb(TokenLogprob),
    pb.SeqOutput: _seq_output_from_pb,
    pb.StepResult: _step_result_from_pb,
    pb.ModelInfo: _model_info_from_pb,
    pb.WarmupResult: _flat_from_pb(WarmupResult),
}


def from_pb(msg: Any) -> Any:
    """The step dataclass for a protobuf message (the inverse of `to_pb`)."""
    convert = _FROM_PB.get(type(msg))
    if convert is None:
        raise TypeError(f"no dataclass for protobuf message {type(msg).__name__}")
    return convert(msg)


# ---- snapshots ------------------------------------------------------------------------------


def snapshot_status_to_pb(status: SnapshotStatus) -> int:
    return pb.SnapshotStatus.Value(f"SNAPSHOT_{status.name}")


def snapshot_status_from_pb(value: int) -> SnapshotStatus:
    return SnapshotStatus[pb.SnapshotStatus.Name(value).removeprefix("SNAPSHOT_")]


def snapshot_reply_from_pb(m: Any) -> SnapshotReply:
    """Any snapshot RPC's answer (fields a message lacks keep their defaults)."""
    reply = SnapshotReply(snapshot_status_from_pb(m.status), m.message)
    if hasattr(m, "num_bytes"):
        reply.num_bytes = m.num_bytes
    if hasattr(m, "token_ids"):
        reply.token_ids = list(m.token_ids)
    return reply


def snapshot_entry_from_pb(m: pb.SnapshotEntry) -> SnapshotEntry:
    """A listed snapshot: its manifest when readable, else the status and message saying why."""
    status = snapshot_status_from_pb(m.status)
    if status is not SnapshotStatus.OK:
        return SnapshotEntry(m.name, None, SnapshotError(status, m.message))
    try:
        return SnapshotEntry(m.name, Manifest.from_json(m.manifest_json, m.name))
    except SnapshotError as error:
        return SnapshotEntry(m.name, None, error)
