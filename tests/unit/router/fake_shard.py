"""A fake shard for router tests: runs StepPlans against an in-memory record of block contents.

Each device block slot holds the token id whose "KV" was written there. A sequence samples
from a hash of (seed, the tokens its blocks hold), so wrong blocks give wrong tokens, and
`verify()` checks that every live request's blocks hold exactly its computed tokens.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loom_proto.step import (
    Fork,
    NewRequest,
    SamplingParams,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenLogprob,
    TokenSample,
    accepted_drafts,
    blocks_after_verify,
)
from loom_router.core.request import Sequence
from loom_router.core.scheduler import Scheduler

VOCAB_SIZE = 1000


def fake_sample(seed: int, context: list[int]) -> int:
    """The deterministic 'model': the next token of a context for a seed."""
    digest = hashlib.blake2b(repr((seed, tuple(context))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


def fake_constrained_sample(seed: int, context: list[int], mask: bytes) -> int:
    """The fake model under a grammar: a hash-picked token among those the mask allows."""
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))
    digest = hashlib.blake2b(repr((seed, tuple(context), "masked")).encode(), digest_size=8).digest()
    return int(allowed[int.from_bytes(digest, "little") % len(allowed)])


def fake_prompt_logprob(token_id: int) -> float:
    return -(token_id % 10) / 10


def fake_prompt_top(token_id: int, k: int) -> list[TokenLogprob]:
    """The k alternatives at a prompt position scoring token_id: a token one higher, more likely
    than it, then the token itself, then lower ones."""
    top = [TokenLogprob(token_id + 1, 0.05), TokenLogprob(token_id, fake_prompt_logprob(token_id))]
    top += [TokenLogprob(token_id + 1 + j, -5.0 - j) for j in range(1, k)]
    return top[:k]


class FailAt(enum.Enum):
    """Where an injected step failure strikes."""

    START = "before anything ran"
    AFTER_BLOCK_OPS = "after releases and swaps, before the forward"
    AFTER_FORWARD = "after the forward wrote KV, before any output"


class ShardFailure(RuntimeError):
    """An injected step failure."""


@dataclass(slots=True)
class _State:
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed: int
    sampling: SamplingParams
    prompt_logprobs: bool


@dataclass(slots=True)
class _Work:
    request_id: int
    state: _State
    num_compute: int
    forks: list[Fork] = field(default_factory=list)
    num_drafts: int = 0  # speculative decoding: the chunk ends with this many drafted tokens


class FakeShard:
    def __init__(self, block_size: int, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.states: dict[int, _State] = {}
        self.plans: list[StepPlan] = []
        self.known_ids: set[int] = set()  # every request id a plan ever sent
        # Fault injection: the next step matching fail_when raises at fail_at (then both reset).
        self.fail_when: Callable[[StepPlan], bool] | None = None
        self.fail_at = FailAt.START
        self.masks: dict[int, bytes] = {}  # this step's allowed-token masks (constrained decoding)
        # (request id, generated index, sampled id) -> the token the sequence gets (unconstrained only)
        self.remap: Callable[[int, int, int], int] | None = None

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.masks = plan.allowed_token_masks
        failing = self.fail_when is not None and self.fail_when(plan)
        if failing:
            self.fail_when = None
        self.known_ids.update(r.request_id for r in plan.new_requests)
        self.known_ids.update(f.request_id for r in [*plan.new_requests, *plan.running_requests] for f in r.forks)
        self._fail_if(failing, FailAt.START)
        for request_id in plan.released_ids:
            # A release is sent again after a failed step (like the real shard, ignore it then).
            assert request_id in self.known_ids, f"release of unknown request {request_id}"
            self.states.pop(request_id, None)
        self._block_ops(plan)
        self._fail_if(failing, FailAt.AFTER_BLOCK_OPS)
        work = [self._admit(request) for request in plan.new_requests]
        for request in plan.running_requests:
            state = self.states[request.request_id]
            state.block_table.extend(request.new_block_ids)
            if request.draft_token_ids:
                assert state.num_computed == len(state.token_ids) - 1, "drafts on a sequence that is not decoding"
                assert request.num_compute == 1 + len(request.draft_token_ids) and not request.forks
                state.token_ids.extend(request.draft_token_ids)
            work.append(_Work(request.request_id, state, request.num_compute, request.forks,
                              len(request.draft_token_ids)))
        written: set[tuple[int, int]] = set()
        for item in work:  # the forward writes every request's new KV, then samples
            self._write(item, written)
        self._fail_if(failing, FailAt.AFTER_FORWARD)
        outputs: list[SeqOutput] = []
        for item in work:
            outputs.extend(self._finish(item))
        return StepResult(outputs, forward_ms=0.0, total_ms=0.0)

    def _fail_if(self, failing: bool, point: FailAt) -> None:
        if failing and self.fail_at is point:
            raise ShardFailure(f"injected failure {point.value}")

    def _block_ops(self, plan: StepPlan) -> None:
        for device_id, host_id in plan.swap_out:
            self.host[host_id] = list(self.device[device_id])
        for host_id, device_id in plan.swap_in:
            self.device[device_id] = list(self.host[host_id])

    def _admit(self, request: NewRequest) -> _Work:
        assert request.request_id not in self.states, f"request {request.request_id} sent twice"
        state = _State(list(request.token_ids), request.num_prompt_tokens, list(request.block_table),
                       request.num_cached, request.sampling, request.prompt_logprobs)
        end = request.num_cached + request.num_compute
        assert end <= len(state.token_ids) and self.blocks_for(end) <= len(state.block_table)
        # Its cached KV must be there before this step's writes (not written by a neighbour now).
        assert self._read(state, request.num_cached) == state.token_ids[:request.num_cached], \
            f"request {request.request_id}: cached blocks hold other tokens"
        self.states[request.request_id] = state
        return _Work(request.request_id, state, request.num_compute, request.forks)

    def _write(self, item: _Work, written: set[tuple[int, int]]) -> None:
        state = item.state
        end = state.num_computed + item.num_compute
        assert 0 < item.num_compute and end <= len(state.token_ids), "computes unknown tokens"
        assert self.blocks_for(end) <= len(state.block_table), "block table too short"
        for pos in range(state.num_computed, end):
            slot = (state.block_table[pos // self.block_size], pos % self.block_size)
            assert slot not in written, f"two writes to block slot {slot} in one step"
            written.add(slot)
            self.device[slot[0]][slot[1]] = state.token_ids[pos]

    def _finish(self, item: _Work) -> list[SeqOutput]:
        if item.num_drafts:
            return [self._verify(item)]
        state = item.state
        start, state.num_computed = state.num_computed, state.num_computed + item.num_compute
        out = SeqOutput(item.request_id, None, None)
        if state.prompt_logprobs:  # the logits at position q score prompt token q + 1
            end = min(state.num_computed + 1, state.num_prompt_tokens)
            out.prompt_logprobs = [fake_prompt_logprob(state.token_ids[pos])
                                   for pos in range(start + 1, end)]
            if state.sampling.top_n_tokens:
                out.prompt_top_tokens = [fake_prompt_top(state.token_ids[pos], state.sampling.top_n_tokens)
                                         for pos in range(start + 1, end)]
        if state.num_computed < len(state.token_ids):
            return [out]
        context = self._read(state, state.num_computed)
        out.token_id, out.logprob = self._sample(item.request_id, state, context), -0.5
        outputs = [out]
        for fork in item.forks:
            outputs.append(self._fork(state, fork, context))
        state.token_ids.append(out.token_id)
        return outputs

    def _fork(self, parent: _State, fork: Fork, context: list[int]) -> SeqOutput:
        num_prompt = parent.num_prompt_tokens
        last = (num_prompt - 1) // self.block_size
        if num_prompt % self.block_size and fork.block_table[last] != parent.block_table[last]:
            self.device[fork.block_table[last]] = list(self.device[parent.block_table[last]])
        assert fork.request_id not in self.states
        child = _State(parent.token_ids[:num_prompt], num_prompt, list(fork.block_table),
                       num_prompt, fork.sampling, False)
        assert self._read(child, num_prompt) == context, "fork's blocks differ from the parent's"
        token_id = self._sample(fork.request_id, child, context)
        child.token_ids.append(token_id)
        self.states[fork.request_id] = child
        return SeqOutput(fork.request_id, token_id, -0.5)

    def _verify(self, item: _Work) -> SeqOutput:
        """Sample after the last sampled token and after each draft, from the KV just written;
        keep what plain decoding would have (loom_proto.step.accepted_drafts)."""
        state = item.state
        base = len(state.token_ids) - item.num_drafts  # the known tokens before the drafts
        drafts = state.token_ids[base:]
        sampled = [self._sample(item.request_id, state, self._read(state, base + j))
                   for j in range(item.num_drafts + 1)]
        accepted = accepted_drafts(drafts, sampled)
        state.num_computed = base + accepted
        state.token_ids[base:] = sampled[: accepted + 1]
        del state.block_table[blocks_after_verify(len(state.token_ids), len(state.block_table), self.block_size):]
        return SeqOutput(item.request_id, sampled[0], -0.5, draft_samples=[TokenSample(t, -0.5) for t in sampled[1:]])

    def _sample(self, request_id: int, state: _State, context: list[int | None]) -> int:
        mask = self.masks.get(request_id)
        if mask is not None:
            return fake_constrained_sample(state.sampling.seed, context, mask)
        token_id = fake_sample(state.sampling.seed, context)
        if self.remap is not None:
            token_id = self.remap(request_id, len(context) - state.num_prompt_tokens, token_id)
        return token_id

    def _read(self, state: _State, num_tokens: int) -> list[int | None]:
        bs = self.block_size
        return [self.device[state.block_table[pos // bs]][pos % bs] for pos in range(num_tokens)]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def verify(self) -> None:
        """Every live request's blocks hold exactly the tokens it computed."""
        for request_id, state in self.states.items():
            assert self._read(state, state.num_computed) == state.token_ids[:state.num_computed], \
                f"request {request_id}: blocks were overwritten"


def reference_tokens(prompt_ids: list[int], seed: int, num_new_tokens: int) -> list[int]:
    """What a sequence generates with no pressure at all: the fake model run directly."""
    tokens = list(prompt_ids)
    for _ in range(num_new_tokens):
        tokens.append(fake_sample(seed, tokens))
    return tokens[len(prompt_ids):]


class Driver:
    """The engine's loop in miniature: schedule, step, update, finish at max_new_tokens."""

    def __init__(self, scheduler: Scheduler, shard: FakeShard, max_new_tokens: int) -> None:
        self.scheduler = scheduler
        self.shard = shard
        self.max_new_tokens = max_new_tokens
        self.max_new_tokens_of: dict[int, int] = {}  # per group id, overrides max_new_tokens
        self.prompt_logprobs: dict[int, list[float]] = {}  # per seq id, as the engine sees them
        self.prompt_top_tokens: dict[int, list[list[TokenLogprob]]] = {}  # their alternatives, the same way
        self.num_steps = 0

    def step(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        result = self.shard.step(plan)
        self.shard.verify()
        self.num_steps += 1
        for seq, out in self.scheduler.update(plan, result):
            self._maybe_finish(seq, out)
        return plan

    def _maybe_finish(self, seq: Sequence, out: SeqOutput) -> None:
        self.prompt_logprobs.setdefault(seq.seq_id, []).extend(out.prompt_logprobs)
        self.prompt_top_tokens.setdefault(seq.seq_id, []).extend(out.prompt_top_tokens)
        limit = self.max_new_tokens_of.get(seq.group.group_id, self.max_new_tokens)
        if out.token_id is not None and seq.num_generated >= limit:
            self.scheduler.finish(seq)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps")
