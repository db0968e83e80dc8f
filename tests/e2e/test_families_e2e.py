"""Families beyond Llama served by the real launcher from Hugging Face folders (safetensors): a
Gemma-3-shaped model (five sliding-window layers, window 8, then a global one; 4-token blocks, so
its sliding groups' blocks leave the window and return to the pool) and a Qwen3-MoE. Through TGI's
and OpenAI's APIs, alone and concurrently, they answer with transformers' greedy tokens on the
same weights; a thinking template's output comes back as `reasoning_content`, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import Launcher, serving
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from loom_router.frontend import reasoning
from tests.unit.shard import families
from tests.unit.shard.test_families import greedy_reference

pytestmark = pytest.mark.slow
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
VOCAB = ["<unk>", "</s>", *[f"w{i}" for i in range(families.BASE["vocab_size"] - 4)], THINK_OPEN, THINK_CLOSE]
EOS_ID = 1
# Qwen3's shape: earlier turns' reasoning written back between thinking tags; the answer opens one.
THINKING_TEMPLATE = (
    "{% for m in messages %}w1 {{ m.content }}"
    "{% if m.reasoning_content %} <think> {{ m.reasoning_content }} </think>{% endif %} w2 {% endfor %}"
    "{% if add_generation_prompt %}w3 <think>{% endif %}"
)
NUM_NEW = 16


def save_family(kind: str, folder: Path) -> torch.nn.Module:
    """The family's tiny random model (families.hf_model) and a word-level tokenizer whose words
    are its token ids, with a thinking chat template, as a Hugging Face folder."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_tokens([AddedToken(THINK_OPEN), AddedToken(THINK_CLOSE)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": THINKING_TEMPLATE}))
    model = families.hf_model(kind, eos_token_id=EOS_ID)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def prompts_without_eos(model: torch.nn.Module, count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy tokens) pairs, 41-token prompts (longer than every window)
    whose answers do not stop early."""
    found = []
    for seed in range(100):
        prompt = torch.randint(2, len(VOCAB) - 2, (41,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = greedy_reference(model, prompt, NUM_NEW)
        if EOS_ID not in expected:
            found.append((prompt, expected))
        if len(found) == count:
            return found
    raise AssertionError("the random model stops too early on every prompt")


def text_of(ids: list[int]) -> str:
    return " ".join(VOCAB[i] for i in ids)


def generate(launcher: Launcher, prompt: list[int]) -> list[int]:
    response = httpx.post(f"{launcher.base_url}/generate", timeout=120, json={
        "inputs": text_of(prompt), "parameters": {"max_new_tokens": NUM_NEW, "details": True}})
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def complete(launcher: Launcher, prompt: list[int]) -> list[int]:
    response = httpx.post(f"{launcher.base_url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "logprobs": 1})
    assert response.status_code == 200, response.text
    return [VOCAB.index(t.strip()) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def stream_generate(launcher: Launcher, prompt: list[int]) -> list[int]:
    ids = []
    with httpx.stream("POST", f"{launcher.base_url}/generate_stream", timeout=120, json={
            "inputs": text_of(prompt), "parameters": {"max_new_tokens": NUM_NEW}}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe"])
def served(request: pytest.FixtureRequest, e2e_dir: Path) -> Iterator[tuple[Launcher, list]]:
    """The family's launcher, float32, and its prompts with transformers' answers."""
    folder = e2e_dir / request.param
    cases = prompts_without_eos(save_family(request.param, folder), 4)
    with serving(e2e_dir, "--model-id", str(folder), "--dtype", "float32", "--block-size", "4",
                 "--max-total-tokens", "128", "--max-batch-total-tokens", "1024",
                 "--max-batch-prefill-tokens", "64") as launcher:
        yield launcher, cases


def test_family_answers_with_transformers_tokens_through_every_api(served: tuple[Launcher, list]) -> None:
    launcher, cases = served
    prompt, expected = cases[0]
    assert generate(launcher, prompt) == expected
    assert stream_generate(launcher, prompt) == expected
    assert complete(launcher, prompt) == expected
    with ThreadPoolExecutor(len(cases)) as pool:  # batched together, each prefilled in chunks
        answers = list(pool.map(lambda case: generate(launcher, case[0]), cases))
    assert answers == [expected for _, expected in cases]


def test_thinking_output_is_reasoning_content(served: tuple[Launcher, list]) -> None:
    launcher, _ = served
    body = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": NUM_NEW, "temperature": 0}
    whole = httpx.post(f"{launcher.base_url}/v1/chat/completions", timeout=120, json=body)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"]  # the template opened <think>: the answer starts in reasoning
    thinking, content = [], []
    with httpx.stream("POST", f"{launcher.base_url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[5:])["choices"]:
                    thinking.append(choice["delta"].get("reasoning_content") or "")
                    content.append(choice["delta"].get("content") or "")
    assert "".join(thinking) == message["reasoning_content"]
    assert "".join(content) == (message["content"] or "")
    # The same tokens as a plain completion of the rendered prompt, split at the thinking tags.
    raw = httpx.post(f"{launcher.base_url}/v1/completions", timeout=120, json={
        "prompt": "w1 w5 w6 w7 w2 w3 <think>", "max_tokens": NUM_NEW, "temperature": 0})
    assert raw.status_code == 200, raw.text
    expected = reasoning.split(raw.json()["choices"][0]["text"], in_reasoning=True)
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
