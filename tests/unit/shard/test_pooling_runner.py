"""Embedding requests in the runner: the pooled final hidden state (after the last norm, as
transformers' base model returns it), mean over a prompt prefilled in chunks or the last token after
cached ones, in the same step as a generating request; nothing is sampled for them."""

from __future__ import annotations

import pytest
import torch

from loom_proto.step import NewRequest, Pooling, RunningRequest, SamplingParams, StepPlan
from tests.unit.shard.conftest import random_tokens, tiny_runner

BLOCK_SIZE = 4


@pytest.fixture()
def runner(llama_pair):
    return tiny_runner(llama_pair, BLOCK_SIZE, num_blocks=32)


def _hidden(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]  # [len, hidden]


def test_mean_pooling_over_chunks_beside_a_generating_request(runner, llama_pair) -> None:
    prompt, other = random_tokens(11, 1), random_tokens(5, 2)
    embed = NewRequest(1, prompt, len(prompt), 0, 4, [0, 1, 2], SamplingParams(seed=0), pooling=Pooling.MEAN)
    generate = NewRequest(2, other, len(other), 0, len(other), [3, 4, 5], SamplingParams(seed=0))
    first = runner.step(StepPlan(new_requests=[embed, generate])).outputs
    assert first[0].embedding is None and first[0].token_id is None and first[1].token_id is not None
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 7), RunningRequest(2, 1)])).outputs
    by_id = {o.request_id: o for o in out}
    assert by_id[1].token_id is None and by_id[2].token_id is not None
    expected = _hidden(llama_pair.hf, prompt).mean(dim=0)
    torch.testing.assert_close(torch.tensor(by_id[1].embedding), expected, atol=1e-4, rtol=1e-4)


def test_last_token_pooling_after_cached_tokens(runner, llama_pair) -> None:
    prompt = random_tokens(9, 3)
    runner.step(StepPlan(new_requests=[NewRequest(1, prompt, len(prompt), 0, len(prompt), [0, 1, 2],
                                                  SamplingParams(seed=0))]))  # fills blocks 0, 1
    embed = NewRequest(2, prompt, len(prompt), 8, 1, [0, 1, 6], SamplingParams(seed=0), pooling=Pooling.LAST)
    out = runner.step(StepPlan(new_requests=[embed])).outputs[0]
    torch.testing.assert_close(torch.tensor(out.embedding), _hidden(llama_pair.hf, prompt)[-1], atol=1e-4, rtol=1e-4)


def test_mean_pooling_from_cached_tokens_is_refused(runner) -> None:
    prompt = random_tokens(9, 4)
    embed = NewRequest(1, prompt, len(prompt), 4, 5, [0, 1, 2], SamplingParams(seed=0), pooling=Pooling.MEAN)
    with pytest.raises(ValueError, match="mean pooling needs every prompt token"):
        runner.step(StepPlan(new_requests=[embed]))
    assert runner.requests == {}
