"""The serving path end to end: the real launcher, the embedded model, the official TGI client.

float32 so that greedy outputs do not depend on what else shares the batch.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import Launcher
from text_generation import AsyncClient, Client

pytestmark = pytest.mark.slow

PROMPTS = [f"Question {i}: what is {i} plus {i * 3}? Answer briefly." for i in range(16)]


def scrape(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_client_generate_and_generate_stream_agree(server: Launcher) -> None:
    client = Client(server.base_url, timeout=120)
    response = client.generate("The capital of France is", max_new_tokens=20)
    ids = [token.id for token in response.details.tokens]
    streamed = list(client.generate_stream("The capital of France is", max_new_tokens=20))
    assert [event.token.id for event in streamed] == ids
    assert streamed[-1].generated_text == response.generated_text
    assert "".join(event.token.text for event in streamed if not event.token.special) == response.generated_text
    assert len(ids) == 20 or response.details.finish_reason.value == "eos_token"


def test_16_concurrent_streams_equal_their_solo_outputs(server: Launcher) -> None:
    client = Client(server.base_url, timeout=120)
    solo = [[t.id for t in client.generate(p, max_new_tokens=12).details.tokens] for p in PROMPTS]

    async def stream(aclient: AsyncClient, prompt: str) -> list[int]:
        return [event.token.id async for event in aclient.generate_stream(prompt, max_new_tokens=12)]

    async def all_at_once() -> list[list[int]]:
        aclient = AsyncClient(server.base_url, timeout=300)
        return await asyncio.gather(*(stream(aclient, p) for p in PROMPTS))

    assert asyncio.run(all_at_once()) == solo


def test_stop_sequence_stops_and_ends_the_text_as_in_tgi(server: Launcher) -> None:
    client = Client(server.base_url, timeout=120)
    full = client.generate("Once upon a time, in a small village by the sea,", max_new_tokens=32).generated_text
    words = [w for w in full.split() if len(w) >= 3]
    assert len(words) >= 3, full
    stop = " " + words[2]
    response = client.generate("Once upon a time, in a small village by the sea,", max_new_tokens=32, stop_sequences=[stop])
    assert response.details.finish_reason.value == "stop_sequence"
    assert response.generated_text == full[:full.index(stop) + len(stop)]  # TGI keeps the stop sequence


def test_unset_max_new_tokens_runs_to_the_end_of_the_context(server: Launcher) -> None:
    """TGI's and chat's unset limit is the rest of the context; legacy completions' is OpenAI's 16."""
    info = httpx.get(f"{server.base_url}/info", timeout=10).json()
    max_total = info["max_total_tokens"]
    prompt = "Count slowly from one to one thousand: one, two, three,"
    num_input = len(httpx.post(f"{server.base_url}/tokenize", json={"inputs": prompt}, timeout=10).json())
    body = {"model": "loom", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "ignore_eos": True}
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300).json()
    assert chat["usage"]["total_tokens"] == max_total and chat["choices"][0]["finish_reason"] == "length"
    body = {"model": "loom", "prompt": prompt, "temperature": 0, "ignore_eos": True}
    choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300).json()
    assert choice["usage"]["completion_tokens"] == 16 and choice["choices"][0]["finish_reason"] == "length"
    # TGI's client always sends max_new_tokens, so call the route directly.
    tgi = httpx.post(f"{server.base_url}/generate", json={"inputs": prompt, "parameters": {"details": True}},
                     timeout=300).json()["details"]
    assert tgi["generated_tokens"] == max_total - num_input or tgi["finish_reason"] == "eos_token"


def test_disconnect_mid_stream_frees_its_blocks(server: Launcher) -> None:
    url = server.base_url
    # ignore_eos: the request must still be running when the client leaves.
    body = {"model": "loom", "prompt": "Tell me a long story about dragons.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept open: closing the iterator closes the connection
        events = 0
        while events < 3:
            events += next(lines).startswith("data:")
        assert scrape(url, "loom_kv_blocks_used") > 0 and scrape(url, "loom_running_requests") == 1
    deadline = time.monotonic() + 10
    while scrape(url, "loom_kv_blocks_used") > 0 or scrape(url, "loom_running_requests") > 0:
        assert time.monotonic() < deadline, "blocks still used 10 s after the client left"
        time.sleep(0.1)


@pytest.mark.parametrize("body", [
    b"{not json",
    b'{"inputs": 42}',
    b'{"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}',
    b'{"inputs": "hi", "parameters": {"temperature": -1}}',
    b'{"inputs": "hi", "parameters": {"top_p": 1.5}}',
    b'{"inputs": "hi", "parameters": {"top_k": 0}}',
    b'{"inputs": "hi", "parameters": {"max_new_tokens": 100000}}',
    b'{"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e", "f"]}}',
    b'{"inputs": ""}',
    b'{"parameters": {}}',
])
def test_bad_input_gets_422_and_the_server_stays_healthy(server: Launcher, body: bytes) -> None:
    response = httpx.post(f"{server.base_url}/generate", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 422, response.text
    assert response.json()["error"] and response.json()["error_type"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_over_long_input_is_a_422_naming_the_numbers(server: Launcher) -> None:
    response = httpx.post(f"{server.base_url}/generate", json={"inputs": "word " * 2000}, timeout=30)
    assert response.status_code == 422
    assert "385" in response.json()["error"] and "2001" in response.json()["error"]
    ok = httpx.post(f"{server.base_url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["generated_text"]
