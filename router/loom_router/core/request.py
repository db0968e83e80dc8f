"""Router-side request state: a `SequenceGroup` is one HTTP request, its `Sequence`s its n choices.

The scheduler owns every field that changes during generation (status, tokens, blocks);
the engine reads them and attaches its own per-request data through `SequenceGroup.context`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from loom_proto.step import Pooling, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # holds device blocks and is scheduled every step
    PREEMPTED = "preempted"  # swapped to host RAM or dropped to recompute; queued at the head
    FINISHED = "finished"  # stopped or cancelled; holds nothing


def lora_hash_root(lora_id: int) -> int:
    """The parent hash of the first KV block of a sequence run with this LoRA adapter."""
    return hash(("lora", lora_id))


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of a request: its tokens, how far its KV is computed, and where it lives.

    `num_computed` counts the tokens whose KV is in `block_table`; the last sampled token
    is computed by the next step, so a decoding sequence has num_computed == num_tokens - 1.
    """

    seq_id: int  # the shard's request id
    group: SequenceGroup = field(repr=False)
    index: int  # choice index within the group
    sampling: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    # Device block ids, one per KV group for each logical block; None: a sliding group's block
    # dropped once out of its window (loom_router.core.block_manager).
    block_table: list[int | None] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of its full, computed blocks
    # Chain hashes of its full prompt blocks after block_hashes: held on the device, not yet computed.
    pending_hashes: list[int] = field(default_factory=list)
    host_block_table: list[int | None] = field(default_factory=list)  # host block ids while swapped out
    # Chain hashes of the full blocks of token_ids, each computed once (tokens only grow):
    # a queue head that waits for space does not rehash its prompt every step.
    token_block_hashes: list[int] = field(default_factory=list)
    on_shard: bool = False  # the shard holds state for seq_id (released when this turns False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def hash_root(self) -> int | None:
        """The parent hash of its first block: its adapter's, so that two adapters never share KV."""
        lora_id = self.group.lora_id
        return None if lora_id is None else lora_hash_root(lora_id)

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[:end - num_prompt]


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One HTTP request: n sequences sharing a prompt, prefilled once and then forked.

    Until `forked`, only seqs[0] runs on the shard; its siblings already hold their block
    tables and join (as `Fork`s) on the step that completes the prompt.
    """

    group_id: int
    prompt_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = 0.0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prompt_logprobs: bool = False
    forked: bool = False  # the siblings exist on the shard (always True when n == 1)
    swapped: bool = False  # preempted to the host pool (else preempted ones recompute)
    num_prompt_logprobs_sent: int = 0  # prompt positions whose logprob was already returned
    context: Any = None  # the engine's own per-request data
    lora_id: int | None = None  # the LoRA adapter every choice runs with; None: the base model
    pooling: Pooling = Pooling.NONE  # else an embedding request: one prefill, no token

    @classmethod
    def create(cls, group_id: int, prompt_ids: list[int], samplings: list[SamplingParams],
               first_seq_id: int, prompt_logprobs: bool = False,
               arrival_time: float | None = None, lora_id: int | None = None,
               pooling: Pooling = Pooling.NONE) -> SequenceGroup:
        """A waiting group with one sequence per sampling params, ids first_seq_id + index."""
        if not samplings:
            raise ValueError("a request needs at least one choice")
        group = cls(group_id=group_id, prompt_ids=list(prompt_ids),
                    arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                    prompt_logprobs=prompt_logprobs, forked=len(samplings) == 1, lora_id=lora_id,
                    pooling=pooling)
        group.seqs = [Sequence(first_seq_id + i, group, i, params, group.prompt_ids)
                      for i, params in enumerate(samplings)]
        return group

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        finished = SeqStatus.FINISHED  # compared inline: this runs for every sequence every step
        return [seq for seq in self.seqs if seq.status is not finished]

    @property
    def num_active(self) -> int:
        """len(active_seqs()) without building the list (the lookahead asks it of every group,
        every step)."""
        if not self.forked:
            return 1
        if len(self.seqs) == 1:
            return int(self.seqs[0].status is not SeqStatus.FINISHED)
        return len(self.unfinished_seqs())

    def active_seqs(self) -> list[Sequence]:
        """The unfinished sequences the shard runs now (only the first before the fork)."""
        if not self.forked:
            return [self.seqs[0]]
        return self.unfinished_seqs()

    def set_status(self, status: SeqStatus) -> None:
        for seq in self.unfinished_seqs():
            seq.status = status
