"""The scheduler tests' FakeShard (tests/unit/router/fake_shard.py) behind the ShardClient's async
methods, so the API contract tests drive a real Engine against a shard that checks its blocks.

Its hash-sampled token ids are mapped onto a cycle of plain words so responses read as text
(the mapped token replaces the sampled one in the shard's record, keeping `verify()` exact).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from loom_proto.codec import to_pb
from loom_proto.step import ModelInfo, SeqOutput, StepPlan, StepResult, TokenLogprob, WarmupResult, accepted_drafts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "router"))
from fake_shard import FakeShard, fake_sample  # noqa: E402

WORDS = " the quick brown fox jumps over the lazy dog and then it sleeps in the sun"


class FakeShardClient:
    """A FakeShard with the ShardClient's interface, plus knobs for failure and pacing tests."""

    def __init__(self, words: list[int], vocab_size: int, eos_id: int, block_size: int = 4,
                 num_blocks: int = 256, max_position_embeddings: int = 256) -> None:
        self.shard = FakeShard(block_size, num_blocks)
        self.shard.remap = self._remap
        self.words = words
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.max_position_embeddings = max_position_embeddings
        self.eos_at: int | None = None  # generated index at which every sequence emits EOS
        self.script: list[int] | None = None  # when set, every sequence generates these ids in order
        self.step_delay_s = 0.0
        self.device = "cpu"  # what Info reports the shards compute on
        self.fail_steps = False
        self.healthy = True
        self.num_steps = 0
        self.warmup_args: tuple[int, int | None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.shard.device)

    @property
    def block_size(self) -> int:
        return self.shard.block_size

    async def wait_ready(self, timeout_s: float) -> None:
        return None

    async def info(self) -> ModelInfo:
        return ModelInfo(architecture="LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         hidden_size=32, vocab_size=self.vocab_size,
                         max_position_embeddings=self.max_position_embeddings, dtype="float32",
                         weights_hash="fake", device=self.device, block_size=self.block_size, rank=0, world_size=1)

    async def health(self) -> bool:
        return self.healthy

    async def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None) -> WarmupResult:
        self.warmup_args = (max_prefill_tokens, max_batch_total_tokens)
        return WarmupResult(num_blocks=self.num_blocks, num_host_blocks=0, block_size=self.block_size)

    async def release(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self.shard.states.pop(request_id, None)

    async def clear_cache(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def step(self, plan: StepPlan) -> StepResult:
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if self.fail_steps:
            # The plan reached the shard (its ids may be released later, as the real one allows).
            self.shard.known_ids.update(r.request_id for r in plan.new_requests)
            raise RuntimeError("fake shard failure")
        to_pb(plan).SerializeToString()  # as the real client does: a plan that cannot be encoded fails here
        result = self.shard.step(plan)
        self.shard.verify()
        self.num_steps += 1
        drafts = {r.request_id: r.draft_token_ids for r in plan.running_requests if r.draft_token_ids}
        for out in result.outputs:
            if out.token_id is not None:
                self._score(out, drafts.get(out.request_id, []))
        return result

    def _remap(self, request_id: int, index: int, token_id: int) -> int:
        """The token a sequence gets for its generated token `index` (the shard's hook)."""
        if index == self.eos_at:
            return self.eos_id
        if self.script is not None:
            return self.script[index % len(self.script)]
        return self.words[token_id % len(self.words)]

    def _score(self, out: SeqOutput, drafts: list[int]) -> None:
        """Logprob and top tokens of each sample, from its generated index."""
        state = self.shard.states[out.request_id]
        samples = [out, *out.draft_samples]
        num_kept = accepted_drafts(drafts, [s.token_id for s in samples]) + 1  # type: ignore[misc]
        first = len(state.token_ids) - state.num_prompt_tokens - num_kept  # index of out's token
        for index, sample in enumerate(samples, start=first):
            sample.logprob = -0.1 * (1 + state.sampling.seed % 5)  # seeds differ in score: best_of has a winner
            sample.top_tokens = [TokenLogprob(self.words[(index + k) % len(self.words)], -1.0 - k)
                                 for k in range(state.sampling.top_n_tokens)]

    def reference(self, prompt_ids: list[int], seed: int, count: int) -> list[int]:
        """The tokens a sequence generates with this seed, computed without the router."""
        tokens = list(prompt_ids)
        for _ in range(count):
            tokens.append(self.words[fake_sample(seed, tokens) % len(self.words)])
        return tokens[len(prompt_ids):]
