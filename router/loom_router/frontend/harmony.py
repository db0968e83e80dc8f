"""gpt-oss's harmony output read as an OpenAI chat answer. The answer is messages on channels,

    <|channel|>{channel}[ to={recipient}][ <|constrain|>{type}]<|message|>{body}<|end|> (or <|call|>, <|return|>)

the next one opened by `<|start|>assistant` (the recipient may stand there too:
`<|start|>assistant to=functions.f<|channel|>commentary ...`). Each message goes to one part:

    analysis (and calls to its built-in tools)    -> reasoning_content
    final, commentary without a recipient          -> content (a commentary "preamble" is for users)
    commentary to=functions.NAME                   -> a tool call, handed on as Hermes text,
                                                      <tool_call>{"name": NAME, "arguments": {...}}</tool_call>,
                                                      for tool_parsers' one Hermes reader

It applies when the model's chat template writes harmony's markers. Text outside any message
(an answer forced by a grammar, a model ignoring the format) is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from loom_router.frontend.reasoning import Part
from loom_router.frontend.tool_parsers import HERMES_CLOSE, HERMES_OPEN

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
FUNCTIONS = "functions."
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"to=([^\s<]+)")
_HEADER_LIMIT = 64  # characters without a marker: not a header, plain text


def applies(chat_template: str | None) -> bool:
    """The template writes harmony messages (gpt-oss)."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


@dataclass(slots=True)
class HarmonyStream:
    """Streamed harmony text in, (part, text) pieces out; the same `feed`/`finish` as
    `reasoning.ReasoningStream`. A body streams as it comes (less a tail that could still grow
    into its end marker); a tool call's arguments wait for the end of their message."""

    _held: str = ""
    _in_body: bool = False
    _plain: bool = False  # the output is not harmony: all content
    _channel: str = ""
    _recipient: str = ""
    _arguments: str = ""

    def feed(self, text: str) -> list[tuple[Part, str]]:
        self._held += text
        pieces: list[tuple[Part, str]] = []
        if self._plain:
            pieces.append((Part.CONTENT, self._held))
            self._held = ""
            return pieces
        while True:
            if self._in_body:
                at, end = _first_end(self._held)
                if at < 0:
                    break
                self._body(pieces, self._held[:at])
                self._close(pieces)
                self._held = self._held[at + len(end) :]
            else:
                at = self._held.find(MESSAGE)
                if at < 0:
                    break
                self._open(self._held[:at])
                self._held = self._held[at + len(MESSAGE) :]
        if self._in_body:
            keep = max(_partial_length(self._held, end) for end in ENDS)
            self._body(pieces, self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
        elif "<|" not in self._held and len(self._held) > _HEADER_LIMIT:
            self._plain = True
            pieces.append((Part.CONTENT, self._held))
            self._held = ""
        return pieces

    def finish(self) -> list[tuple[Part, str]]:
        pieces: list[tuple[Part, str]] = []
        if self._in_body:  # cut short (length): what the message holds so far
            self._body(pieces, self._held)
            if self._arguments:
                pieces.append((Part.CONTENT, self._arguments))
        else:
            stray = _without_markers(self._held)
            if stray.strip():
                pieces.append((Part.CONTENT, stray))
        self._held = ""
        return pieces

    def _open(self, header: str) -> None:
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient else ""
        self._in_body, self._arguments = True, ""

    def _body(self, pieces: list[tuple[Part, str]], text: str) -> None:
        if not text:
            return
        if self._recipient.startswith(FUNCTIONS):
            self._arguments += text
        elif self._channel == "analysis" or self._recipient:
            pieces.append((Part.REASONING, text))
        else:
            pieces.append((Part.CONTENT, text))

    def _close(self, pieces: list[tuple[Part, str]]) -> None:
        if self._recipient.startswith(FUNCTIONS):
            pieces.append((Part.CONTENT, _as_hermes(self._recipient.removeprefix(FUNCTIONS), self._arguments)))
        self._in_body, self._arguments = False, ""


def _as_hermes(name: str, arguments: str) -> str:
    """A harmony call as Hermes text; arguments that are not JSON stay as they are (content)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return f"{HERMES_OPEN}{json.dumps({'name': name, 'arguments': parsed}, ensure_ascii=False)}{HERMES_CLOSE}"


def _first_end(text: str) -> tuple[int, str]:
    found = [(text.find(end), end) for end in ENDS if end in text]
    return min(found) if found else (-1, "")


def _partial_length(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _without_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text
