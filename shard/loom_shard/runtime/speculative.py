"""Verifying drafted tokens on the shard (speculative decoding; see loom_proto.step).

A verify step computes a sequence's last sampled token plus its k drafts as one chunk
and samples at each of those k + 1 positions with the ordinary sampler. Position j is
sampled as if drafts[:j] had been sampled: its history (penalties) and its generated-token
index (the seeded draw, min_new_tokens) are those plain decoding would have there, so the
kept tokens are exactly plain decoding's whenever the drafts before them stood. Batch
invariance of the forward makes the logits at those positions equal to a one-token step's.
"""

from __future__ import annotations

from loom_proto.step import TokenSample, accepted_drafts, blocks_after_verify
from loom_shard.runtime.requests import RequestState
from loom_shard.runtime.sampler import Sample, SeqSamplingState


def sampling_states(state: RequestState, num_drafts: int, mask: bytes | None) -> list[SeqSamplingState]:
    """One sampling state per verified position; state.token_ids ends with the num_drafts drafts."""
    if num_drafts == 0:
        return [SeqSamplingState(state.sampling, state.token_ids, state.num_prompt_tokens, mask)]
    base = len(state.token_ids) - num_drafts  # the tokens before the first draft
    return [SeqSamplingState(state.sampling, state.token_ids[: base + j], state.num_prompt_tokens, mask)
            for j in range(num_drafts + 1)]


def regroup(samples: list[Sample], counts: list[int]) -> list[list[Sample]]:
    """Split the flat samples of a step back into one list per sequence."""
    groups, start = [], 0
    for count in counts:
        groups.append(samples[start : start + count])
        start += count
    return groups


def draft_samples(samples: list[Sample]) -> list[TokenSample]:
    """The samples after each draft (the first sample travels in SeqOutput.token_id)."""
    return [TokenSample(s.token_id, s.logprob, list(s.top_tokens)) for s in samples[1:]]


def commit(state: RequestState, num_drafts: int, samples: list[Sample], block_size: int, num_groups: int = 1) -> None:
    """Keep the sampled tokens plain decoding would have produced.

    Before: state.num_computed counts the last sampled token (computed by this step) and
    token_ids ends with the drafts. After: the accepted drafts' KV counts as computed, the
    kept samples replace the drafts, and blocks only rejected drafts reached are dropped
    (the router frees the same ones).
    """
    if num_drafts == 0:
        state.token_ids.append(samples[0].token_id)
        return
    base = len(state.token_ids) - num_drafts
    drafts = state.token_ids[base:]
    sampled = [s.token_id for s in samples]
    accepted = accepted_drafts(drafts, sampled)
    del state.token_ids[base:]
    state.token_ids.extend(sampled[: accepted + 1])
    state.num_computed += accepted
    del state.block_table[blocks_after_verify(len(state.token_ids), len(state.block_table), block_size, num_groups):]
