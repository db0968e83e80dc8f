"""The sampler on CUDA: greedy rows queued without a host sync (their one device-to-host copy is
waited for when the samples are read), and a number of host syncs that does not grow with the
batch for sampled rows (no per-row syncs)."""

from __future__ import annotations

import warnings

import torch

from loom_proto.step import SamplingParams
from loom_shard.runtime.sampler import SeqSamplingState, sample, sample_on_device


def _syncs_of(fn) -> int:  # noqa: ANN001
    """Synchronizing calls torch reports (sync debug mode) while fn runs (after one warm run:
    first calls report one-time work)."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _count_syncs(logits: torch.Tensor, states: list[SeqSamplingState]) -> int:
    return _syncs_of(lambda: sample_on_device(logits, states))


def _states(num: int, **params) -> list[SeqSamplingState]:
    return [SeqSamplingState(SamplingParams(seed=i, top_n_tokens=3, **params), [1, 2, 3], 3) for i in range(num)]


def test_greedy_rows_are_sampled_without_waiting() -> None:
    # Queuing a greedy step's sampling and its one copy to the host synchronizes nothing, whatever
    # the batch; reading the samples waits for that copy's event (which sync debug mode does not count).
    _count_syncs(torch.randn(4, 1000, device="cuda"), _states(4))
    counts = [_count_syncs(torch.randn(n, 1000, device="cuda"), _states(n)) for n in (2, 16, 64)]
    assert counts == [0, 0, 0]
    logits = torch.randn(16, 1000, device="cuda")
    assert sample(logits, _states(16)) == sample_on_device(logits, _states(16)).samples()


def test_sampled_rows_add_no_per_row_syncs() -> None:
    params = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    _count_syncs(torch.randn(4, 1000, device="cuda"), _states(4, **params))  # the one-time extra call
    few = _count_syncs(torch.randn(2, 1000, device="cuda"), _states(2, **params))
    many = _count_syncs(torch.randn(32, 1000, device="cuda"), _states(32, **params))
    assert many == few
