"""Every kind of step (decodes, prefill chunks beside decodes, speculative drafts, one long prefill)
through the step graphs with the Triton paged kernel, against the same step run eagerly: on CUDA
through captured graphs, with TRITON_INTERPRET=1 on the CPU with the interpreted kernel and each
replay an eager forward over the graph's static inputs (tests/unit/shard/test_step_graphs.py runs
the same cases with the C++ kernel). Padding writes nothing outside the scratch block.

The graph runs the bucket's token count and the eager step its own, and this model's linears are
torch's, which are not row-invariant on every device (cuBLAS; on an AMD EPYC torch's CPU GEMM gave
a row among 5 one bit apart from the same row among 8): rows, and the K/V the step rewrites for
its own tokens, are compared within float32 rounding here; the C++ kernel's test, on the runner's
row-invariant linears, compares both bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from loom_shard.attention.backend import BackendKind, PagedBackend, _triton_kernel
from loom_shard.runtime.cuda_graphs import StepGraphs
from tests.unit.shard.conftest import make_pair
from tests.unit.shard.test_step_graphs import STEPS, EagerStepGraphs, Setup, make_setup, replay_and_eager

triton_paged = pytest.importorskip("loom_shard.attention.triton_paged", reason="needs triton")
pytestmark = pytest.mark.interpretable
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture(scope="module")
def setup() -> Setup:
    model = make_pair("llama").loom.to(DEVICE)
    kernel = _triton_kernel(triton_paged)
    backend = PagedBackend(torch.device(DEVICE), kernel, BackendKind.TRITON)
    return make_setup(model, backend, kernel, StepGraphs if DEVICE == "cuda" else EagerStepGraphs, DEVICE)


@pytest.mark.parametrize("name", list(STEPS))
def test_a_padded_step_gives_the_eager_rows(setup: Setup, name: str) -> None:
    got, expected = replay_and_eager(setup, STEPS[name], same_kv=torch.testing.assert_close)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
