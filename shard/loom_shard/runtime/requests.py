"""Each request's state on a shard, from the plan that admits it to its release: its tokens,
how many have their KV in its blocks, its block table and sampling; and what one step schedules
of it, with the rows of the step's logits it reads (samples, drafts, prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom_proto.step import Fork, NewRequest, Pooling, SamplingParams, TokenLogprob
from loom_shard.attention.metadata import SeqSpan

PENDING = -1  # in token_ids: a sampled token whose value is still on the device (PendingToken)


@dataclass(slots=True)
class PendingToken:
    """A sampled token not yet read back from the device: token_ids[index] holds PENDING until its
    step finishes; a next step's input reads it from `values` on the device."""

    values: torch.Tensor  # the step's sampled ids [rows], on the device
    row: int
    index: int


@dataclass(slots=True)
class RequestState:
    request_id: int
    token_ids: list[int]  # prompt, then every sampled token
    num_prompt_tokens: int
    num_computed: int  # tokens whose KV is in the blocks
    block_table: list[int]  # one block per KV group for each logical block (KVGroups.table)
    sampling: SamplingParams
    prompt_logprobs: bool = False
    pending_forks: list[Fork] = field(default_factory=list)  # created when the prompt completes
    lora_id: int | None = None  # its LoRA adapter; None: the base model
    pooling: Pooling = Pooling.NONE  # else an embedding request (nothing sampled)
    pooled_sum: torch.Tensor | None = None  # mean pooling: the sum of its normed hidden states so far
    pending: PendingToken | None = None  # its last token, while the step that sampled it is unfinished


@dataclass(slots=True)
class Scheduled:
    state: RequestState
    num_compute: int
    num_drafts: int = 0  # speculative decoding: the chunk's last num_drafts tokens are guesses

    @property
    def reaches_end(self) -> bool:
        return self.state.num_computed + self.num_compute == len(self.state.token_ids)

    @property
    def span(self) -> SeqSpan:
        return SeqSpan(self.state.num_computed, self.num_compute, self.state.block_table)


def new_request_state(new: NewRequest) -> RequestState:
    return RequestState(
        request_id=new.request_id,
        token_ids=list(new.token_ids),
        num_prompt_tokens=new.num_prompt_tokens,
        num_computed=new.num_cached,
        block_table=list(new.block_table),
        sampling=new.sampling,
        prompt_logprobs=new.prompt_logprobs,
        pending_forks=list(new.forks),
        lora_id=new.lora_id,
        pooling=new.pooling,
    )


def fork_state(parent: RequestState, fork: Fork) -> RequestState:
    """A fork of a parent whose prompt completed: its tokens so far, its own blocks and sampling."""
    return RequestState(
        request_id=fork.request_id,
        token_ids=list(parent.token_ids),
        num_prompt_tokens=parent.num_prompt_tokens,
        num_computed=parent.num_computed,
        block_table=list(fork.block_table),
        sampling=fork.sampling,
        lora_id=parent.lora_id,
    )


def logit_rows(scheduled: list[Scheduled]) -> tuple[list[int], list[int | None], list[list[int]]]:
    """Which flat-batch tokens need logits.

    Returns the token indices to compute, and per sequence the logits row it samples
    from (None when its chunk stops early; with drafts, that row and the next num_drafts)
    and the rows of its prompt logprobs.
    """
    rows: list[int] = []
    sample_rows: list[int | None] = []
    logprob_rows: list[list[int]] = []
    offset = 0
    none = Pooling.NONE
    for s in scheduled:
        state, num_compute = s.state, s.num_compute
        first = state.num_computed
        # Position q's logits score token q + 1: report it while q + 1 is a prompt token.
        num_scored = min(first + num_compute, state.num_prompt_tokens - 1) - first if state.prompt_logprobs else 0
        if num_scored > 0:
            logprob_rows.append(list(range(len(rows), len(rows) + num_scored)))
            rows.extend(range(offset, offset + num_scored))
        else:
            logprob_rows.append([])
        offset += num_compute
        if first + num_compute == len(state.token_ids) and state.pooling is none:  # reaches its end
            sample_rows.append(len(rows))  # its last token's logits, after each of its drafts' before them
            if s.num_drafts:
                rows.extend(range(offset - 1 - s.num_drafts, offset))
            else:
                rows.append(offset - 1)
        else:
            sample_rows.append(None)
    return rows, sample_rows, logprob_rows


def prompt_logprobs(logits: torch.Tensor, scheduled: list[Scheduled],
                    logprob_rows: list[list[int]]) -> tuple[list[list[float]], list[list[list[TokenLogprob]]]]:
    """Per sequence: the logprob of each scored prompt token, and (with top_n_tokens) the
    top_n_tokens alternatives at each of those positions."""
    result: list[list[float]] = []
    tops: list[list[list[TokenLogprob]]] = []
    for s, rows in zip(scheduled, logprob_rows):
        if not rows:
            result.append([])
            tops.append([])
            continue
        first = s.state.num_computed
        targets = torch.tensor(s.state.token_ids[first + 1 : first + 1 + len(rows)], device=logits.device)
        logprobs = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        result.append(logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
        tops.append(_top_tokens(logprobs, s.state.sampling.top_n_tokens))
    return result, tops


def _top_tokens(logprobs: torch.Tensor, k: int) -> list[list[TokenLogprob]]:
    """The k most likely tokens of each row of logprobs; [] when k is 0."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # [rows, k]
    return [[TokenLogprob(int(t), float(v)) for v, t in zip(vs, ts)] for vs, ts in zip(values.tolist(), ids.tolist())]
