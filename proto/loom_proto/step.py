"""The step contract between router and shard, as plain dataclasses.

The router's scheduler builds a `StepPlan`; every shard executes it and answers
a `StepResult`. `loom_proto.codec` converts these to and from protobuf at the
gRPC edges, so both sides (and the fake shard in tests) program against this.

A sequence's tokens, and what one step computes of them:

    token_ids:  [ t0 t1 t2 t3 t4 t5 t6 t7 t8 ]
                  <- num_cached -> <- compute ->
                  (KV in blocks)   (this step)

The shard samples a token for a sequence only when the step computes up to the
end of its known tokens (`num_cached + num_compute == len(token_ids)`); a
prefill chunk that stops earlier just fills the cache.

Speculative decoding (prompt lookup): a decoding `RunningRequest` may carry
`draft_token_ids`, k tokens guessed to follow its last sampled token. The step then
computes that token plus the k drafts (num_compute == 1 + k) and the shard samples
at every one of those positions, position j as if drafts[:j] had been sampled
(its generated-token index, penalties and seed draw follow). Both sides then keep
the drafts that equal the sample before them plus the first sample that differs
(`accepted_drafts`): the tokens plain decoding would have produced. The KV of the
rejected drafts is garbage that later steps overwrite; both sides advance
num_cached by 1 + accepted and cut the block table to the blocks covering the
known tokens (`blocks_after_verify`), so block tables stay equal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How one sequence picks its next token. `None` means the filter is off.

    Greedy when `do_sample` is False (penalties and logit bias still apply).
    Token i of the sequence's generated tokens is drawn from a generator
    seeded by (seed, i), so a seed gives the same tokens whatever else shares
    the batch and across preemption.
    """

    seed: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None  # HF-style: over prompt and generated tokens
    frequency_penalty: float = 0.0  # OpenAI-style: over generated tokens only
    presence_penalty: float = 0.0  # OpenAI-style: over generated tokens only
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_n_tokens: int = 0  # alternatives to return with each sampled token
    min_new_tokens: int = 0  # EOS ids are masked until this many tokens were generated
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Fork:
    """A sibling created from a request's prompt once its prefill completes (`n` > 1).

    It shares the parent's full prompt blocks; the shard copies the parent's
    partly filled last block into the sibling's own last block (this is the only
    block copy in the protocol: it can run only after the forward that fills that
    block), then samples the sibling's first token from the same final prompt
    logits with its own params.
    """

    request_id: int
    sampling: SamplingParams
    block_table: list[int]


class Pooling(enum.Enum):
    """How an embedding request's final hidden states become one vector (proto `Pooling`)."""

    NONE = 0  # not an embedding request: generate
    LAST = 1  # the last prompt token's hidden state, after the final norm
    MEAN = 2  # the mean over every prompt token (never served from the prefix cache)


@dataclass(slots=True)
class NewRequest:
    """A request the shard has no state for: sent in full, once."""

    request_id: int
    token_ids: list[int]  # every known token: the prompt, plus generated ones on resume
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt
    num_cached: int  # tokens whose KV is already in the blocks (prefix cache, swap-in)
    num_compute: int  # tokens to compute this step, from num_cached on
    block_table: list[int]  # covers at least num_cached + num_compute tokens
    sampling: SamplingParams
    prompt_logprobs: bool = False  # return the logprob of every computed prompt token
    forks: list[Fork] = field(default_factory=list)
    lora_id: int | None = None  # the LoRA adapter its tokens run with; None: the base model
    pooling: Pooling = Pooling.NONE  # else an embedding request: SeqOutput.embedding, nothing sampled


@dataclass(slots=True)
class RunningRequest:
    """A request the shard already holds: only what changed."""

    request_id: int
    num_compute: int  # next prefill chunk, or 1 to decode the last sampled token
    new_block_ids: list[int] = field(default_factory=list)  # appended to its block table
    forks: list[Fork] = field(default_factory=list)  # when this chunk completes a prompt sent earlier
    # Speculative decoding: tokens guessed to follow the last sampled one (num_compute == 1 + len).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def plain_decode(self) -> bool:
        """One token to decode and nothing else (it travels in StepPlan's decode_ids column)."""
        return self.num_compute == 1 and not (self.new_block_ids or self.forks or self.draft_token_ids)


@dataclass(slots=True)
class StepPlan:
    """One step. Block operations run first, in this order, then the forward."""

    new_requests: list[NewRequest] = field(default_factory=list)
    running_requests: list[RunningRequest] = field(default_factory=list)
    released_ids: list[int] = field(default_factory=list)  # drop their shard state first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Constrained sequences: request id -> packed int32 bitmask of the tokens it may sample
    # (bit t % 32 of little-endian word t // 32; ids past the end are disallowed).
    allowed_token_masks: dict[int, bytes] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.running_requests)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class TokenSample:
    """A token sampled at one drafted position (speculative decoding)."""

    token_id: int
    logprob: float
    top_tokens: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class SeqOutput:
    """What a step produced for one sequence."""

    request_id: int
    token_id: int | None  # None: a prefill chunk that did not reach the end
    logprob: float | None
    top_tokens: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # for computed prompt positions >= 1
    # With draft_token_ids: the sample after each draft, in order (one per draft). token_id is the
    # sample before the first draft; samples after the first rejected draft mean nothing.
    draft_samples: list[TokenSample] = field(default_factory=list)
    # With prompt_logprobs and top_n_tokens: the alternatives at each position of prompt_logprobs.
    prompt_top_tokens: list[list[TokenLogprob]] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's pooled vector, once its prompt is computed


def accepted_drafts(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many leading drafts a verify step accepts: draft j stands while it equals the token
    sampled at the position before it (sampled_token_ids[j]). The tokens kept are
    sampled_token_ids[:accepted + 1]: the accepted drafts and one more, the first sample that
    differed (or the sample after the last draft when every draft stood)."""
    accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids):
        if draft != sampled:
            break
        accepted += 1
    return accepted


def blocks_after_verify(num_tokens: int, num_blocks: int, block_size: int, num_groups: int = 1) -> int:
    """The block-table entries a sequence keeps after a verify step that left it with num_tokens
    known tokens: those covering them (its next step's writes), one per KV group for each logical
    block; blocks only rejected drafts reached go back."""
    return min(num_blocks, -(-num_tokens // block_size) * num_groups)


@dataclass(slots=True)
class StepResult:
    outputs: list[SeqOutput]
    forward_ms: float
    total_ms: float
    idle_ms: float = 0.0  # the shard's worker idle before this step, since its previous step ended


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The shard's model fingerprint: what a snapshot or a router must agree with."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    weights_hash: str
    device: str
    block_size: int
    rank: int
    world_size: int
    quantization: str = "none"  # weights kept quantized (--quantize auto), e.g. "Q4_1 x120, Q8_0 x1 (loom kernels)"
    cpu_kernels: str = ""  # CPU: the kernels build in use and why, e.g. "avx512 (...)"; "" on GPUs
    # One entry per KV group: the window of its layers (None: full attention). One group holds
    # every layer unless the model has sliding-window layers.
    kv_group_windows: tuple[int | None, ...] = (None,)

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_group_windows)


@dataclass(slots=True, frozen=True)
class WarmupResult:
    num_blocks: int  # device KV blocks available to the router's block manager
    num_host_blocks: int  # host-RAM swap pool size in blocks
    block_size: int
