"""keep_freed_memory_mapped: freed multi-MB CPU buffers are reused without page faults."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from loom_shard.runtime.model_setup import keep_freed_memory_mapped


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_reallocated_buffers_do_not_fault_again() -> None:
    assert keep_freed_memory_mapped()
    num_pages = (20 << 20) // resource.getpagesize()  # one 8 MB and one 12 MB float32 buffer
    torch.ones(2 << 20), torch.ones(3 << 20)  # first use may fault
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        a, b = torch.ones(2 << 20), torch.ones(3 << 20)  # the per-layer temporaries of a step
        del a, b
    faults_per_round = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    # glibc trims the freed top of the heap by default: ~40% of the pages fault again every round.
    assert faults_per_round < num_pages / 4
