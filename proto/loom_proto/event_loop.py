"""The event loop router and shard run on."""

from __future__ import annotations

import asyncio
import gc
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


# Cyclic collections: the first generation after 50,000 net new objects (default 700), the older
# ones after 20 of the younger's (default 10). Serving allocates a few objects per token that
# reference counting frees at once; with the defaults a frontend streaming to 256 clients spent a
# fifth of its CPU in collections that found almost nothing (bench/BENCHMARKS.md, the ceiling).
GC_THRESHOLDS = (50_000, 20, 20)


def freeze_startup_heap() -> None:
    """Once a process has loaded what it keeps for its lifetime (model metadata, tokenizer, app),
    move those objects out of the cyclic garbage collector's reach (`gc.freeze`): a full
    collection then scans only what serving allocates, not the whole startup heap, whose scans
    otherwise land in the middle of a step or a stream's write. Collections then run less often
    (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
