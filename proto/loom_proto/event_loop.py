"""The event loop router and shard run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop where it is installed (a router and shard dependency on Linux), else
    on asyncio's loop. uvloop's callbacks and socket writes cost less CPU per streamed token and
    per gRPC step; on a CPU-served model that CPU is taken from the shard's forward
    (bench/BENCHMARKS.md, "Serving overhead at one stream")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
