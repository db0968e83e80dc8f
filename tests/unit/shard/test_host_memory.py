"""keep_freed_memory_mapped: freed multi-MB CPU buffers are reused without page faults."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from loom_shard.runtime.model_setup import keep_freed_memory_mapped

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only")


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


# A worker thread that holds 60 MB of what it loaded, then frees an 8 MB temporary every step. In
# a thread's own arena (heaps of at most 64 MB) the temporary needs a heap of its own, which glibc
# unmaps once it is empty: about half of the temporary's pages faulted again every step.
WORKER = textwrap.dedent("""
    import resource, threading, torch
    from loom_shard.runtime.model_setup import keep_freed_memory_mapped
    assert keep_freed_memory_mapped()
    torch.set_num_threads(1)
    faults = []
    def work():
        kept = [torch.ones(5 << 20) for _ in range(3)]
        for _ in range(3):
            torch.ones(2 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            torch.ones(2 << 20)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(faults[0])
""")


def test_a_worker_threads_temporaries_do_not_fault_again() -> None:
    """The shard's worker thread, started after the call, in a fresh interpreter (the arena limit
    holds only for threads that have not allocated yet) with the malloc tunable the launcher gives
    the shard. (Without it glibc may still miss the freed temporary: a 64-byte-aligned request can
    be a few bytes larger than the chunk it freed, in some address layouts.)"""
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, check=True, timeout=120,
                          env=env)
    num_pages = (8 << 20) // resource.getpagesize()
    assert float(done.stdout) < num_pages / 20
