"""Turns one step's last-position logits into sampled tokens, per request.

Logit processing (bias, penalties, EOS masking) and filters (temperature, top-k,
top-p, typical-p, min-p) touch only the rows that ask for them; the common
all-greedy batch is one pass per row (argmax and the log-softmax's terms), a greedy token's
logprob being -log_sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom_proto.step import SamplingParams, TokenLogprob
from loom_shard.layers.elementwise import kernels_for
from loom_shard.runtime.token_mask import apply_allowed_masks
from loom_shard.transfers import HostCopy, to_device

_MASK64 = (1 << 64) - 1
_TWO_POW_MINUS_53 = 2.0**-53
_TOP_P_CANDIDATES = 256  # likeliest tokens searched for the top-p cut before a full sort
_TIE_MARGIN = 8  # extra top-n candidates, so tied alternatives are ordered by id, not by topk's luck


@dataclass(slots=True)
class SeqSamplingState:
    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    allowed_mask: bytes | None = None  # constrained decoding: packed bitmask from the router

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float  # from the raw logits: the model's own probability
    top_tokens: list[TokenLogprob]  # len == params.top_n_tokens, most likely first


def hash64(seed: int, index: int) -> int:
    """Mixes (seed, index) into a 64-bit generator seed (splitmix64 finalizer).

    Token `index` of a sequence is drawn from a generator seeded with this, so it
    depends on nothing but the request's seed and its position.
    """
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample(logits: torch.Tensor, states: list[SeqSamplingState]) -> list[Sample]:
    """Samples one token per row.

    Args:
        logits: [num_seqs, vocab] float32, the raw model output at each sequence's last position.
        states: one per row, in the same order.
    Returns:
        One `Sample` per row; `logprob` and `top_tokens` come from log_softmax of the raw logits.
    """
    return sample_on_device(logits, states).samples()


def sample_on_device(logits: torch.Tensor, states: list[SeqSamplingState]) -> SampleTable:
    """`sample` without waiting for the device: the chosen ids stay on the device (where a next
    step's inputs can read them) and the table's copy to the host is queued behind them."""
    assert logits.dim() == 2 and logits.shape[0] == len(states)
    logits = logits.float()
    processed = process_logits(logits, states)
    processed = apply_allowed_masks(processed, [s.allowed_mask for s in states])
    terms = logprob_terms(logits)
    token_ids = _choose_tokens(processed, states, terms.argmax if processed is logits else processed.argmax(dim=-1))
    return _sample_table(logits, token_ids, states, terms)


@dataclass(slots=True)
class SampleTable:
    """A step's samples, one row each: [token_id, logprob, top ids..., top logprobs...] in float64
    (which holds every token id and float32 logprob exactly), copied to the host in one transfer."""

    token_ids: torch.Tensor  # [rows] int64, on the logits' device
    host: HostCopy  # [rows, 2 + 2 * max_top_n] float64, on its way to the host
    max_top_n: int  # alternatives per row in the table (with a margin for ties)
    top_n: list[int]  # each row's top_n_tokens

    def ready(self) -> bool:
        """Is the table on the host (samples would not wait for the device)?"""
        return self.host.ready()

    def wait(self) -> None:
        self.host.wait()

    def samples(self) -> list[Sample]:
        """The samples, once the table is on the host (waits for the device)."""
        table = self.host.read().tolist()
        if self.max_top_n == 0:  # no alternatives asked for in the whole step (most decode steps)
            return [Sample(token_id=int(row[0]), logprob=row[1], top_tokens=[]) for row in table]
        samples = []
        for row, n in zip(table, self.top_n):
            top_ids, top_logprobs = row[2 : 2 + self.max_top_n], row[2 + self.max_top_n :]
            top = sorted(zip(top_logprobs, top_ids), key=lambda pair: (-pair[0], pair[1]))[:n]  # ties: lower id first
            top_tokens = [TokenLogprob(int(t), lp) for lp, t in top]
            samples.append(Sample(token_id=int(row[0]), logprob=row[1], top_tokens=top_tokens))
        return samples


@dataclass(slots=True)
class LogprobTerms:
    """Per row of the raw logits: the greedy token, and the log-softmax's terms, so that
    logprob(token) = (logit - max) - log_sum (torch's log_softmax order)."""

    argmax: torch.Tensor  # [rows] int64
    max: torch.Tensor  # [rows] float32
    log_sum: torch.Tensor  # [rows] float32: log(sum(exp(logits - max)))

    def logprobs(self, values: torch.Tensor) -> torch.Tensor:
        """values [rows, k] of raw logits -> their logprobs."""
        return (values - self.max.unsqueeze(1)) - self.log_sum.unsqueeze(1)


def logprob_terms(logits: torch.Tensor) -> LogprobTerms:
    """One kernel over each row where Loom has one for the device (C++ on CPU, Triton on CUDA; no
    [rows, vocab] log-softmax written); torch's ops elsewhere."""
    ops = kernels_for(logits)
    if ops is not None:
        return LogprobTerms(*ops.greedy_logprob_terms(logits))
    row_max = logits.amax(dim=-1)
    log_sum = (logits - row_max.unsqueeze(1)).exp().sum(dim=-1).log()
    return LogprobTerms(logits.argmax(dim=-1), row_max, log_sum)


def process_logits(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Applies logit bias, repetition/frequency/presence penalties and min_new_tokens.

    Returns `logits` itself when no row needs processing, else a processed copy.
    """
    rows = [i for i, s in enumerate(states) if _needs_processing(s)]
    if not rows:
        return logits
    processed = logits.clone()
    for i in rows:
        _process_row_(processed[i], states[i])
    return processed


def _needs_processing(state: SeqSamplingState) -> bool:
    p = state.params
    return bool(p.logit_bias or reads_history(p) or (p.eos_token_ids and state.num_generated < p.min_new_tokens))


def reads_history(params: SamplingParams) -> bool:
    """Does sampling read the values of the sequence's tokens so far (the penalties)?"""
    return bool((params.repetition_penalty is not None and params.repetition_penalty != 1.0)
                or params.frequency_penalty or params.presence_penalty)


def process_row(row: torch.Tensor, state: SeqSamplingState) -> torch.Tensor:
    """Processes one row ([vocab]) in the documented order; returns a new tensor."""
    row = row.clone()
    _process_row_(row, state)
    return row


def _process_row_(row: torch.Tensor, state: SeqSamplingState) -> None:
    p = state.params
    vocab = row.shape[0]
    if p.logit_bias:
        ids = to_device(list(p.logit_bias.keys()), row.device)
        row.index_add_(0, ids, to_device(list(p.logit_bias.values()), row.device, row.dtype))
    if p.repetition_penalty is not None and p.repetition_penalty != 1.0 and state.token_ids:
        seen = to_device(sorted(set(state.token_ids)), row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    generated = state.token_ids[state.num_prompt_tokens :]
    if (p.frequency_penalty or p.presence_penalty) and generated:
        ids = to_device(generated, row.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)  # [vocab]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.eos_token_ids and len(generated) < p.min_new_tokens:
        row[to_device(list(p.eos_token_ids), row.device)] = float("-inf")


def _is_greedy(params: SamplingParams) -> bool:
    # temperature 0 is the usual spelling of greedy; sampling at it would divide by zero
    return not params.do_sample or params.temperature <= 0.0


def _choose_tokens(processed: torch.Tensor, states: list[SeqSamplingState], greedy: torch.Tensor) -> torch.Tensor:
    """greedy: processed's argmax per row, the answer for every greedy row."""
    token_ids = greedy
    rows = [i for i, s in enumerate(states) if not _is_greedy(s.params)]
    if rows:
        token_ids = greedy.clone()
        index = to_device(rows, processed.device)
        sub_states = [states[i] for i in rows]
        probs = filtered_probs(processed.index_select(0, index), [s.params for s in sub_states])
        token_ids[index] = _draw(probs, sub_states)
    return token_ids


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p, typical-p and min-p; returns probabilities [rows, vocab].

    Each filter runs only over the rows that set it, vectorized across them.
    """
    device = logits.device
    temperatures = to_device([p.temperature for p in params], device, logits.dtype)
    logits = logits / temperatures.unsqueeze(1)
    logits = _apply_filter(logits, params, "top_k", _top_k)
    logits = _apply_filter(logits, params, "top_p", _top_p)
    logits = _apply_filter(logits, params, "typical_p", _typical_p)
    logits = _apply_filter(logits, params, "min_p", _min_p)
    return torch.softmax(logits, dim=-1)


FilterFn = Callable[[torch.Tensor, list], torch.Tensor]  # (logits [rows, vocab], each row's value)


def _apply_filter(logits: torch.Tensor, params: list[SamplingParams], name: str, fn: FilterFn) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if _filter_active(name, getattr(p, name))]
    if not rows:
        return logits
    index = to_device(rows, logits.device)
    logits = logits.clone()
    logits[index] = fn(logits.index_select(0, index), [getattr(params[i], name) for i in rows])
    return logits


def _filter_active(name: str, value: float | int | None) -> bool:
    if value is None:
        return False
    if name == "top_k":
        return value > 0
    if name == "min_p":
        return value > 0.0
    return value < 1.0  # top_p, typical_p: 1.0 keeps everything


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keeps each row's k largest logits (ties at the k-th value are kept too)."""
    vocab = logits.shape[-1]
    k = to_device([min(k, vocab) for k in ks], logits.device)
    largest = logits.topk(min(max(ks), vocab), dim=-1).values  # [rows, max_k], descending
    kth = largest.gather(1, (k - 1).unsqueeze(1))  # [rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Keeps the smallest most-likely set whose probability mass reaches top_p (ties kept).

    A full sort of the vocabulary is slow on CPU, so the cut is looked for among each
    row's likeliest few tokens first; only rows whose mass is spread wider sort everything.
    """
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    top_p = to_device(values, probs.device, probs.dtype).unsqueeze(1)  # [rows, 1]
    thresholds = _top_p_thresholds(probs, top_p, min(_TOP_P_CANDIDATES, probs.shape[-1]))
    wide = thresholds.isnan()
    if probs.is_cuda:  # a full sort is cheap there, and asking which rows need it would sync
        thresholds = torch.where(wide, _top_p_thresholds(probs, top_p, probs.shape[-1]), thresholds)
    elif bool(wide.any()):
        rows = wide.squeeze(1)
        thresholds[rows] = _top_p_thresholds(probs[rows], top_p[rows], probs.shape[-1])
    return logits.masked_fill(probs < thresholds, float("-inf"))


def _top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor, k: int) -> torch.Tensor:
    """The smallest kept probability per row [rows, 1]; NaN where the top k fall short of top_p."""
    values = probs.topk(k, dim=-1).values  # [rows, k], descending
    cumulative = values.cumsum(dim=-1)
    num_keep = ((cumulative - values) < top_p).sum(dim=-1, keepdim=True)  # >= 1: top_p > 0
    thresholds = values.gather(1, num_keep - 1)
    if k == probs.shape[-1]:
        return thresholds  # the whole vocabulary: reached, up to rounding
    return thresholds.masked_fill(cumulative[:, -1:] < top_p, float("nan"))


def _typical_p(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.), as in HF's TypicalLogitsWarper."""
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)  # [rows, 1]
    surprise_gap = (-log_probs - entropy).abs()
    sorted_gap, sorted_ids = surprise_gap.sort(dim=-1)
    cumulative = probs.gather(1, sorted_ids).cumsum(dim=-1)
    last = (cumulative < to_device(values, logits.device, logits.dtype).unsqueeze(1)).sum(dim=1, keepdim=True)
    last = last.clamp(max=logits.shape[-1] - 1)
    remove = sorted_gap > sorted_gap.gather(1, last)
    remove[:, 0] = False
    return logits.masked_fill(remove.scatter(1, sorted_ids, remove), float("-inf"))


def _min_p(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Drops tokens less likely than min_p times the most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * to_device(values, logits.device, logits.dtype).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _draw(probs: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """One token per row by inverse transform sampling: the first token whose cumulative
    probability (in id order) exceeds u * total.

    u is a uniform in [0, 1) made from hash64(seed, tokens generated so far), so a draw
    depends on nothing but the row's own probabilities, seed and position: not on the
    batch around it, a preemption in between, or the device. It is what
    torch.multinomial does with one uniform, without a generator per row.
    """
    uniforms = [(hash64(s.params.seed, s.num_generated) >> 11) * _TWO_POW_MINUS_53 for s in states]
    u = to_device(uniforms, probs.device, torch.float64).unsqueeze(1)  # [rows, 1]
    cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]; float64 so rare tokens keep their width
    token_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return token_ids.clamp(max=probs.shape[-1] - 1)


def _sample_table(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, states: list[SeqSamplingState], terms: LogprobTerms
) -> SampleTable:
    vocab = raw_logits.shape[-1]
    if token_ids is terms.argmax:  # every row took its raw argmax: (max - max) - log_sum, without the gather
        chosen = (0.0 - terms.log_sum).unsqueeze(1)
    else:
        chosen = terms.logprobs(raw_logits.gather(1, token_ids.unsqueeze(1)))  # [num_seqs, 1]
    max_top_n = min(max((s.params.top_n_tokens for s in states), default=0), vocab)
    if max_top_n > 0:  # torch.topk orders equal values differently for different batch shapes
        max_top_n = min(max_top_n + _TIE_MARGIN, vocab)
    columns = [token_ids.unsqueeze(1).double(), chosen.double()]
    if max_top_n > 0:
        top = raw_logits.topk(max_top_n, dim=-1)  # logprobs are the logits shifted per row: the same order
        columns += [top.indices.double(), terms.logprobs(top.values).double()]
    return SampleTable(token_ids, HostCopy(torch.cat(columns, dim=1)), max_top_n,
                       [s.params.top_n_tokens for s in states])
