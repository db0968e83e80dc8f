"""tests/gpu/: every test here needs CUDA (marked `cuda`); without a GPU they are skipped, except
the `interpretable` ones when TRITON_INTERPRET=1: Triton's interpreter runs their kernels on the
CPU (tests/unit/shard/test_triton_interpreted.py starts them so)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available() and not (interpreted and item.get_closest_marker("interpretable")):
                item.add_marker(skip)
