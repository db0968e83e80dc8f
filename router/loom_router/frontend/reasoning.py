"""A reasoning model's thinking, split from its answer: the text between `<think>` and `</think>`
(Qwen3, QwQ, DeepSeek-R1 and their distills) becomes the OpenAI chat message's
`reasoning_content`, the rest its `content`, whole or streamed.

It applies when the model's own chat template writes those tags. A prompt whose template opened a
`<think>` it did not close (thinking models that start their answer inside it) starts in
reasoning; one that closed it (Qwen3 with `enable_thinking` false) starts in the answer.

    <think>\\nThe user wants...\\n</think>\\n\\nParis.   ->   reasoning "The user wants...", content "Paris."
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Style(enum.Enum):
    """How a model's answer marks its reasoning."""

    THINK_TAGS = "think_tags"  # <think> ... </think> (this module)
    HARMONY = "harmony"  # gpt-oss's analysis channel (`loom_router.frontend.harmony`)


def applies(chat_template: str | None) -> bool:
    """The template writes thinking tags: its model reasons before answering."""
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def starts_in_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves a `<think>` open: the model's first tokens are thinking."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass(slots=True, frozen=True)
class Split:
    reasoning: str | None
    content: str | None


def split(text: str, in_reasoning: bool) -> Split:
    """A whole output's reasoning and content; `in_reasoning`: the prompt left a `<think>` open."""
    return split_with(ReasoningStream(in_reasoning), text)


def split_with(stream: PartStream, text: str) -> Split:
    """A whole output's reasoning and content, read by a fresh stream of any style."""
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind is Part.REASONING)
    content = "".join(t for kind, t in pieces if kind is Part.CONTENT)
    return Split(reasoning or None, content or None)


class PartStream(Protocol):
    """Text in, (part, text) pieces out: ReasoningStream, harmony.HarmonyStream."""

    def feed(self, text: str) -> list[tuple[Part, str]]: ...

    def finish(self) -> list[tuple[Part, str]]: ...


class Part(enum.Enum):
    REASONING = "reasoning_content"
    CONTENT = "content"


@dataclass(slots=True)
class ReasoningStream:
    """Streamed text in, (part, text) pieces out: what lies between the tags is reasoning, the rest
    content. Text that could still grow into a tag is held back until it cannot; the tags
    themselves, the whitespace around the reasoning and the blank lines right after `</think>`
    are dropped, so the pieces join to what `split` returns for the whole text."""

    in_reasoning: bool
    _held: str = ""
    _answer_started: bool = field(default=False)  # content after </think> began (newlines kept from then on)
    _reasoning_started: bool = field(default=False)  # reasoning text began (leading whitespace dropped till then)
    _seen_tag: bool = False

    def feed(self, text: str) -> list[tuple[Part, str]]:
        self._held += text
        pieces: list[tuple[Part, str]] = []
        while True:
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            at = self._held.find(tag)
            if at < 0:
                break
            before = self._held[:at]
            self._emit(pieces, before.rstrip() if self.in_reasoning else before)
            self._held = self._held[at + len(tag) :]
            self.in_reasoning, self._seen_tag = not self.in_reasoning, True
            self._answer_started = self._reasoning_started = False
        keep = _partial_tag_length(self._held, THINK_CLOSE if self.in_reasoning else THINK_OPEN)
        ready = self._held[: len(self._held) - keep]
        if self.in_reasoning:
            ready = ready.rstrip()  # trailing whitespace waits: it is dropped if </think> follows
        self._emit(pieces, ready)
        self._held = self._held[len(ready) :]
        return pieces

    def finish(self) -> list[tuple[Part, str]]:
        pieces: list[tuple[Part, str]] = []
        self._emit(pieces, self._held.rstrip() if self.in_reasoning else self._held)
        self._held = ""
        return pieces

    def _emit(self, pieces: list[tuple[Part, str]], text: str) -> None:
        if self.in_reasoning:
            if not self._reasoning_started:
                text = text.lstrip()
            if text:
                self._reasoning_started = True
                pieces.append((Part.REASONING, text))
            return
        if self._seen_tag and not self._answer_started:
            text = text.lstrip("\n")  # the blank line between </think> and the answer
        if text:
            self._answer_started = True
            pieces.append((Part.CONTENT, text))


def _partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of text could still grow into tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
