"""A soak: mixed traffic against Loom for a while (10 minutes by default), then a report.

    python bench/soak.py                        # starts a launcher (embedded model) and soaks it
    python bench/soak.py --minutes 2 --clients 12
    python bench/soak.py --url http://host:3000 --pids 4101,4102,4103   # a server already running

The mix, from --clients concurrent clients: TGI generate and generate_stream, OpenAI completions
with n > 1 (each choice its own temperature), chat streams, structured output (JSON schema,
choice, TGI regex), streams hung up on after a few events, and invalid requests. Progress goes to
stdout every --every seconds. The report counts errors (a 5xx, a transport error, a stream that
ended with an error event or without its end, an invalid request not refused, a constrained
answer that breaks its constraint), the resident memory growth of each process since the end of
a warm-up minute, and whether the KV blocks went back to idle (loom_kv_blocks_used == 0 once no
request runs). Exit status 0 only when there were no errors and the blocks went back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import free_port, machine, metrics, serving

SYSTEM = "You are a terse assistant for ACME support. Answer in one short sentence."
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                                  "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer", "confidence"], "additionalProperties": False}
CHOICES = ["red", "green", "blue"]
INVALID = [b'{"inputs": ', b'{"inputs": "x", "parameters": {"max_new_tokens": -3}}',
           b'{"inputs": "x", "parameters": {"top_k": 4294967296}}', b'{"prompt": "x", "temperature": 1e999}',
           b'{"inputs": "a\\ud800b"}', b"\xff\xfe"]
OK_STATUSES = {200, 422, 429}  # 429: the server was full (--max-concurrent-requests), not an error
REFUSED = range(400, 500)  # what an invalid request should get


@dataclass(slots=True)
class Tally:
    """What the clients saw."""

    by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def record(self, kind: str, status: int, expected: Container[int] = OK_STATUSES) -> None:
        self.by_kind[kind] += 1
        self.statuses[status] += 1
        if status not in expected:
            self.error(f"{kind}: HTTP {status}")

    def error(self, what: str) -> None:
        self.errors.append(what)


class Client:
    """One client's loop: a random kind of request, again and again."""

    def __init__(self, url: str, seed: int, tally: Tally) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=300)
        self.rng = random.Random(seed)
        self.tally = tally
        self.kinds = [self.generate, self.generate_stream, self.completions_n, self.chat_stream,
                      self.json_schema, self.choice, self.tgi_regex, self.hang_up, self.invalid]

    async def run_until(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            kind = self.rng.choice(self.kinds)
            try:
                await kind()
            except httpx.HTTPError as error:  # a reset or a timeout: a request left unanswered
                self.tally.error(f"{kind.__name__}: {error!r}")
        await self.http.aclose()

    async def post(self, kind: str, path: str, body: dict[str, Any]) -> httpx.Response:
        response = await self.http.post(path, json=body)
        self.tally.record(kind, response.status_code)
        if response.status_code == 429:
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # as a polite client does
        return response

    async def stream(self, kind: str, path: str, body: dict[str, Any], keep: int | None = None) -> list[str]:
        """The data lines of an SSE answer (the first `keep` only, then the client hangs up)."""
        lines: list[str] = []
        async with self.http.stream("POST", path, json=body) as response:
            self.tally.record(kind, response.status_code)
            if response.status_code != 200:
                await response.aread()
                return []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    lines.append(line[5:].strip())
                    if keep is not None and len(lines) >= keep:
                        return lines  # leaving the block closes the connection mid-stream
        return lines

    def stream_failed(self, kind: str, lines: list[str], is_end: Callable[[str], bool]) -> None:
        if not lines:
            return
        errors = [line for line in lines if "error" in _event(line)]
        if errors:
            self.tally.error(f"{kind}: an error event: {errors[0][:200]}")
        elif not is_end(lines[-1]):
            self.tally.error(f"{kind}: the stream ended without its end: {lines[-1][:200]}")

    async def generate(self) -> None:
        body = {"inputs": f"Tell me about the number {self.rng.randint(1, 999)}.",
                "parameters": {"max_new_tokens": self.rng.randint(1, 24), "do_sample": self.rng.random() < 0.5}}
        await self.post("generate", "/generate", body)

    async def generate_stream(self) -> None:
        body = {"inputs": "Count: 1, 2, 3,", "parameters": {"max_new_tokens": self.rng.randint(4, 40), "details": True}}
        self.stream_failed("generate_stream", await self.stream("generate_stream", "/generate_stream", body),
                           _tgi_end)

    async def completions_n(self) -> None:
        n = self.rng.randint(2, 3)
        body = {"prompt": "Name a colour:", "max_tokens": self.rng.randint(2, 16), "n": n, "seed": self.rng.randint(0, 99),
                "choice_params": [{"temperature": 0.3 * i} for i in range(n)]}
        response = await self.post("completions_n", "/v1/completions", body)
        if response.status_code == 200 and len(response.json()["choices"]) != n:
            self.tally.error(f"completions_n: {len(response.json()['choices'])} choices for n={n}")

    async def chat_stream(self) -> None:
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Question {self.rng.randint(1, 50)}?"}],
                "max_tokens": self.rng.randint(4, 32), "stream": True}
        self.stream_failed("chat_stream", await self.stream("chat_stream", "/v1/chat/completions", body),
                           lambda line: line == "[DONE]")

    async def json_schema(self) -> None:
        body = {"messages": [{"role": "user", "content": "Is the sky blue? Answer as JSON."}], "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}
        response = await self.post("json_schema", "/v1/chat/completions", body)
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                try:
                    answer = json.loads(choice["message"]["content"])
                    assert answer["answer"] in ("yes", "no", "maybe") and set(answer) == {"answer", "confidence"}
                except (ValueError, KeyError, AssertionError, TypeError):
                    self.tally.error(f"json_schema: the answer breaks the schema: {choice['message']['content']!r}")

    async def choice(self) -> None:
        response = await self.post("choice", "/v1/completions", {"prompt": "Pick a colour:", "max_tokens": 8,
                                                                  "guided_choice": CHOICES})
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            if choice["finish_reason"] == "stop" and choice["text"] not in CHOICES:
                self.tally.error(f"choice: {choice['text']!r} is none of the choices")

    async def tgi_regex(self) -> None:
        body = {"inputs": "A year:", "parameters": {"max_new_tokens": 8,
                                                    "grammar": {"type": "regex", "value": "(19|20)[0-9]{2}"}}}
        response = await self.post("tgi_regex", "/generate", body)
        text = response.json().get("generated_text", "") if response.status_code == 200 else ""
        if response.status_code == 200 and not re.fullmatch(r"((19|20)[0-9]{0,2})?", text):
            self.tally.error(f"tgi_regex: {text!r} breaks the regex")

    async def hang_up(self) -> None:
        body = {"inputs": "Write a long story about a fox.", "parameters": {"max_new_tokens": 200}}
        await self.stream("hang_up", "/generate_stream", body, keep=self.rng.randint(1, 4))

    async def invalid(self) -> None:
        path = self.rng.choice(["/generate", "/v1/completions", "/tokenize"])
        response = await self.http.post(path, content=self.rng.choice(INVALID),
                                        headers={"Content-Type": "application/json"})
        self.tally.record("invalid", response.status_code, REFUSED)


def _event(line: str) -> dict[str, Any]:
    """An SSE data line as a JSON object ({} for one that is not: `[DONE]`)."""
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _tgi_end(line: str) -> bool:
    """Is this TGI stream event the last one (the one with the whole generated text)?"""
    return _event(line).get("generated_text") is not None


# ---- the server's side -----------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) * 1024 if match else None


def processes_with(marker: str) -> dict[str, int]:
    """Loom's processes whose command line holds `marker` (the socket path of a launcher we
    started), by role."""
    roles: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker not in cmdline:
            continue
        if "loom_router.main" in cmdline:
            roles["router"] = int(proc.name)
        elif "loom_shard.server" in cmdline:
            rank = re.search(r'"rank":\s*(\d+)', cmdline)
            roles[f"shard {rank.group(1) if rank else '?'}"] = int(proc.name)
        elif "loom_launcher" in cmdline:
            roles["launcher"] = int(proc.name)
    return roles


def server_state(url: str) -> tuple[float, float, float]:
    """(KV blocks used, requests running, requests queued)."""
    m = metrics(url)
    return m.get("loom_kv_blocks_used", -1), m.get("loom_running_requests", -1), m.get("loom_queue_size", -1)


async def wait_idle(url: str, timeout_s: float = 120.0) -> tuple[float, float, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await asyncio.to_thread(server_state, url)
        if state[1] == 0 and state[2] == 0 or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


def megabytes(value: int) -> str:
    return f"{value / 2**20:+.1f} MB" if value else "+0.0 MB"


async def soak(url: str, pids: dict[str, int], args: argparse.Namespace) -> int:
    tally = Tally()
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    warm_until = start + min(60.0, args.minutes * 60 / 5)
    clients = [Client(url, seed, tally) for seed in range(args.clients)]
    runs = [asyncio.create_task(client.run_until(stop_at)) for client in clients]
    baseline: dict[str, int] = {}
    print(f"soaking {url} for {args.minutes:g} min with {args.clients} clients; processes {pids or 'unknown'}")
    while not all(run.done() for run in runs):
        await asyncio.wait(runs, timeout=args.every)
        now = time.monotonic()
        if not baseline and now >= warm_until:  # after the warm-up: lazily made things exist
            baseline = {role: rss for role, pid in pids.items() if (rss := rss_bytes(pid)) is not None}
        used, running, queued = await asyncio.to_thread(server_state, url)
        rss = ", ".join(f"{role} {(rss_bytes(pid) or 0) / 2**20:.0f} MB" for role, pid in pids.items())
        total = sum(tally.statuses.values())
        print(f"[{now - start:6.0f} s] {total} requests ({total / (now - start):.1f}/s), statuses "
              f"{dict(sorted(tally.statuses.items()))}, errors {len(tally.errors)}, running {running:.0f}, "
              f"queued {queued:.0f}, KV blocks used {used:.0f}; RSS {rss}", flush=True)
    used, running, queued = await wait_idle(url)
    return report(tally, pids, baseline, used, running, queued)


def report(tally: Tally, pids: dict[str, int], baseline: dict[str, int], used: float, running: float,
           queued: float) -> int:
    total = sum(tally.statuses.values())
    print("\n==== soak report ====")
    print(f"machine: {machine()}")
    print(f"requests: {total}, by kind {dict(sorted(tally.by_kind.items()))}")
    print(f"statuses: {dict(sorted(tally.statuses.items()))}")
    print(f"errors: {len(tally.errors)}")
    for error in tally.errors[:20]:
        print(f"  {error}")
    for role, pid in pids.items():
        now = rss_bytes(pid)
        if now is None or role not in baseline:
            print(f"RSS {role}: not measured")
        else:
            print(f"RSS {role}: {baseline[role] / 2**20:.0f} MB after warm-up -> {now / 2**20:.0f} MB at the end "
                  f"({megabytes(now - baseline[role])})")
    idle = used == 0 and running == 0 and queued == 0
    print(f"KV blocks back to idle: {'yes' if idle else 'NO'} (used {used:.0f}, running {running:.0f}, "
          f"queued {queued:.0f})")
    return 0 if idle and not tally.errors else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="soak this server instead of starting a launcher")
    parser.add_argument("--pids", default="", help="with --url: process ids whose RSS to follow (comma-separated)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=10, help="concurrent clients (more than the launcher's limit: some 429s)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--launcher-flags", default="--max-concurrent-requests 8",
                        help="flags for the launcher this script starts")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.url:
        pids = {f"pid {pid}": int(pid) for pid in args.pids.split(",") if pid.strip()}
        return asyncio.run(soak(args.url, pids, args))
    port = free_port()
    uds = tempfile.mktemp(prefix="loom-soak-")
    cmd = [sys.executable, "-m", "loom_launcher.cli", "--port", str(port), "--hostname", "127.0.0.1",
           "--shard-uds-path", uds, *args.launcher_flags.split()]
    with serving(cmd, port, "launcher", timeout_s=600.0) as url:
        return asyncio.run(soak(url, processes_with(uds), args))


if __name__ == "__main__":
    sys.exit(main())
