"""A fake runner for the gRPC transport tests: the real server and client around it, no model.

The runner is not under test here; the fake answers deterministically from the plan
so a test can tell which rank's answer came back and what each rank received.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult, TokenLogprob, WarmupResult
from loom_shard.tracing import StepPhases

BLOCK_SIZE = 4


@dataclass
class FakeRunner:
    rank: int = 0
    world_size: int = 1
    step_delay_s: float = 0.0
    fail_with: Exception | None = None  # raised by the next step, then cleared
    plans: list[StepPlan] = field(default_factory=list)
    released: list[list[int]] = field(default_factory=list)
    num_clears: int = 0
    warmup_args: tuple[int, int | None] | None = None
    max_concurrent_steps: int = 0
    traced_steps: int = 0  # steps given a StepPhases (the shard's tracing on)
    _active: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self) -> ModelInfo:
        return ModelInfo(
            architecture="LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            hidden_size=32, vocab_size=128, max_position_embeddings=256, dtype="float32",
            weights_hash="fake", device="cpu", block_size=BLOCK_SIZE, rank=self.rank, world_size=self.world_size,
        )

    def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        self.warmup_args = (max_prefill_tokens, max_batch_total_tokens)
        # Ranks differ so the client's "smallest pool wins" shows.
        return WarmupResult(num_blocks=64 - 8 * self.rank, num_host_blocks=16 + self.rank, block_size=BLOCK_SIZE)

    def step(self, plan: StepPlan, phases: StepPhases | None = None) -> StepResult:
        start = time.perf_counter()
        with self._lock:
            self._active += 1
            self.max_concurrent_steps = max(self.max_concurrent_steps, self._active)
        try:
            self.plans.append(plan)
            if self.fail_with is not None:
                error, self.fail_with = self.fail_with, None
                raise error
            time.sleep(self.step_delay_s)
            if phases is not None:  # the "forward" is the sleep; no sampling time
                self.traced_steps += 1
                phases.start, phases.forward_start = start, start
                phases.sample_start = phases.end = time.perf_counter()
            return StepResult(outputs=self._outputs(plan), forward_ms=1.5 + self.rank, total_ms=2.5 + self.rank)
        finally:
            with self._lock:
                self._active -= 1

    def _outputs(self, plan: StepPlan) -> list[SeqOutput]:
        # Token = last token + 1 + rank: rank 0's answer is recognizable.
        outputs = [
            SeqOutput(
                request_id=r.request_id,
                token_id=r.token_ids[-1] + 1 + self.rank,
                logprob=-0.5,
                top_tokens=[TokenLogprob(token_id=r.token_ids[-1] + 1, logprob=-0.5)],
            )
            for r in plan.new_requests
        ]
        outputs += [SeqOutput(request_id=r.request_id, token_id=None, logprob=None) for r in plan.running_requests]
        return outputs

    def release(self, request_ids: list[int]) -> None:
        self.released.append(request_ids)

    def clear(self) -> None:
        self.num_clears += 1
