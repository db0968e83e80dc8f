"""Sends a request sequence at a fixed concurrency or at a request rate (Poisson, or gamma
with --burstiness), to one server or, with --compare, to two: each request goes to both,
one after the other in alternating order, so both see the same sequence under the same load."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from loom_bench.backends import Backend, BackendOptions, RequestResult, send
from loom_bench.datasets import BenchRequest


@dataclass(slots=True, frozen=True)
class Load:
    """A fixed concurrency (rate inf), a request rate (concurrency None), or both."""

    concurrency: int | None
    request_rate: float  # requests per second; inf: all at once (bounded by concurrency)
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular

    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"rate={self.request_rate:g}/s")
        return ", ".join(parts) or "all at once"

    def intervals(self, n: int, seed: int) -> list[float]:
        """Seconds to wait before each request."""
        if math.isinf(self.request_rate):
            return [0.0] * n
        rng = random.Random(seed)
        theta = 1.0 / (self.request_rate * self.burstiness)
        return [rng.gammavariate(self.burstiness, theta) for _ in range(n)]


@dataclass(slots=True)
class RunResult:
    load: Load
    duration_s: float
    by_server: dict[str, list[RequestResult]]


async def run_load(requests: list[BenchRequest], servers: list[str], backend: Backend, opts: BackendOptions,
                   load: Load, seed: int, progress: bool = True, timeout_s: float = 600.0,
                   api_key: str | None = None) -> RunResult:
    by_server: dict[str, list[RequestResult]] = {server: [] for server in servers}
    semaphore = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    bar = tqdm(total=len(requests) * len(servers), desc=load.label(), disable=not progress, unit="req")

    # A connection per request (as vLLM's benchmark, a session per request): llama.cpp's server
    # closes idle keep-alive connections, and aiohttp, unlike httpx, does not retry a request
    # written to a closed one. No pool limit: the load decides how many are open.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)  # per read, as httpx's
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None  # a server started with --api-key
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:

        async def one(index: int, request: BenchRequest) -> None:
            order = servers if index % 2 == 0 else servers[::-1]  # alternate who goes first
            if semaphore is not None:
                await semaphore.acquire()
            try:
                for server in order:
                    by_server[server].append(await send(backend, client, server, request, opts))
                    bar.update(1)
            finally:
                if semaphore is not None:
                    semaphore.release()

        start = time.perf_counter()
        tasks = []
        for index, (request, wait_s) in enumerate(zip(requests, load.intervals(len(requests), seed))):
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            tasks.append(asyncio.create_task(one(index, request)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return RunResult(load, duration, by_server)
