"""Router and shard run on uvloop (a dependency of both on Linux), and on asyncio without it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from loom_proto.event_loop import GC_THRESHOLDS, freeze_startup_heap, run_event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_where_installed_else_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_event_loop(_loop_module()).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    assert run_event_loop(_loop_module()).startswith("asyncio")


def test_the_startup_heap_is_frozen_and_collections_come_less_often() -> None:
    import gc

    kept = [object() for _ in range(10)]  # noqa: F841 (what a process keeps after startup)
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults (a test before may have frozen this process's heap)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] > 700
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
