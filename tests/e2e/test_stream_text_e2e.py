"""The official `text_generation` client against the real launcher and the embedded model:
streamed token texts of answers with CJK, accents and emoji join to exactly `generated_text`."""

from __future__ import annotations

import pytest
from conftest import Launcher
from text_generation import Client

pytestmark = pytest.mark.slow

# Prompts whose greedy continuations repeat non-ASCII text (a small model continues a pattern).
PROMPTS = [
    "日本語 日本語 日本語 日本語 日本語",
    "café crème, café crème, café crème, café crème,",
    "😀 😀 😀 😀 😀 😀 😀 😀",
    "Ελληνικά Ελληνικά Ελληνικά Ελληνικά",
]


def test_stream_joins_to_generated_text_with_non_ascii(launcher: Launcher) -> None:
    client = Client(launcher.base_url, timeout=300)
    answers, num_partial_tokens = [], 0
    for prompt in PROMPTS:
        full = client.generate(prompt, max_new_tokens=24)
        responses = list(client.generate_stream(prompt, max_new_tokens=24))
        streamed = "".join(r.token.text for r in responses)
        assert streamed == full.generated_text == responses[-1].generated_text, prompt
        assert "\ufffd" not in streamed
        assert [r.token.id for r in responses] == [t.id for t in full.details.tokens]
        assert "".join(t.text for t in full.details.tokens) == full.generated_text
        answers.append(full.generated_text)
        # A token that is only part of a character streams as "" (the next one completes it).
        num_partial_tokens += sum(1 for r in responses if r.token.text == "" and not r.token.special)
    non_ascii = [a for a in answers if any(ord(ch) > 127 for ch in a)]
    assert len(non_ascii) >= 2 and num_partial_tokens > 0, f"too little non-ASCII to test: {answers}"
