"""Request bodies are read as Unicode text: a lone surrogate anywhere is malformed JSON."""

from __future__ import annotations

import json

import pytest

from loom_router.frontend.json_body import loads


@pytest.mark.parametrize("body", [rb'{"a": "x\ud800"}', rb'{"\udc00": 1}', rb'[[{"b": ["\uDBFF"]}]]',
                                  rb'{"a": "\ude00\ud83d"}'])  # a pair in the wrong order
def test_a_lone_surrogate_is_malformed_json(body: bytes) -> None:
    with pytest.raises(json.JSONDecodeError, match="surrogate"):
        loads(body)


@pytest.mark.parametrize("body, value", [(rb'{"a": "\ud83d\ude00"}', {"a": "\N{GRINNING FACE}"}),
                                         (rb'{"a": "\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash
                                         (b'{"a": "\xc3\xa9"}', {"a": "\u00e9"})])
def test_whole_characters_pass(body: bytes, value: object) -> None:
    assert loads(body) == value
