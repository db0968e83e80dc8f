"""Multi-LoRA served by the real launcher: a tiny Llama folder with random PEFT adapters (two from
--lora-adapter, one loaded while serving), float32 greedy tokens through OpenAI's `model` and TGI's
`adapter_id` equal transformers + peft with each adapter merged, for a batch mixing three adapters
and the base model; on one rank, on two tensor-parallel ranks, with n-gram speculation, and with
overlapped steps. Bad adapters get 400 and change nothing; unknown names 404; unloading takes the
name away."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import Launcher, serving
from test_families_e2e import NUM_NEW, VOCAB, save_family, text_of

from tests.unit.shard.lora_adapters import ATTENTION, MLP, greedy, merged_model, write_adapter

pytestmark = pytest.mark.slow
PROMPTS = {None: [5, 9, 13, 17, 21, 2, 3], "a1": [7, 8, 9, 10], "a2": [30, 31, 32, 33, 34, 35, 36, 37, 38],
           "a3": [11, 60, 12, 61, 13]}
SNAPSHOT_PROMPT = [40, 44, 41, 45, 42, 46, 43, 47, 48, 52, 49, 53, 50]  # three full blocks of 4 and one token


@pytest.fixture(scope="module")
def lora_folder(e2e_dir: Path) -> tuple[Path, dict[str | None, list[int]], dict[str, Path]]:
    """The base folder, each adapter's folder, and each prompt's reference answer."""
    base = e2e_dir / "lora-base"
    hf = save_family("llama", base)
    adapters = {"a1": write_adapter(hf, e2e_dir / "lora-a1", seed=1, rank=4),
                "a2": write_adapter(hf, e2e_dir / "lora-a2", seed=2, rank=8, targets=ATTENTION),
                "a3": write_adapter(hf, e2e_dir / "lora-a3", seed=3, rank=2, targets=MLP)}
    expected = {name: greedy(hf if name is None else merged_model(hf, adapters[name]), prompt, NUM_NEW)
                for name, prompt in PROMPTS.items()}
    expected["a1 snapshot"] = greedy(merged_model(hf, adapters["a1"]), SNAPSHOT_PROMPT, NUM_NEW)
    return base, expected, adapters


@pytest.fixture(scope="module", params=[("--num-shard", "1"), ("--num-shard", "2"), ("--speculate", "3"),
                                        ("--overlap-steps",)],
                ids=["one-rank", "two-ranks", "speculation", "overlap"])
def served(request: pytest.FixtureRequest, e2e_dir: Path, lora_folder) -> Iterator[Launcher]:
    base, _, adapters = lora_folder
    with serving(e2e_dir, "--model-id", str(base), "--dtype", "float32", "--block-size", "4",
                 "--max-total-tokens", "128", "--max-batch-total-tokens", "1024", *request.param,
                 "--snapshot-dir", tempfile.mkdtemp(dir=e2e_dir),
                 "--max-loras-per-batch", "3",
                 "--lora-adapter", f"a1={adapters['a1']}", "--lora-adapter", f"a2={adapters['a2']}") as launcher:
        yield launcher


def complete(launcher: Launcher, model: str | None, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{launcher.base_url}/v1/completions", timeout=120, json=body)


def tokens_of(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [VOCAB.index(t.strip()) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def generate_tgi(launcher: Launcher, adapter: str, prompt: list[int]) -> list[int]:
    response = httpx.post(f"{launcher.base_url}/generate", timeout=120, json={
        "inputs": text_of(prompt), "parameters": {"max_new_tokens": NUM_NEW, "details": True, "adapter_id": adapter}})
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def load(launcher: Launcher, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{launcher.base_url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(path)})


def model_ids(launcher: Launcher) -> dict[str, str | None]:
    data = httpx.get(f"{launcher.base_url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["parent"] for m in data}


def test_mixed_adapters_answer_like_merged_peft(served: Launcher, lora_folder) -> None:
    base, expected, adapters = lora_folder
    assert load(served, "a3", adapters["a3"]).status_code == 200
    ids = model_ids(served)
    (base_name,) = [name for name, parent in ids.items() if parent is None]  # the served model
    assert ids == {base_name: None, "a1": base_name, "a2": base_name, "a3": base_name}
    with ThreadPoolExecutor(8) as pool:  # three adapters and the base model in the same steps, twice
        jobs = [pool.submit(complete, served, name, prompt) for name, prompt in [*PROMPTS.items()] * 2]
        answers = [tokens_of(job.result()) for job in jobs]
    assert answers == [expected[name] for name in [*PROMPTS] * 2]
    assert generate_tgi(served, "a2", PROMPTS["a2"]) == expected["a2"]
    assert len({tuple(expected[name]) for name in PROMPTS}) == 4  # the adapters change the answers
    metrics = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    assert 'loom_lora_requests_total{adapter="a2"} 3.0' in metrics
    if "--speculate" in served.process.args:  # adapter tokens were verified in drafts, not only decoded
        drafted = re.search(r"^loom_spec_draft_tokens_total (\S+)$", metrics, re.MULTILINE)
        assert drafted is not None and float(drafted.group(1)) > 0


def test_bad_and_unknown_adapters(served: Launcher, lora_folder, tmp_path: Path) -> None:
    _, expected, adapters = lora_folder
    before = model_ids(served)
    (tmp_path / "adapter_config.json").write_text((adapters["a1"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused = load(served, "broken", tmp_path)
    assert refused.status_code == 400 and "cannot be read" in refused.text
    assert load(served, "a1", adapters["a2"]).status_code == 400  # the name is taken
    (base_name,) = [name for name, parent in before.items() if parent is None]
    assert load(served, base_name, adapters["a2"]).status_code == 400  # the served model's name
    assert model_ids(served) == before
    missing = complete(served, "nope", PROMPTS["a1"])
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["param"] == "model"
    assert tokens_of(complete(served, "a1", PROMPTS["a1"])) == expected["a1"]  # still served
    unloaded = httpx.post(f"{served.base_url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert complete(served, "a3", PROMPTS["a3"]).status_code == 404
    assert "a3" not in model_ids(served)


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def snapshot(launcher: Launcher, name: str, action: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{launcher.base_url}/snapshots/{name}?action={action}", json=body, timeout=60)


def reload(launcher: Launcher, name: str, path: Path) -> None:
    unloaded = httpx.post(f"{launcher.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert load(launcher, name, path).status_code == 200


def test_snapshots_record_the_adapter(served: Launcher, lora_folder) -> None:
    """A snapshot saved for an adapter holds that adapter's KV and says so; restored, it serves
    requests naming the same adapter (same files), never the base model or another adapter."""
    _, expected, adapters = lora_folder
    saved = snapshot(served, "a1-prompt", "save", {"token_ids": SNAPSHOT_PROMPT, "model": "a1"})
    assert saved.status_code == 200, saved.text
    assert snapshot(served, "x", "save", {"token_ids": SNAPSHOT_PROMPT, "model": "nope"}).status_code == 404
    listed = {s["name"]: s for s in httpx.get(f"{served.base_url}/snapshots", timeout=10).json()["snapshots"]}
    assert listed["a1-prompt"]["adapter"] == "a1" and listed["a1-prompt"]["fits"]
    # Loaded again (a new number: the cache entries of the old one can never be hit) from the same
    # files, the adapter still fits the snapshot; restoring it gives its requests the prefix.
    reload(served, "a1", adapters["a1"])
    assert snapshot(served, "a1-prompt", "restore").status_code == 200
    hit = complete(served, "a1", SNAPSHOT_PROMPT)
    assert cached_tokens(hit) == 12 and tokens_of(hit) == expected["a1 snapshot"]
    assert cached_tokens(complete(served, None, SNAPSHOT_PROMPT)) == 0  # the base model's KV differs
    # Another adapter's files under the same name: the snapshot does not fit it.
    reload(served, "a1", adapters["a2"])
    listed = {s["name"]: s for s in httpx.get(f"{served.base_url}/snapshots", timeout=10).json()["snapshots"]}
    assert not listed["a1-prompt"]["fits"] and "LoRA adapter 'a1'" in listed["a1-prompt"]["reason"]
    refused = snapshot(served, "a1-prompt", "restore")
    assert refused.status_code == 409, refused.text
    reload(served, "a1", adapters["a1"])
    deleted = httpx.delete(f"{served.base_url}/snapshots/a1-prompt", timeout=60)
    assert deleted.status_code == 200 and deleted.json()["cached_blocks_dropped"] == 0  # not restored for this load
