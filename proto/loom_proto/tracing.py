"""What router and shards agree on for OpenTelemetry tracing (`--otlp-endpoint`): the span and
attribute names, how a step's work is counted, and where the trace context travels.

The router's `step` span is the parent of each rank's `shard.step` span: its context crosses
the gRPC call as W3C `traceparent` metadata, injected and extracted by OpenTelemetry's
propagator (no SDK import here: this module is the contract only).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom_proto.step import StepPlan

TRACES_PATH = "/v1/traces"

ROUTER_STEP_SPAN = "step"
SHARD_STEP_SPAN = "shard.step"
SHARD_PREPARE_SPAN = "shard.prepare"  # plan check, releases, swaps, admission
SHARD_FORWARD_SPAN = "shard.forward"  # the model's forward and the logits
SHARD_SAMPLE_SPAN = "shard.sample"  # prompt logprobs, sampling, forks
SHARD_SNAPSHOT_SPAN_PREFIX = "shard.snapshot."  # + save / load / fill / commit

# The router's request ids (a request's `request_id`, as in its `generate` span and log line).
ATTR_REQUEST_IDS = "loom.request_ids"
ATTR_RANK = "loom.rank"
ATTR_NUM_SEQUENCES = "loom.num_sequences"
ATTR_PREFILL_TOKENS = "loom.prefill_tokens"
ATTR_DECODE_TOKENS = "loom.decode_tokens"
ATTR_SNAPSHOT_STATUS = "loom.snapshot.status"


def traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces` (a full URL stays)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


@dataclass(slots=True, frozen=True)
class StepCounts:
    """A step's work: a sequence computing one token of a running request decodes; every
    other computed token is prefill (a new request, a chunk, a recompute after preemption)."""

    num_sequences: int
    prefill_tokens: int
    decode_tokens: int

    @classmethod
    def of(cls, plan: StepPlan) -> StepCounts:
        prefill = sum(new.num_compute for new in plan.new_requests)
        decode = 0
        for running in plan.running_requests:
            if running.num_compute == 1:
                decode += 1
            else:
                prefill += running.num_compute
        return cls(plan.num_requests, prefill, decode)

    def attributes(self) -> dict[str, int]:
        return {ATTR_NUM_SEQUENCES: self.num_sequences, ATTR_PREFILL_TOKENS: self.prefill_tokens,
                ATTR_DECODE_TOKENS: self.decode_tokens}
