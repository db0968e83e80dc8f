"""--speculate through the real launcher with the embedded model (default CPU path): greedy and
seeded-sampled answers, with logprobs, are those of a server without speculation, on prompts that
quote themselves so that drafts are really accepted."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import Launcher, StartLauncher

pytestmark = pytest.mark.slow

ARTICLE = ("The harbour council met on Monday. The harbour council agreed to repair the old pier before "
           "winter, to open the fish market on Saturdays, and to paint the lighthouse white and red. ")
PROMPTS = [
    f"Article: {ARTICLE}\nRepeat the article word for word.\nArticle: The harbour council",
    f"Text: {ARTICLE * 2}\nSummary, quoting the text: The harbour council agreed to",
    "List: apples, pears, plums, apples, pears, plums, apples, pears,",
]


async def _answers(server: Launcher) -> list[dict]:
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0, "logprobs": 2} for p in PROMPTS]
    bodies += [{"prompt": p, "max_tokens": 40, "temperature": 0.8, "seed": 7 + i, "logprobs": 1}
               for i, p in enumerate(PROMPTS)]
    bodies.append({"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stop": ["before winter"]})
    async with httpx.AsyncClient(base_url=server.base_url, timeout=900) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    for response in responses:
        assert response.status_code == 200, response.text
    return [response.json()["choices"][0] | {"usage": response.json()["usage"]} for response in responses]


def _metric(server: Launcher, name: str) -> float:
    lines = httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return values[0]


def test_speculation_gives_the_same_answers(start_launcher: StartLauncher) -> None:
    plain_server = start_launcher()
    plain = asyncio.run(_answers(plain_server))
    plain_server.stop()
    server = start_launcher("--speculate", "4")
    speculative = asyncio.run(_answers(server))
    for i, (got, want) in enumerate(zip(speculative, plain)):
        assert got["text"] == want["text"], f"answer {i} differs"
        assert got["finish_reason"] == want["finish_reason"]
        # cached_tokens may differ: which of the concurrent same-prompt requests hits the prefix cache
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        if want.get("logprobs"):
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
            assert got["logprobs"]["top_logprobs"] == want["logprobs"]["top_logprobs"]
    assert speculative[-1]["finish_reason"] == "stop"
    accepted = _metric(server, "loom_spec_accepted_tokens_total")
    drafted = _metric(server, "loom_spec_draft_tokens_total")
    assert 0 < accepted <= drafted
    print(f"accepted {accepted:g} of {drafted:g} drafted tokens")
