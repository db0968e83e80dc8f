"""Sampler: processing against the definitions, filters restrict the support, seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch

from loom_proto.step import SamplingParams
from loom_shard import kernels
from loom_shard.runtime.sampler import SeqSamplingState, filtered_probs, process_row, sample

VOCAB = 16


def _logits(num_rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=g) * 2.0


def _state(prompt=(3, 4), generated=(), **params) -> SeqSamplingState:
    params.setdefault("seed", 0)
    return SeqSamplingState(SamplingParams(**params), list(prompt) + list(generated), len(prompt))


def _support(logits_row: torch.Tensor, num_draws: int, **params) -> set[int]:
    """Draws num_draws tokens (one row per seed, one batch) from identical logits."""
    logits = logits_row.unsqueeze(0).repeat(num_draws, 1)
    states = [_state(seed=s, do_sample=True, **params) for s in range(num_draws)]
    return {s.token_id for s in sample(logits, states)}


def _probs(logits_row: torch.Tensor, temperature: float = 1.0) -> list[float]:
    exps = [math.exp(x / temperature) for x in logits_row.tolist()]
    return [e / sum(exps) for e in exps]


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = _logits(3)
    states = [_state(top_n_tokens=n) for n in (0, 2, 5)]
    out = sample(logits, states)
    ref = torch.log_softmax(logits, dim=-1)
    for row, s in enumerate(out):
        assert s.token_id == int(logits[row].argmax())
        assert s.logprob == pytest.approx(float(ref[row, s.token_id]), abs=1e-5)
        n = states[row].params.top_n_tokens
        expected = sorted(range(VOCAB), key=lambda t: -float(ref[row, t]))[:n]
        assert [t.token_id for t in s.top_tokens] == expected
        for t in s.top_tokens:
            assert t.logprob == pytest.approx(float(ref[row, t.token_id]), abs=1e-5)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["cpu-kernel", "torch"])
def test_greedy_tokens_and_logprobs_are_the_same_with_and_without_the_kernel(monkeypatch, use_kernels: bool):
    if use_kernels and not kernels.available():
        pytest.skip("Loom's CPU kernels are not in use here")
    monkeypatch.setattr(kernels, "available", lambda: use_kernels)
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 4
    out = sample(logits, [_state(top_n_tokens=3) for _ in range(4)])
    ref = torch.log_softmax(logits, dim=-1)
    assert [s.token_id for s in out] == logits.argmax(dim=-1).tolist()
    assert [s.logprob for s in out] == pytest.approx(ref.max(dim=-1).values.tolist(), abs=2e-6)
    assert [[t.token_id for t in s.top_tokens] for s in out] == ref.topk(3).indices.tolist()


def test_logprob_is_from_raw_logits_even_when_processing_changes_the_choice():
    logits = _logits(1)
    target = int(logits[0].argmin())
    out = sample(logits, [_state(logit_bias={target: 100.0}, top_n_tokens=1)])[0]
    assert out.token_id == target
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, target]), abs=1e-5)
    assert out.top_tokens[0].token_id == int(logits[0].argmax())  # raw top token, not the biased one


def test_seeded_sampling_is_independent_of_batch_and_row_order():
    logits = _logits(4, seed=1)
    states = [_state(seed=100 + i, generated=[1] * i, do_sample=True, temperature=1.5) for i in range(4)]
    alone = [sample(logits[i : i + 1], [states[i]])[0].token_id for i in range(4)]
    batch = [s.token_id for s in sample(logits, states)]
    order = [3, 1, 0, 2]
    shuffled = sample(logits[order], [states[i] for i in order])
    assert batch == alone
    assert [s.token_id for s in shuffled] == [alone[i] for i in order]


def test_token_i_depends_on_seed_and_position_only():
    """A resumed sequence (same seed, same number generated) draws the same token."""
    logits = torch.zeros(1, VOCAB)  # uniform: the draw is pure noise
    a = sample(logits, [_state(prompt=[1, 2, 3], generated=[5, 6], seed=7, do_sample=True)])[0]
    b = sample(logits, [_state(prompt=[9], generated=[0, 0], seed=7, do_sample=True)])[0]
    assert a.token_id == b.token_id
    draws = [sample(logits, [_state(generated=[0] * i, seed=7, do_sample=True)])[0].token_id for i in range(12)]
    assert len(set(draws)) > 1  # the position changes the draw


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB)
    tokens = [sample(logits, [_state(seed=s, do_sample=True)])[0].token_id for s in range(20)]
    assert len(set(tokens)) > 5


def test_sampling_frequencies_follow_temperature_scaled_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    num_draws = 4000
    rows = logits.repeat(num_draws, 1)
    states = [_state(seed=s, do_sample=True, temperature=0.7) for s in range(num_draws)]
    counts = torch.bincount(torch.tensor([s.token_id for s in sample(rows, states)]), minlength=4)
    expected = _probs(logits[0], temperature=0.7)
    for token, p in enumerate(expected):
        assert counts[token].item() / num_draws == pytest.approx(p, abs=0.03)


def test_top_k_restricts_support():
    row = _logits(1, seed=2)[0]
    expected = set(sorted(range(VOCAB), key=lambda t: -float(row[t]))[:3])
    assert _support(row, 600, top_k=3) == expected


def test_top_p_restricts_support():
    row = _logits(1, seed=3)[0]
    probs = _probs(row)
    ranked = sorted(range(VOCAB), key=lambda t: -probs[t])
    expected, mass = set(), 0.0
    for t in ranked:  # smallest likeliest set reaching the mass
        expected.add(t)
        mass += probs[t]
        if mass >= 0.8:
            break
    support = _support(row, 1500, top_p=0.8)
    assert support == expected  # every kept token is likely enough to show up in the draws


def test_min_p_restricts_support():
    row = _logits(1, seed=4)[0]
    probs = _probs(row)
    expected = {t for t in range(VOCAB) if probs[t] >= 0.2 * max(probs)}
    support = _support(row, 1500, min_p=0.2)
    assert support == expected  # every kept token is likely enough to show up in the draws


def test_typical_p_restricts_support():
    row = _logits(1, seed=5)[0]
    probs = _probs(row)
    entropy = -sum(p * math.log(p) for p in probs)
    by_typicality = sorted(range(VOCAB), key=lambda t: abs(-math.log(probs[t]) - entropy))
    expected, mass = set(), 0.0
    for t in by_typicality:  # most typical tokens until their mass reaches typical_p
        expected.add(t)
        mass += probs[t]
        if mass >= 0.5:
            break
    support = _support(row, 1500, typical_p=0.5)
    assert support == expected  # every kept token is likely enough to show up in the draws


def test_filters_do_not_leak_between_rows():
    row = _logits(1, seed=6)[0]
    logits = row.unsqueeze(0).repeat(400, 1)
    states = [_state(seed=s, do_sample=True, top_k=1 if s % 2 else None) for s in range(400)]
    out = sample(logits, states)
    top = int(row.argmax())
    assert all(o.token_id == top for o, st in zip(out, states) if st.params.top_k == 1)
    assert len({o.token_id for o, st in zip(out, states) if st.params.top_k is None}) > 2


def test_repetition_penalty_matches_definition():
    row = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    state = _state(prompt=[0, 1], generated=[1, 4], repetition_penalty=2.0)
    out = process_row(row, state)
    # seen {0, 1, 4}: positive divided, negative multiplied; others untouched
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0, 0.25, 3.0]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    row = torch.tensor([1.0, 1.0, 1.0, 1.0])
    state = _state(prompt=[0, 0, 0], generated=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = process_row(row, state)
    assert out.tolist() == pytest.approx([1.0, 1.0 - 2 * 0.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0])


def test_logit_bias_is_added():
    row = torch.tensor([1.0, 2.0, 3.0])
    out = process_row(row, _state(logit_bias={0: 5.0, 2: -1.5}))
    assert out.tolist() == [6.0, 2.0, 1.5]


def test_processing_order_bias_before_repetition_penalty():
    row = torch.tensor([1.0, 0.0])
    out = process_row(row, _state(prompt=[0], logit_bias={0: -3.0}, repetition_penalty=2.0))
    assert out.tolist() == [-4.0, 0.0]  # (1 - 3) * 2: the bias made it negative first


def test_min_new_tokens_masks_eos_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # EOS is the clear favourite
    params = dict(eos_token_ids=(2,), min_new_tokens=2)
    assert sample(logits, [_state(generated=[5], **params)])[0].token_id != 2
    assert sample(logits, [_state(generated=[5, 6], **params)])[0].token_id == 2
    sampled = sample(logits, [_state(generated=[], do_sample=True, **params)])[0]
    assert sampled.token_id != 2


def test_greedy_rows_untouched_by_sampling_rows():
    logits = _logits(2, seed=8)
    out = sample(logits, [_state(), _state(do_sample=True, seed=3, temperature=5.0)])
    assert out[0].token_id == int(logits[0].argmax())


def test_temperature_zero_is_greedy():
    logits = _logits(1, seed=9)
    out = sample(logits, [_state(do_sample=True, temperature=0.0)])[0]
    assert out.token_id == int(logits[0].argmax())


def test_top_p_on_a_large_vocabulary_peaked_and_flat_rows():
    """Rows whose mass sits in a few tokens and rows that need the full sort agree with the definition."""
    g = torch.Generator().manual_seed(11)
    vocab = 3000
    logits = torch.stack([torch.randn(vocab, generator=g) * 6.0, torch.randn(vocab, generator=g) * 0.3])
    params = [SamplingParams(seed=0, do_sample=True, top_p=0.9) for _ in range(2)]
    kept = [set(torch.nonzero(row > 0).flatten().tolist()) for row in filtered_probs(logits, params)]
    for row, kept_ids in zip(logits, kept):
        probs = torch.softmax(row.double(), dim=-1).tolist()
        expected, mass = set(), 0.0
        for t in sorted(range(vocab), key=lambda t: -probs[t]):
            expected.add(t)
            mass += probs[t]
            if mass >= 0.9:
                break
        assert kept_ids == expected
    assert len(kept[0]) < 256 < len(kept[1])  # both the quick path and the full sort ran


def test_tied_alternatives_are_ordered_by_id_whatever_the_batch():
    """bfloat16 logits tie often; which tied token is an alternative must not depend on the
    batch's shape (a verify step samples several rows of one sequence)."""
    row = torch.zeros(VOCAB)
    row[[2, 5, 9, 11]] = torch.tensor([3.0, 1.0, 1.0, 1.0])  # 5, 9 and 11 tie for second place
    for num_rows in (1, 3, 7):
        out = sample(row.repeat(num_rows, 1), [_state(top_n_tokens=3) for _ in range(num_rows)])
        assert all([t.token_id for t in s.top_tokens] == [2, 5, 9] for s in out)
