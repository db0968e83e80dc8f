"""A pytest plugin (`-p tests.gpu.e2e_on_cuda`): the e2e suite's real launchers serve on CUDA.

tests/e2e starts every launcher with `--device cpu`; a later `--device cuda` wins (argparse
keeps the last value), so the same tests run unchanged against CUDA shards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    for module in list(sys.modules.values()):
        path = Path(getattr(module, "__file__", None) or "")
        if path.parts[-3:] == ("tests", "e2e", "conftest.py"):
            module.spawn_launcher = _on_cuda(module.spawn_launcher)


def _on_cuda(spawn):  # noqa: ANN001, ANN202 - wraps tests/e2e/conftest.spawn_launcher
    def spawn_on_cuda(folder, *extra_args, **options):  # noqa: ANN001, ANN003, ANN202
        return spawn(folder, *extra_args, "--device", "cuda", **options)

    return spawn_on_cuda
