"""Batch invariance through the real launcher, in the DEFAULT dtype with the embedded model: a
request's greedy tokens and logprobs do not depend on what else the server is doing.

- 16 different greedy requests one at a time, then all at once: identical tokens (with the GGUF's
  linears kept quantized, the default, and dequantized to dense linears); also with a
  KV budget so tight that requests are preempted (swapped and recomputed), with prefill
  chunks of 16 tokens, and with each step planned while the one before runs (--overlap-steps),
  also launched on the shard before the one before it finished (--launch-ahead).
- The same as an AVX2-only CPU runs it (loom_shard.cpu.as_cpu_env: Loom, oneDNN and ATen read the CPU as
  AVX2-only): the shard picks the avx2 kernels build, oneDNN has no bfloat16 path there, so
  Loom's dense kernel runs the bfloat16 linears, and float32 linears are probed as there.
- One prompt cold, then with its prefix cached, restored from a snapshot into a fresh server, and
  as choice 0 of an n=4 request whose choice_params make choice 0 greedy: identical tokens and
  identical logprobs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from loom_shard.cpu import as_cpu_env
from tests.e2e.conftest import Launcher, StartLauncher

pytestmark = pytest.mark.slow

MAX_NEW = 32
BF16_BLOCK_BYTES = 368_640  # 30 layers x 2 x 16 tokens x 3 kv heads x 64 x 2 bytes
PROMPTS = [f"Note {i}: the {['quiet', 'busy', 'old', 'new'][i % 4]} harbour town number {i} " + "and its boats " * (i % 5)
           + "was known for" for i in range(16)]
PREFIX = ("You are a careful assistant for a lighthouse museum. The museum opens at nine, shows lamps, "
          "lenses and logbooks, and closes on Tuesdays. ") * 2
QUESTION = "Question: what does the museum show? Answer:"


async def _generate(client: httpx.AsyncClient, prompt: str) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}}
    response = await client.post("/generate", json=body)
    response.raise_for_status()
    return [t["id"] for t in response.json()["details"]["tokens"]]


def _solo_then_together(server: Launcher) -> tuple[list[list[int]], list[list[int]]]:
    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=900) as client:
            solo = [await _generate(client, p) for p in PROMPTS]
            together = await asyncio.gather(*(_generate(client, p) for p in PROMPTS))
        return solo, list(together)

    return asyncio.run(run())


def _metric(server: Launcher, name: str) -> float:
    """The sum over the metric's labels."""
    lines = httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + " ", name + "{"))]
    assert values, f"{name} not in /metrics"
    return sum(values)


def _first_difference(solo: list[list[int]], together: list[list[int]]) -> str:
    diffs = [(i, next((j for j, (a, b) in enumerate(zip(s, t)) if a != b), min(len(s), len(t))))
             for i, (s, t) in enumerate(zip(solo, together)) if s != t]
    return f"{len(diffs)} of {len(solo)} differ (request, first differing token): {diffs}"


AS_AVX2_CPU = as_cpu_env("avx2")  # the launcher's added environment
THIS_CPU: dict[str, str] = {}


def _start(start_launcher: StartLauncher, cpu: dict[str, str], *flags: str) -> Launcher:
    server = start_launcher(*flags, env=cpu)
    if cpu is AS_AVX2_CPU:  # the shard said what it runs, and /info shows it
        assert "read as avx2" in server.log() and "kernels avx2" in server.log(), server.log()
        assert httpx.get(f"{server.base_url}/info", timeout=10).json()["cpu_kernels"].startswith("avx2")
    return server


@pytest.mark.parametrize("cpu", [THIS_CPU, AS_AVX2_CPU], ids=["this-cpu", "as-avx2-cpu"])
@pytest.mark.parametrize("flags", [(), ("--quantize", "none")], ids=["default", "dense-linears"])
def test_16_greedy_requests_alone_and_concurrent_agree(start_launcher: StartLauncher, flags: tuple[str, ...],
                                                       cpu: dict[str, str]) -> None:
    """The default (quantized GGUF linears) and the dense linears' path (each shape's GEMM probed)."""
    server = _start(start_launcher, cpu, *flags)
    solo, together = _solo_then_together(server)
    assert together == solo, _first_difference(solo, together)


@pytest.mark.parametrize(("cpu", "flags"), [(THIS_CPU, ()), (AS_AVX2_CPU, ("--quantize", "none", "--dtype", "float32"))],
                         ids=["this-cpu", "as-avx2-cpu-float32-dense-linears"])
def test_16_greedy_requests_agree_under_preemption(start_launcher: StartLauncher, cpu: dict[str, str],
                                                   flags: tuple[str, ...]) -> None:
    # ~30 prompt + 32 new tokens -> 4-5 blocks a request; 24 blocks hold ~5 of 16, and a host
    # pool of 8 bfloat16 blocks (4 in float32) makes some preemptions recompute instead of swapping.
    server = _start(start_launcher, cpu, "--max-batch-total-tokens", "384", "--max-total-tokens", "384",
                    "--max-input-tokens", "256", "--host-kv-cache-bytes", str(8 * BF16_BLOCK_BYTES), *flags)
    solo, together = _solo_then_together(server)
    assert together == solo, _first_difference(solo, together)
    assert _metric(server, "loom_preemptions_total") > 0


def test_16_greedy_requests_agree_with_16_token_prefill_chunks(start_launcher: StartLauncher) -> None:
    server = start_launcher("--max-batch-prefill-tokens", "16")
    solo, together = _solo_then_together(server)
    assert together == solo, _first_difference(solo, together)


@pytest.mark.parametrize("flags", [("--overlap-steps",), ("--overlap-steps", "--launch-ahead")],
                         ids=["planned-ahead", "launched-ahead"])
def test_16_greedy_requests_agree_with_steps_planned_ahead(start_launcher: StartLauncher,
                                                           flags: tuple[str, ...]) -> None:
    """--overlap-steps (the default on GPUs) on this CPU: each step planned while the one before
    runs, new prompts' first tokens decoded in steps planned ahead; with --launch-ahead (also the
    GPUs' default) the shard launches such a step before the one before it finished, its decodes
    reading that step's tokens as the device holds them; the same tokens as alone."""
    server = start_launcher(*flags)
    solo, together = _solo_then_together(server)
    assert together == solo, _first_difference(solo, together)
    assert _metric(server, "loom_steps_planned_ahead_total") > 0


def _complete(server: Launcher, prompt_ids: list[int], **extra: object) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 1, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _answer(body: dict, choice: int = 0) -> tuple[list[str], list[float]]:
    picked = next(c for c in body["choices"] if c["index"] == choice)
    return picked["logprobs"]["tokens"], picked["logprobs"]["token_logprobs"]


def _post(server: Launcher, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=600)


def test_cold_cached_restored_and_forked_prompts_agree(start_launcher: StartLauncher, e2e_dir: Path) -> None:
    folder = e2e_dir / "determinism-snapshots"
    first = start_launcher("--snapshot-dir", str(folder))
    prefix_ids = [t["id"] for t in _post(first, "/tokenize", {"inputs": PREFIX}).json()]
    prompt_ids = prefix_ids + [t["id"] for t in _post(first, "/tokenize", {"inputs": QUESTION}).json()]
    cold = _complete(first, prompt_ids)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = _complete(first, prompt_ids)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    forked = _complete(first, prompt_ids, n=4, seed=3, choice_params=[
        {"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.3}])
    saved = _post(first, "/snapshots/museum?action=save", {"token_ids": prefix_ids})
    assert saved.status_code == 200, saved.text
    first.stop()

    fresh = start_launcher("--snapshot-dir", str(folder))
    restored = _post(fresh, "/snapshots/museum?action=restore")
    assert restored.status_code == 200, restored.text
    from_snapshot = _complete(fresh, prompt_ids)
    assert from_snapshot["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    reference = _answer(cold)
    assert _answer(cached) == reference, "prefix-cached answer differs from the cold one"
    assert _answer(forked, 0) == reference, "choice 0 of n=4 differs from the cold answer"
    assert _answer(from_snapshot) == reference, "snapshot-restored answer differs from the cold one"
