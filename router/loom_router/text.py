"""Generated token ids to streamed text: incremental detokenization that never emits half a
character or a wrong leading space, and stop sequences matched across token boundaries."""

from __future__ import annotations

from loom_router.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first new ones (as vLLM does)
_TRIM_AT = 512  # drop consumed ids once this many pile up before the window


class IncrementalDetokenizer:
    """Decodes one sequence token by token, as TGI and vLLM do.

    Each step decodes a short window twice, `ids[prefix_offset:read_offset]` (text already
    emitted) and `ids[prefix_offset:]`, and emits the difference; decoding with context is what
    gets SentencePiece's and byte-level BPE's leading spaces right. While the window's text ends
    in U+FFFD a multi-byte character is incomplete, so nothing is emitted yet.

        ids:  [ ... p p p p p | g g g | g ]
                prefix_offset   read_offset  (end)
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0) :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it made final (may be "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still waits for its other bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back when the sequence ends (incomplete bytes come out as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _trim(self) -> None:
        # Only ids from prefix_offset on are ever decoded again: keep memory bounded.
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class StopMatcher:
    """Finds stop sequences in streamed text and cuts them (and all after) from the output.

    A tail that could still grow into a stop sequence is held back until it either
    completes one (cut, stopped) or stops matching (released).
    """

    def __init__(self, stop_sequences: list[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stop_sequences) if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop sequence was reached)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            self._held, self.stopped = "", True
            return buffer[:match], True
        hold = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The held-back tail, released when the sequence ends without a match."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> int | None:
        positions = [p for p in (buffer.find(s) for s in self._stops) if p >= 0]
        return min(positions) if positions else None

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop sequence."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
