"""The pinned staging buffer a CUDA graph step's inputs pass through (`runtime.staging`)."""

from __future__ import annotations

import pytest
import torch

from loom_shard.runtime.staging import PinnedStaging


def test_staged_tensors_are_pinned_copies_in_one_buffer() -> None:
    staging = PinnedStaging([40, 40])
    packed, ids = torch.arange(10, dtype=torch.int32), torch.arange(5, dtype=torch.long) * 7
    staged = staging.stage(packed, ids)
    assert [t.tolist() for t in staged] == [packed.tolist(), ids.tolist()]
    assert all(t.is_pinned() and t.dtype == s.dtype for t, s in zip(staged, (packed, ids)))
    assert staged[1].data_ptr() - staged[0].data_ptr() == 64  # each on its own cache line
    assert staged[0].untyped_storage().data_ptr() == staging.buffer.untyped_storage().data_ptr()


def test_refills_reach_the_device_in_order() -> None:
    staging = PinnedStaging([8 << 16])
    device = torch.empty(1 << 16, dtype=torch.long, device="cuda")
    seen = []
    for value in range(20):  # each step's copy is read before the next step overwrites the buffer
        (staged,) = staging.stage(torch.full((1 << 16,), value, dtype=torch.long))
        device.copy_(staged, non_blocking=True)
        staging.done_reading()
        seen.append(device.sum())
    assert [int(s.item()) for s in seen] == [v * (1 << 16) for v in range(20)]


def test_too_much_to_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes to stage"):
        PinnedStaging([100]).stage(torch.zeros(20, dtype=torch.long))
