"""An in-process fake shard for the router API contract tests (the real Engine drives it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loom.common.step import ModelInfo, SamplingParams, SeqOutput, StepPlan, StepResult, TokenLogprob, WarmupResult

WORDS = " the quick brown fox jumps over the lazy dog and then it sleeps in the sun"


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    sampling: SamplingParams
    num_computed: int = 0
    num_generated: int = 0


@dataclass
class FakeShardBackend:
    """Executes StepPlans deterministically, with the ShardClient's async methods.

    Token i of a sequence is `words[(seed * do_sample + i) % len(words)]`, so greedy
    choices agree and sampled ones depend on their seed; `eos_at` makes choice tokens
    end with EOS at that generated index. `step_delay_s` paces the steps.
    """

    words: list[int]
    vocab_size: int
    eos_id: int = 2
    eos_at: int | None = None
    step_delay_s: float = 0.0
    fail_steps: bool = False
    healthy: bool = True
    num_blocks: int = 256
    block_size: int = 4
    max_position_embeddings: int = 256
    seqs: dict[int, _Seq] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)

    async def wait_ready(self, timeout_s: float) -> None:
        return None

    async def info(self) -> ModelInfo:
        return ModelInfo(architecture="LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         hidden_size=32, vocab_size=self.vocab_size,
                         max_position_embeddings=self.max_position_embeddings, dtype="float32",
                         weights_hash="fake", device="cpu", block_size=self.block_size, rank=0, world_size=1)

    async def health(self) -> bool:
        return self.healthy

    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        return WarmupResult(num_blocks=self.num_blocks, num_host_blocks=0, block_size=self.block_size)

    async def release(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self.seqs.pop(request_id, None)

    async def clear_cache(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def step(self, plan: StepPlan) -> StepResult:
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if self.fail_steps:
            raise RuntimeError("fake shard failure")
        await self.release(plan.released_ids)
        self.released += plan.released_ids
        outputs = []
        for new in plan.new_requests:
            seq = _Seq(list(new.token_ids), new.sampling, new.num_cached)
            self.seqs[new.request_id] = seq
            outputs.append(self._compute(new.request_id, seq, new.num_compute, new.prompt_logprobs,
                                         new.num_prompt_tokens))
            if new.forks and outputs[-1].token_id is not None:
                for fork in new.forks:
                    child = _Seq(seq.token_ids[:new.num_prompt_tokens], fork.sampling, new.num_prompt_tokens)
                    self.seqs[fork.request_id] = child
                    outputs.append(SeqOutput(fork.request_id, *self._sample(child)))
        for running in plan.running_requests:
            seq = self.seqs[running.request_id]
            outputs.append(self._compute(running.request_id, seq, running.num_compute, False, 0))
        return StepResult(outputs=outputs, forward_ms=0.0, total_ms=0.0)

    def _compute(self, request_id: int, seq: _Seq, num_compute: int, prompt_logprobs: bool,
                 num_prompt: int) -> SeqOutput:
        start = seq.num_computed
        seq.num_computed += num_compute
        logprobs = []
        if prompt_logprobs:  # positions >= 1 computed by this step
            logprobs = [-float(p) / 10 for p in range(max(1, start), min(seq.num_computed, num_prompt))]
        if seq.num_computed < len(seq.token_ids):
            return SeqOutput(request_id, None, None, prompt_logprobs=logprobs)
        token_id, logprob, top = self._sample(seq)
        return SeqOutput(request_id, token_id, logprob, top, prompt_logprobs=logprobs)

    def _sample(self, seq: _Seq) -> tuple[int, float, list[TokenLogprob]]:
        i = seq.num_generated
        if self.eos_at is not None and i == self.eos_at:
            token_id = self.eos_id
        else:
            offset = seq.sampling.seed if seq.sampling.do_sample else 0
            token_id = self.words[(offset + i) % len(self.words)]
        seq.num_generated += 1
        seq.token_ids.append(token_id)
        # sampled choices differ in logprob by seed, so best_of has a clear winner
        logprob = -0.1 * (1 + seq.sampling.seed % 5) if seq.sampling.do_sample else -0.25
        top = [TokenLogprob(self.words[(i + k) % len(self.words)], -1.0 - k)
               for k in range(seq.sampling.top_n_tokens)]
        return token_id, logprob, top
