"""Speculative decoding without a draft model: prompt lookup (n-gram) drafts, verified in one step.

Each step, a decoding sequence looks up the last n tokens it holds (n from ngram_max down to
ngram_min) earlier in its own tokens (prompt + generated) and drafts the up-to-k tokens that
followed there, as vLLM's ngram proposer, TGI's `--speculate` and llama.cpp's lookup decoding
do. The shard computes the last sampled token plus the drafts as one chunk and samples at every
position; `loom_proto.step.accepted_drafts` keeps the drafts that equal the sample before them
plus one more sample, which is token for token what plain decoding produces (greedy and seeded).

Drafts are extra: they take blocks only beyond what every running sequence needs next step
(never preempting anyone), and only what is left of the step's token budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loom_proto.step import RunningRequest, SeqOutput, accepted_drafts, blocks_after_verify
from loom_router.core.block_manager import BlockManager
from loom_router.core.request import Sequence


@dataclass(slots=True, frozen=True)
class SpeculateConfig:
    num_draft_tokens: int  # k: drafted tokens per step at most
    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self) -> None:
        if self.num_draft_tokens <= 0 or not 0 < self.ngram_min <= self.ngram_max:
            raise ValueError("speculation needs num_draft_tokens > 0 and 0 < ngram_min <= ngram_max")


@dataclass(slots=True)
class SpeculateStats:
    draft_tokens: int = 0  # drafted tokens sent to be verified (monotonic)
    accepted_tokens: int = 0  # of those, the ones the verification kept


class NgramIndex:
    """Where each n-gram of one sequence's tokens last ended; grown by the tokens added since the
    last lookup, so a step costs O(new tokens x n sizes), not O(sequence length)."""

    __slots__ = ("ngram_min", "ngram_max", "last_end", "num_indexed")

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token
        self.num_indexed = 0  # n-grams ending before this position are in last_end

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest
        matching suffix n-gram; empty when none occurs."""
        num_tokens = seq.num_tokens
        self._index(seq, num_tokens - 1)  # an n-gram counts once a token follows it
        for n in range(min(self.ngram_max, num_tokens - 1), self.ngram_min - 1, -1):
            end = self.last_end.get(tuple(seq.token_slice(num_tokens - n, num_tokens)))
            if end is not None:
                return seq.token_slice(end + 1, min(end + 1 + max_tokens, num_tokens))
        return []

    def _index(self, seq: Sequence, upto: int) -> None:
        start = self.num_indexed
        if upto <= start:
            return
        window = seq.token_slice(max(0, start - self.ngram_max + 1), upto)
        offset = max(0, start - self.ngram_max + 1)
        for end in range(start, upto):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self.last_end[tuple(window[end - offset - n + 1 : end - offset + 1])] = end
        self.num_indexed = upto


@dataclass(slots=True)
class Speculator:
    """Adds drafts to a step's decodes and folds the verified tokens back in."""

    config: SpeculateConfig
    # How many tokens seq may draft now (0: none): the engine says (constrained requests,
    # held blocks, max_new_tokens).
    draft_limit: Callable[[Sequence], int]
    stats: SpeculateStats = field(default_factory=SpeculateStats)
    _indexes: dict[int, NgramIndex] = field(default_factory=dict)  # by seq id

    def add_drafts(self, requests: list[RunningRequest], seqs: dict[int, Sequence], blocks: BlockManager,
                   budget: int) -> int:
        """Draft for the plan's plain decodes, oldest first, within `budget` tokens and the
        blocks nobody needs next step. Returns the tokens used of the budget."""
        # Decodes (the last sampled token, or a prompt's last one), not 1-token prefill chunks.
        decodes = [r for r in requests if r.num_compute == 1 and not r.forks
                   and seqs[r.request_id].num_to_compute == 1]
        spare_blocks = blocks.num_free_blocks - len(decodes) * blocks.num_groups  # each may need fresh blocks next step
        used = 0
        for request in decodes:
            seq = seqs[request.request_id]
            k = min(self.config.num_draft_tokens, self.draft_limit(seq), budget - used)
            drafts = self._index(seq).propose(seq, k) if k > 0 else []
            while drafts and blocks.num_slot_blocks(seq, len(drafts)) > spare_blocks:
                drafts.pop()  # memory is short: draft less
            if not drafts:
                continue
            new_ids = blocks.append_slot(seq, len(drafts))
            spare_blocks -= len(new_ids)
            request.new_block_ids.extend(new_ids)
            request.draft_token_ids = drafts
            request.num_compute += len(drafts)
            used += len(drafts)
        return used

    def verified(self, seq: Sequence, request: RunningRequest, out: SeqOutput,
                 blocks: BlockManager) -> list[SeqOutput]:
        """Fold a verify step's samples into seq; returns one output per kept token, in order."""
        samples = [SeqOutput(out.request_id, out.token_id, out.logprob, out.top_tokens, out.prompt_logprobs)]
        samples += [SeqOutput(out.request_id, d.token_id, d.logprob, d.top_tokens) for d in out.draft_samples]
        drafts = request.draft_token_ids
        if len(samples) != len(drafts) + 1:
            raise ValueError(f"sequence {seq.seq_id}: {len(samples)} samples for {len(drafts)} drafts")
        accepted = accepted_drafts(drafts, [s.token_id for s in samples])  # type: ignore[misc]
        seq.num_computed += 1 + accepted
        kept = samples[: accepted + 1]
        seq.output_ids.extend(s.token_id for s in kept)  # type: ignore[misc]
        blocks.trim(seq, blocks_after_verify(seq.num_tokens, len(seq.block_table), blocks.block_size, blocks.num_groups))
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += accepted
        return kept

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

    def _index(self, seq: Sequence) -> NgramIndex:
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return index


def generated_counts(updates: list[tuple[Sequence, SeqOutput]]) -> list[int | None]:
    """For each output of a step, the generated count its token brings its sequence to (None
    for a prefill chunk). A verify step appends several tokens at once, so a sequence's count
    already includes the ones after: its outputs count up to seq.num_generated, in order."""
    after: dict[int, int] = {}  # seq id -> tokens of its later outputs
    counts: list[int | None] = []
    for seq, out in reversed(updates):
        if out.token_id is None:
            counts.append(None)
            continue
        later = after.get(seq.seq_id, 0)
        counts.append(seq.num_generated - later)
        after[seq.seq_id] = later + 1
    counts.reverse()
    return counts
