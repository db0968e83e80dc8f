"""Fixtures shared by the contract tests: the embedded model's tokenizer (loaded once) and a
fake shard behind the ShardClient interface (tests/contract/api_fakes.py)."""

from __future__ import annotations

import pytest
from api_fakes import WORDS, FakeShardClient

from loom_router.tokenizer import Tokenizer, load_tokenizer
from tests.otlp_collector import collector  # noqa: F401 (a fixture: the stand-in OTLP collector)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("")


@pytest.fixture
def backend(tokenizer: Tokenizer) -> FakeShardClient:
    return FakeShardClient(tokenizer.encode(WORDS), tokenizer.vocab_size, eos_id=tokenizer.eos_token_ids[0])
