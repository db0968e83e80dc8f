"""Router and shard run on uvloop (a dependency of both on Linux), and on asyncio without it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from loom_proto.event_loop import run_event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_where_installed_else_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_event_loop(_loop_module()).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    assert run_event_loop(_loop_module()).startswith("asyncio")
