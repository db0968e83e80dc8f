"""Generated token ids to streamed text: incremental detokenization that never emits half a
character or a wrong leading space, and stop sequences matched across token boundaries."""

from __future__ import annotations

from collections import deque
from typing import Any

from loom_router.tokenizer import Tokenizer
from loom_router.types import StopText

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first new ones (as vLLM and TGI do)


class IncrementalDetokenizer:
    """Decodes one sequence token by token with the tokenizers library's `DecodeStream`.

    Each `add` returns exactly the text its token adds, so the pieces join to the decode of
    the whole sequence: a character whose UTF-8 bytes span tokens comes out whole with the
    token that completes it (the earlier ones add ""), and SentencePiece's and byte-level
    BPE's leading spaces are right because the stream starts from the prompt's last tokens.
    `flush` releases bytes still held back when the sequence ends (as U+FFFD, like the
    full decode).

    Most tokens of a byte-level tokenizer add the same text wherever they come after a whole
    character (`Tokenizer.whole_token_texts`): while nothing is held back, such a token's text
    is looked up and the `DecodeStream` does not see it. It need not: with a decoder that only
    maps symbols to bytes, what a later token adds does not depend on the whole characters
    before it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0):])
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()  # the prompt ends inside a character: those bytes are not the output's
        self._step = tokenizer.decode_stream(context, skip_special_tokens).step
        # The last ids before `_held`, for flush's decode (a deque: this runs for every token).
        self._context: deque[int] = deque(context, maxlen=PROMPT_CONTEXT_TOKENS)
        self._held: list[int] = []  # ids added since the last text came out
        self._whole = tokenizer.whole_token_texts

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it made final (may be "")."""
        held = self._held
        if not held:
            text = self._whole.get(token_id)
            if text is not None:
                self._context.append(token_id)
                return text
        held.append(token_id)
        try:
            text = self._step(token_id)
        except Exception:  # the decoder rewrote earlier text: restart the stream after it
            text = self._restart()
        if text is None:
            return ""  # nothing yet: a character waits for its other bytes, or a skipped special
        self._context.extend(held)
        held.clear()
        return text

    def flush(self) -> str:
        """The text still held back when the sequence ends (incomplete bytes come out as U+FFFD)."""
        if not self._held:
            return ""
        context = list(self._context)
        before = self._decode(context)
        after = self._decode(context + self._held)
        self._context.extend(self._held)
        self._held = []
        self._step = self._tokenizer.decode_stream(list(self._context), self._skip_special_tokens).step
        return after[len(before):] if after.startswith(before) else after

    def _restart(self) -> str | None:
        text = self.flush()
        return text or None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The text each token of `ids` adds, by the same rule as a stream: the texts join to
    the decode of `ids` (a prompt's tokens in details, echo and logprobs). Linear in len(ids)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    texts = [detokenizer.add(token_id) for token_id in ids]
    if texts:
        texts[-1] += detokenizer.flush()
    return texts


def token_string(tokenizer: Tokenizer, token_id: int, partial_prefix: str = "") -> str:
    """A token on its own, as logprobs name it (the sampled token and its alternatives alike):
    its bytes as text, or, for a token holding part of a UTF-8 character, those bytes escaped
    as Python writes them (`\\xe2\\x80`) after `partial_prefix` (OpenAI's completions write `bytes:`)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return partial_prefix + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def token_spans(tokenizer: Tokenizer, text: str, truncate: int | None = None) -> list[dict[str, Any]]:
    """TGI's /tokenize answer: each token with its character span in `text`, in one linear pass
    over the encoder's offsets. The bytes of one character may span tokens: those before the
    last get an empty span and the character goes to the token that completes it, so the
    spans never overlap (as the stream's texts). `truncate` keeps the last tokens (and BOS)."""
    ids, offsets = tokenizer.encode_with_offsets(text, truncate)
    spans: list[dict[str, Any]] = []
    position = 0  # where the next span starts: the end of the last one
    held = False  # the previous token ended inside a character: its text comes with this one
    for index, (token_id, (start, stop)) in enumerate(zip(ids, offsets)):
        start = position if held else max(start, position)
        held = index + 1 < len(ids) and _overlaps(offsets[index + 1], stop)
        stop = start if held else max(stop, start)
        spans.append({"id": token_id, "text": text[start:stop], "start": start, "stop": stop})
        position = stop
    return spans


def _overlaps(span: tuple[int, int], stop: int) -> bool:
    """Does a token spanning `span` start inside the character that ends at `stop`?
    (An added special token has the empty span (0, 0) and continues nothing.)"""
    return span[0] < stop and span[1] > span[0]


class StopMatcher:
    """Finds stop sequences in streamed text and ends the output there, as `stop_text` says:
    before the first to start (CUT), or after the first to complete (KEEP), or with the rest
    of the token that completed it (KEEP_TOKEN).

    A tail that could still grow into a stop sequence is held back until it either
    completes one (cut, stopped) or stops matching (released).
    """

    def __init__(self, stop_sequences: list[str], stop_text: StopText = StopText.CUT) -> None:
        self._stops = [s for s in dict.fromkeys(stop_sequences) if s]
        self._stop_text = stop_text
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop sequence was reached)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        match = self._match(buffer)
        if match is not None:
            self._held, self.stopped = "", True
            return (buffer if self._stop_text is StopText.KEEP_TOKEN else buffer[:match]), True
        hold = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The held-back tail, released when the sequence ends without a match."""
        held, self._held = self._held, ""
        return held

    def _match(self, buffer: str) -> int | None:
        """Where the output ends: before the earliest stop sequence (CUT), or after the first to end."""
        found = [(p, p + len(s)) for p, s in ((buffer.find(s), s) for s in self._stops) if p >= 0]
        if not found:
            return None
        if self._stop_text is StopText.CUT:
            return min(start for start, _ in found)
        return min(end for _, end in found)

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop sequence."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
