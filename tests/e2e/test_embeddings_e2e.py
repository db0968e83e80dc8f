"""/v1/embeddings served by the real launcher from tiny Llama folders: a sentence-transformers folder
(mean pooling, normalized) gives sentence-transformers' vectors through the official openai client
(base64, its default) and as floats, for texts and token ids, prefilled in chunks and batched with
generation; `--task embed` on a plain folder gives transformers' last hidden state, normalized."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from conftest import Launcher, serving
from test_families_e2e import EOS_ID, VOCAB, text_of
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.unit.shard import families

pytestmark = pytest.mark.slow
TEXTS = [text_of([5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81]), "w3 w4",
         text_of([100, 7, 7, 7, 3])]
ARGS = ("--dtype", "float32", "--block-size", "4", "--max-total-tokens", "128", "--max-batch-total-tokens", "1024",
        "--max-batch-prefill-tokens", "8")  # 8: the 20-token text is pooled over three chunks


def save_plain(folder: Path) -> transformers.PreTrainedModel:
    """A tiny random Llama and a word-level tokenizer (no chat template: sentence-transformers would
    apply it; a pad token: it pads batches), as a Hugging Face folder."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<unk>"}')
    model = families.hf_model("llama", eos_token_id=EOS_ID)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def sentence_model(e2e_dir: Path):
    # Not in the test extras: the only local release (6.0.1) declares transformers >= 5, which the
    # extras keep below 5; `make setup` installs it beside them without its requirements.
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from sentence_transformers import SentenceTransformer, models

    folder = e2e_dir / "embed-st"
    save_plain(folder)
    modules = [models.Transformer(str(folder)), models.Pooling(64, pooling_mode="mean"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder, SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def st_served(e2e_dir: Path, sentence_model) -> Iterator[Launcher]:
    with serving(e2e_dir, "--model-id", str(sentence_model[0]), *ARGS, "--max-concurrent-requests", "16") as launcher:
        yield launcher


def test_openai_client_gets_sentence_transformers_vectors(st_served: Launcher, sentence_model) -> None:
    reference = sentence_model[1].encode(TEXTS, convert_to_tensor=True).float()
    client = openai.OpenAI(base_url=f"{st_served.base_url}/v1", api_key="-")
    answer = client.embeddings.create(model="embed-st", input=TEXTS)  # base64 on the wire
    got = torch.tensor([item.embedding for item in answer.data])
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    assert answer.usage.prompt_tokens == 20 + 2 + 5
    one = client.embeddings.create(model="embed-st", input=TEXTS[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), reference[1], atol=1e-4, rtol=1e-4)


def test_token_ids_dimensions_and_base64(st_served: Launcher, sentence_model) -> None:
    ids = [VOCAB.index(w) for w in TEXTS[2].split()]
    reference = sentence_model[1].encode([TEXTS[2]], convert_to_tensor=True).float()[0]
    response = httpx.post(f"{st_served.base_url}/v1/embeddings", timeout=60, json={
        "input": [ids, ids[:2]], "dimensions": 16, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    cut = reference[:16] / reference[:16].norm()  # truncated, then normalized again
    torch.testing.assert_close(got, cut, atol=1e-4, rtol=1e-4)
    many = httpx.post(f"{st_served.base_url}/v1/embeddings", timeout=120, json={"input": [ids] * 40})
    assert many.status_code == 200, many.text  # more inputs than --max-concurrent-requests: they take turns
    assert len(many.json()["data"]) == 40
    too_wide = httpx.post(f"{st_served.base_url}/v1/embeddings", json={"input": "w3", "dimensions": 65}, timeout=60)
    assert too_wide.status_code == 400


def test_embeddings_batch_with_generation(st_served: Launcher, sentence_model) -> None:
    reference = sentence_model[1].encode(TEXTS, convert_to_tensor=True).float()

    def embed(text: str) -> list[float]:
        response = httpx.post(f"{st_served.base_url}/v1/embeddings", json={"input": text}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    def generate(text: str) -> int:
        return httpx.post(f"{st_served.base_url}/generate", timeout=60, json={
            "inputs": text, "parameters": {"max_new_tokens": 8}}).status_code

    with ThreadPoolExecutor(8) as pool:
        generations = [pool.submit(generate, text) for text in TEXTS * 2]
        vectors = [pool.submit(embed, text) for text in TEXTS * 2]
        assert all(job.result() == 200 for job in generations)
        got = torch.tensor([job.result() for job in vectors])
    torch.testing.assert_close(got, torch.cat([reference, reference]), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def plain_folder(e2e_dir: Path) -> tuple[Path, transformers.PreTrainedModel]:
    folder = e2e_dir / "embed-plain"
    hf = save_plain(folder)
    return folder, hf


def test_task_embed_pools_the_last_token(e2e_dir: Path, plain_folder) -> None:
    folder, hf = plain_folder
    with serving(e2e_dir, "--model-id", str(folder), *ARGS, "--task", "embed") as launcher:
        ids = [VOCAB.index(w) for w in TEXTS[0].split()]
        with torch.no_grad():
            last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        response = httpx.post(f"{launcher.base_url}/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
        assert response.status_code == 200, response.text
        got = torch.tensor(response.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, last / last.norm(), atol=1e-4, rtol=1e-4)
