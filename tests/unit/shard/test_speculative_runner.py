"""The runner's verify steps (speculative decoding): a decode step carrying drafted tokens
samples at every drafted position and keeps exactly what plain decoding produces."""

from __future__ import annotations

import pytest

from loom_proto.step import NewRequest, RunningRequest, SamplingParams, SeqOutput, StepPlan
from loom_shard.runtime.runner import ModelRunner
from tests.unit.shard.conftest import random_tokens, tiny_runner

BLOCK_SIZE = 4
GREEDY = SamplingParams(seed=0, top_n_tokens=2)
# Sampled, with every history-dependent knob: penalties, min_new_tokens (EOS masked early).
SAMPLED = SamplingParams(seed=11, do_sample=True, temperature=1.3, top_k=40, repetition_penalty=1.2,
                         frequency_penalty=0.3, presence_penalty=0.2, min_new_tokens=4, eos_token_ids=(3, 7),
                         top_n_tokens=2)


@pytest.fixture()
def runner(llama_pair) -> ModelRunner:
    return tiny_runner(llama_pair, BLOCK_SIZE, num_blocks=64)


def _start(runner: ModelRunner, rid: int, prompt: list[int], sampling: SamplingParams, blocks: list[int]) -> SeqOutput:
    new = NewRequest(rid, prompt, len(prompt), 0, len(prompt), blocks, sampling)
    return runner.step(StepPlan(new_requests=[new])).outputs[0]


def _plain(runner: ModelRunner, prompt: list[int], sampling: SamplingParams, num_new: int) -> list[SeqOutput]:
    """Plain decoding, one token per step, with blocks for every token up front."""
    outs = [_start(runner, 100, prompt, sampling, list(range(40, 48)))]
    for _ in range(num_new - 1):
        outs += runner.step(StepPlan(running_requests=[RunningRequest(100, 1)])).outputs
    runner.release([100])
    return outs


def _as_steps(out: SeqOutput) -> list[tuple[int, float, list]]:
    """A verify step's samples as (token, logprob, top tokens), first sample first."""
    samples = [(out.token_id, out.logprob, out.top_tokens)]
    return samples + [(d.token_id, d.logprob, d.top_tokens) for d in out.draft_samples]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_correct_drafts_are_all_verified_with_plain_decodings_samples(runner, sampling) -> None:
    prompt = random_tokens(6, 21)
    plain = _plain(runner, prompt, sampling, 6)
    first = _start(runner, 1, prompt, sampling, [0, 1])
    drafts = [o.token_id for o in plain[1:5]]  # what plain decoding samples next: all must stand
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 5, [2, 3], draft_token_ids=drafts)])).outputs[0]
    assert first.token_id == plain[0].token_id
    got = _as_steps(out)
    assert [t for t, _, _ in got] == [o.token_id for o in plain[1:6]]
    assert [lp for _, lp, _ in got] == pytest.approx([o.logprob for o in plain[1:6]], abs=1e-5)
    assert [top for _, _, top in got][0] == plain[1].top_tokens
    state = runner.requests[1]
    assert state.token_ids == prompt + [o.token_id for o in plain[:6]]
    assert state.num_computed == len(state.token_ids) - 1  # the bonus token is computed next step


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_wrong_draft_keeps_the_prefix_and_the_sample_in_its_place(runner, sampling) -> None:
    prompt = random_tokens(7, 22)
    plain = [o.token_id for o in _plain(runner, prompt, sampling, 10)]
    _start(runner, 1, prompt, sampling, [0, 1])  # 7 prompt tokens + 1 sampled: blocks 0, 1 full
    wrong = (plain[2] + 1) % 160
    drafts = [plain[1], wrong, plain[3], plain[4]]  # the second is wrong: later ones do not count
    out = runner.step(StepPlan(running_requests=[RunningRequest(1, 5, [2, 3], draft_token_ids=drafts)])).outputs[0]
    assert [t for t, _, _ in _as_steps(out)][:2] == plain[1:3]
    state = runner.requests[1]
    assert state.token_ids == prompt + plain[:3]
    assert state.num_computed == len(prompt) + 2  # the last sampled token and the accepted draft
    # 10 tokens known: blocks 0..2; block 3 held only the rejected drafts and is dropped.
    assert state.block_table == [0, 1, 2]
    generated = list(plain[:3])
    for _ in range(7):  # plain decoding over the rejected drafts' KV slots: same tokens
        new_blocks = [4 + len(state.block_table)] if len(state.token_ids) % BLOCK_SIZE == 0 else []
        out = runner.step(StepPlan(running_requests=[RunningRequest(1, 1, new_blocks)])).outputs[0]
        generated.append(out.token_id)
    assert generated == plain


def test_drafts_and_plain_decodes_share_a_batch(runner) -> None:
    p1, p2 = random_tokens(5, 23), random_tokens(9, 24)
    ref1 = [o.token_id for o in _plain(runner, p1, GREEDY, 4)]
    ref2 = [o.token_id for o in _plain(runner, p2, SAMPLED, 2)]
    _start(runner, 1, p1, GREEDY, [0, 1])
    _start(runner, 2, p2, SAMPLED, [5, 6, 7])
    plan = StepPlan(running_requests=[RunningRequest(1, 3, [], draft_token_ids=ref1[1:3]), RunningRequest(2, 1)])
    out = {o.request_id: o for o in runner.step(plan).outputs}
    assert [t for t, _, _ in _as_steps(out[1])] == ref1[1:4]
    assert out[2].token_id == ref2[1] and out[2].draft_samples == []


@pytest.mark.parametrize(
    "running, message",
    [
        (RunningRequest(1, 2, [], draft_token_ids=[5, 6]), "drafts need a decode step"),
        (RunningRequest(1, 3, [], draft_token_ids=[5, 10_000]), "vocabulary"),
        (RunningRequest(1, 9, [], draft_token_ids=[5] * 8), "cannot hold"),
    ],
)
def test_bad_drafts_are_refused_before_anything_changes(runner, running, message) -> None:
    _start(runner, 1, random_tokens(3, 25), GREEDY, [0])
    before = (list(runner.requests[1].token_ids), runner.requests[1].num_computed)
    with pytest.raises(ValueError, match=message):
        runner.step(StepPlan(running_requests=[running]))
    assert (runner.requests[1].token_ids, runner.requests[1].num_computed) == before


def test_drafts_for_a_constrained_request_are_refused(runner) -> None:
    _start(runner, 1, random_tokens(3, 26), GREEDY, [0, 1])
    mask = b"\xff" * 20  # 160 tokens allowed
    plan = StepPlan(running_requests=[RunningRequest(1, 2, [], draft_token_ids=[5])], allowed_token_masks={1: mask})
    with pytest.raises(ValueError, match="constrained"):
        runner.step(plan)
