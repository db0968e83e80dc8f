"""One step of lookahead: plan and send step N+1 while the shards compute step N.

Without it the router idles while a step runs and the shard idles while the router turns
the step's outputs into text and plans the next one. With it, in a steady decode:

    send N ── send N+1 ── await N, stream N's tokens ── send N+2 ── await N+1 ...

Step N+1 is built before N's outputs are known. It qualifies (`plan_ahead`) when every
sequence of N samples a token there: each running one decodes one token and each new one
computes the rest of its prompt, and N has nothing else (no prompt chunk that goes on, fork,
swap or grammar mask). Groups waiting to start are admitted into N+1 as the ordinary
schedule() would admit them after N (their prompts do not depend on N's outputs): a request
that arrives while N runs starts in N+1, not after a drained pipeline (which made it wait for
N and N+1, raising TTFT p50 at 32 streams 1.55 -> 1.9 s, bench/BENCHMARKS.md), and the step
after N+1 is planned ahead as well, the new prompts' first tokens decoded in it.
Each sequence of N then decodes in N+1 the token N samples: the shard already appended it to
its own copy of the sequence, so the plan needs that token's slot (a block reserved one token
ahead), never its value.
The shard runs steps one at a time in arrival order (loom_shard.server); no contract change.

What a sequence that finishes in N (EOS, stop string) still costs: it was already in N+1.
Its N+1 token is discarded and its blocks are released after N+1's outputs came back (one
step late, never while a step may still write them); a sequence that must finish in N (its
last allowed token) is left out of N+1. Anything else (a prompt chunk in N, an abort, a
snapshot's callable, a grammar or held-blocks request running, a failed step) lets the
pipeline drain: the next step is planned the ordinary way, after N's outputs.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

from loom_proto.step import RunningRequest, StepPlan, StepResult
from loom_router.core.request import Sequence
from loom_router.core.scheduler import Scheduler


class AheadRole(enum.Enum):
    """What one running sequence does in a step planned ahead."""

    RUN = "run"  # decode the token the previous step samples
    SKIP = "skip"  # it finishes in the previous step for sure: not in the step ahead
    BLOCK = "block"  # it needs the previous step's outputs first: no step ahead at all


@dataclass(slots=True)
class InFlight:
    """A step sent to the shards whose outputs the engine has not taken yet."""

    plan: StepPlan
    task: asyncio.Future[StepResult | Exception]

    @property
    def seq_ids(self) -> set[int]:
        return {r.request_id for r in self.plan.running_requests} | {r.request_id for r in self.plan.new_requests}


def plan_ahead(scheduler: Scheduler, plan: StepPlan, role: Callable[[Sequence], AheadRole]) -> StepPlan | None:
    """The step after `plan`, built before plan's outputs are known; None when it cannot be."""
    if plan.swap_in or plan.swap_out or plan.allowed_token_masks:
        return None
    seq_ids = _sampling_ids(plan)
    if seq_ids is None or len(seq_ids) != scheduler.num_running_seqs():
        return None  # a sequence was left out of `plan` (no budget, or skipped ahead): resync
    seqs = []
    for seq_id in seq_ids:
        seq = scheduler.live_seq(seq_id)
        if seq is None:
            return None
        seq_role = role(seq)
        if seq_role is AheadRole.BLOCK:
            return None
        if seq_role is AheadRole.RUN:
            seqs.append(seq)
    blocks = scheduler.block_manager
    needs = blocks.needs_ahead(seqs)
    if not seqs or sum(n for n in needs if n > 0) > blocks.num_free_blocks:
        return None  # out of blocks: the ordinary schedule() preempts, after N's outputs
    running = [RunningRequest(seq.seq_id, 1, blocks.append_slot(seq, ahead=1) if need > 0 else [])
               for seq, need in zip(seqs, needs)]
    ahead = StepPlan(running_requests=running, released_ids=scheduler.take_releases())
    scheduler.admit_waiting(ahead, len(seqs))  # a request arriving now runs its prompt in this step
    return ahead


def _sampling_ids(plan: StepPlan) -> list[int] | None:
    """The sequences of `plan`, each of which samples a token there (to decode it in the step
    after): running ones decoding one token, new ones computing the rest of their prompt. None
    when a sequence does anything else (a prompt that goes on in another chunk, forks that start)."""
    seq_ids = []
    for running in plan.running_requests:
        if running.num_compute != 1 or running.forks:
            return None
        seq_ids.append(running.request_id)
    for new in plan.new_requests:
        if new.forks or new.num_cached + new.num_compute != len(new.token_ids):
            return None
        seq_ids.append(new.request_id)
    return seq_ids
