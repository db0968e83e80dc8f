"""Loom's Triton kernels (paged attention alone and in padded graph steps, the elementwise ops, the
MoE grouped GEMM) checked on the CPU by Triton's interpreter: the `interpretable` tests of
tests/gpu, each module in a process of its own started with TRITON_INTERPRET=1 (read when triton
is first imported; no other test's process should see interpreted kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

GPU_TESTS = Path(__file__).parents[2] / "gpu"
MODULES = ["test_paged_features.py", "test_step_graphs_triton.py", "test_elementwise_cuda.py", "test_moe_grouped.py"]


@pytest.mark.parametrize("module", MODULES)
def test_triton_kernels_under_the_interpreter(module: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpretable",
               str(GPU_TESTS / module)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]  # skipped: only what needs CUDA itself (graphs, layer choice)
