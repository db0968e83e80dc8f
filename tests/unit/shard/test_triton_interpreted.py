"""Loom's Triton kernels checked on the CPU by Triton's interpreter, each module of checks in a
process of its own: TRITON_INTERPRET is read when triton is first imported, and no other test's
process should see interpreted kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent
CHECKS = ["interpreted_paged_kernel.py"]


@pytest.mark.parametrize("checks", CHECKS)
def test_triton_kernels_under_the_interpreter(checks: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / checks)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
