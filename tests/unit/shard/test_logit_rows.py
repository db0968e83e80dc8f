"""Which rows of a step's hidden states get logits: every mix of prefill chunks, prompt logprobs,
decodes, drafts and embedding requests, against the rule written out once, position by position."""

from __future__ import annotations

import random

from loom_proto.step import Pooling, SamplingParams
from loom_shard.runtime.requests import RequestState, Scheduled, logit_rows


def expected_rows(scheduled: list[Scheduled]) -> tuple[list[int], list[int | None], list[list[int]]]:
    """Token by token: position q of a chunk scores token q + 1 while that is a prompt token (with
    prompt logprobs); a chunk that reaches the end samples from its last token, after each of its
    drafts' positions (embedding requests sample nothing)."""
    rows: list[int] = []
    sample_rows: list[int | None] = []
    logprob_rows: list[list[int]] = []
    offset = 0
    for s in scheduled:
        state = s.state
        scored = [q for q in range(state.num_computed, state.num_computed + s.num_compute)
                  if state.prompt_logprobs and q + 1 < state.num_prompt_tokens]
        logprob_rows.append([len(rows) + i for i in range(len(scored))])
        rows += [offset + q - state.num_computed for q in scored]
        reaches_end = state.num_computed + s.num_compute == len(state.token_ids)
        if reaches_end and state.pooling is Pooling.NONE:
            sample_rows.append(len(rows))
            rows += [offset + s.num_compute - 1 - d for d in range(s.num_drafts, -1, -1)]
        else:
            sample_rows.append(None)
        offset += s.num_compute
    return rows, sample_rows, logprob_rows


def random_scheduled(rng: random.Random, request_id: int) -> Scheduled:
    num_prompt = rng.randint(1, 6)
    num_tokens = num_prompt + rng.randint(0, 4)
    num_drafts = rng.choice([0, 0, 1, 2]) if num_tokens > num_prompt else 0
    token_ids = list(range(num_tokens + num_drafts))  # drafts are appended before the step runs
    if num_drafts:
        num_computed, num_compute = num_tokens - 1, 1 + num_drafts
    else:
        num_computed = rng.randint(0, len(token_ids) - 1)
        num_compute = rng.randint(1, len(token_ids) - num_computed)
    state = RequestState(request_id, token_ids, num_prompt, num_computed, [0], SamplingParams(seed=0),
                         prompt_logprobs=rng.random() < 0.5,
                         pooling=Pooling.LAST if rng.random() < 0.1 else Pooling.NONE)
    return Scheduled(state, num_compute, num_drafts)


def test_every_mix_of_chunks_gets_the_rows_the_rule_gives() -> None:
    rng = random.Random(0)
    for trial in range(2000):
        scheduled = [random_scheduled(rng, i) for i in range(rng.randint(1, 8))]
        assert logit_rows(scheduled) == expected_rows(scheduled), trial


def test_a_batch_of_decodes_samples_one_row_each() -> None:
    scheduled = [Scheduled(RequestState(i, [1, 2, 3, 4], 3, 3, [0], SamplingParams(seed=0), prompt_logprobs=True), 1)
                 for i in range(4)]
    assert logit_rows(scheduled) == ([0, 1, 2, 3], [0, 1, 2, 3], [[], [], [], []])
