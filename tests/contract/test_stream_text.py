"""Streamed text in every API is the text each token adds: UTF-8 safe, leading spaces kept,
joining to the whole text (byte-level BPE and SentencePiece); and the character cap on inputs."""

from __future__ import annotations

import codecs
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from api_fakes import FakeShardClient
from router_harness import start_router
from test_api import Harness, invalid_status, router_config, sse_payloads

from loom_router.tokenizer import Tokenizer, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "router"))
from sentencepiece_tokenizer import write_sentencepiece_tokenizer  # noqa: E402

ANSWER = " 日本語のテキスト café naïve 😀👍🏽 ok"
SP_ANSWER = " the lazy dog 日本 jumps over"


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "byte-level":
        return load_tokenizer("")
    return load_tokenizer(str(write_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))))


async def _harness(tokenizer: Tokenizer, **config: object) -> AsyncIterator[Harness]:
    backend = FakeShardClient(tokenizer.encode("the"), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
    answer = SP_ANSWER if _is_sentencepiece(tokenizer) else ANSWER
    backend.script = tokenizer.encode(answer, add_special_tokens=False)
    router = await start_router(router_config(**config), backend, tokenizer)
    try:
        yield Harness(router.http, router.engine, backend, tokenizer, router)
    finally:
        await router.stop()


@pytest.fixture
async def harness(tokenizer: Tokenizer) -> AsyncIterator[Harness]:
    async for h in _harness(tokenizer):
        yield h


def _script_text(h: Harness) -> str:
    assert h.backend.script is not None
    return h.tokenizer.decode(h.backend.script, skip_special_tokens=True)


async def test_tgi_stream_token_texts_join_to_generated_text(harness: Harness) -> None:
    script = harness.backend.script
    assert script and any("\ufffd" in harness.tokenizer.decode([i]) for i in script)  # split characters
    body = {"inputs": "the", "parameters": {"max_new_tokens": len(script), "details": True}}
    events = sse_payloads((await harness.client.post("/generate_stream", json=body)).text)
    texts = [e["token"]["text"] for e in events]
    assert "".join(texts) == events[-1]["generated_text"]
    assert not any("\ufffd" in t for t in texts) and "" in texts  # held bytes come with the next token
    if not _is_sentencepiece(harness.tokenizer):
        assert events[-1]["generated_text"] == ANSWER
    else:  # SentencePiece: the first word's leading space is kept, as every later one
        assert events[-1]["generated_text"].startswith("  the lazy dog") and " jumps" in texts


async def test_tgi_details_and_prefill_follow_the_same_rule(harness: Harness) -> None:
    script = harness.backend.script
    assert script is not None
    body = {"inputs": "the quick 日本", "parameters": {"max_new_tokens": len(script), "details": True,
                                                     "decoder_input_details": True}}
    out = (await harness.client.post("/generate", json=body)).json()
    assert "".join(t["text"] for t in out["details"]["tokens"]) == out["generated_text"]
    prompt_ids = harness.tokenizer.encode("the quick 日本")
    prefill = out["details"]["prefill"]
    assert [t["id"] for t in prefill] == prompt_ids
    assert "".join(t["text"] for t in prefill) == harness.tokenizer.decode(prompt_ids)
    assert not any("\ufffd" in t["text"] for t in prefill)


def _named_bytes(name: str) -> bytes:
    """The bytes a completions logprobs token names: its text, or OpenAI's `bytes:\\xe2\\x80`."""
    if name.startswith("bytes:"):
        return codecs.escape_decode(name.removeprefix("bytes:"))[0]
    return name.encode()


def _check_named_tokens(logprobs: dict, text: str) -> None:
    """Each token named as its top_logprobs entry names it (the fake shard's alternatives may list
    the sampled token with another logprob: a real one's cannot); a token
    of whole characters stands at its offset (its leading space aside: SentencePiece drops the
    text's first)."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    for name, top in zip(tokens, logprobs["top_logprobs"]):
        assert top is None or name in top, (name, top)
    assert offsets == sorted(offsets) and offsets[0] == 0
    whole = [(name, o) for name, o in zip(tokens, offsets) if not name.startswith("bytes:")]
    assert all(text[o:].lstrip().startswith(name.lstrip()) for name, o in whole), (tokens, offsets, text)


async def test_openai_logprobs_name_tokens_as_their_alternatives_and_their_bytes_join_to_the_text(
        harness: Harness) -> None:
    script = harness.backend.script
    assert script is not None
    body = {"prompt": "the", "max_tokens": len(script), "logprobs": 1}
    choice = (await harness.client.post("/v1/completions", json=body)).json()["choices"][0]
    _check_named_tokens(choice["logprobs"], choice["text"])
    if not _is_sentencepiece(harness.tokenizer):  # its script is whole characters, one token each
        assert any(name.startswith("bytes:") for name in choice["logprobs"]["tokens"])
    assert b"".join(_named_bytes(name) for name in choice["logprobs"]["tokens"]).decode() == choice["text"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(script), "logprobs": True,
            "top_logprobs": 2}
    response = await harness.client.post("/v1/chat/completions", json=body)
    if response.status_code == 400:  # the SentencePiece fixture has no chat template
        return
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    for entry in [c for c in content] + [alt for c in content for alt in c["top_logprobs"]]:
        raw = bytes(entry["bytes"])  # the token's own bytes, named by its text or escaped
        try:
            assert entry["token"] == raw.decode()
        except UnicodeDecodeError:
            assert entry["token"] == "".join(f"\\x{b:02x}" if b >= 0x80 else chr(b) for b in raw)
    raw = b"".join(bytes(c["bytes"]) for c in content)
    assert raw.decode() == choice["message"]["content"]  # the pieces of split characters, whole again


async def test_openai_stream_echo_offsets(harness: Harness) -> None:
    script = harness.backend.script
    assert script is not None
    body = {"prompt": "the 日本", "max_tokens": len(script), "logprobs": 0, "echo": True}
    choice = (await harness.client.post("/v1/completions", json=body)).json()["choices"][0]
    _check_named_tokens(choice["logprobs"], choice["text"])


async def test_inputs_over_the_character_cap_are_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    async for h in _harness(tokenizer, max_input_chars=100):
        calls: list[str] = []
        original = h.tokenizer.encode
        h.tokenizer.encode = lambda text, *a, **k: calls.append(text) or original(text, *a, **k)  # type: ignore
        try:
            for path, body in [("/generate", {"inputs": "x" * 101}), ("/tokenize", {"inputs": "x" * 101}),
                               ("/v1/completions", {"prompt": "x" * 101}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 101}]}),
                               ("/v1/responses", {"input": "x" * 101})]:
                response = await h.client.post(path, json=body)
                assert response.status_code == invalid_status(path), (path, response.text)
                assert "100 characters" in response.text and f"`{next(iter(body))}`" in response.text
            assert calls == []
            assert (await h.client.post("/tokenize", json={"inputs": "x" * 100})).status_code == 200
        finally:
            del h.tokenizer.encode


def _is_sentencepiece(tokenizer: Tokenizer) -> bool:
    return tokenizer.chat_template is None  # the embedded (byte-level) model has a template


async def test_truncate_keeps_the_models_bos(harness: Harness) -> None:
    tok = harness.tokenizer
    full = tok.encode("the quick brown fox jumps")
    body = {"inputs": "the quick brown fox jumps",
            "parameters": {"truncate": 3, "max_new_tokens": 1, "details": True, "decoder_input_details": True}}
    prefill = (await harness.client.post("/generate", json=body)).json()["details"]["prefill"]
    spans = (await harness.client.post("/tokenize", json={"inputs": "the quick brown fox jumps",
                                                           "parameters": {"truncate": 3}})).json()
    if _is_sentencepiece(tok):  # adds BOS: it stays first, then the last 2 text tokens
        assert full[0] == tok.bos_token_id
        expected = [tok.bos_token_id, *full[-2:]]
    else:  # no BOS added: just the last 3 tokens
        expected = full[-3:]
    assert [t["id"] for t in prefill] == expected
    assert [s["id"] for s in spans] == expected
