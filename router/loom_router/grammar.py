"""Constrained decoding on the router: grammars compiled by llguidance, one matcher per
constrained sequence, and the allowed-token bitmasks each step carries to the shards.

    spec ──compile (cached by source; 422 on error)──▶ Grammar ──new_matcher()──▶ Matcher per choice
    every step: fill_masks(plan) ─▶ plan.allowed_token_masks ─▶ shard masks the logits
    every sampled token: matcher.consume(token_id)

A matcher only ever sees a sequence's generated tokens, in order, so its state survives a
preemption (swap or recompute) and a prefix-cache hit unchanged: neither alters those tokens.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from loom_proto.step import StepPlan
from loom_router.tokenizer import Tokenizer
from loom_router.types import ValidationError

log = logging.getLogger("loom.grammar")

CACHE_SIZE = 128  # compiled grammars kept, least recently used dropped first
# JSON as json.dumps writes it: free whitespace lets a small model loop on blank lines until
# max_tokens; a schema's own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # source: a JSON list of strings; the output is exactly one of them
    LARK = "lark"  # a Lark or GBNF grammar (llguidance converts GBNF)


@dataclass(slots=True, frozen=True)
class ConstraintSpec:
    """What a request asks the output to match, before compilation."""

    kind: ConstraintKind
    source: str

    @classmethod
    def json_schema(cls, schema: object) -> ConstraintSpec:
        """A schema as a dict (or True for any JSON object); sorted keys make equal schemas one cache entry."""
        if schema is True or schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ValidationError(f"a JSON schema must be an object. Given: {type(schema).__name__}")
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True))

    @classmethod
    def choice(cls, options: list[str]) -> ConstraintSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValidationError("`choice` must be a non-empty list of strings")
        return cls(ConstraintKind.CHOICE, json.dumps(options))


class Matcher:
    """One constrained sequence's grammar state (an llguidance LLMatcher)."""

    __slots__ = ("ll",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher

    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""
        return self.ll.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only the end)."""
        return self.ll.is_stopped()

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None


@dataclass(slots=True, frozen=True)
class Grammar:
    """A compiled constraint; `new_matcher()` gives each sequence its own state."""

    spec: ConstraintSpec
    _template: llguidance.LLMatcher

    def new_matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints against one tokenizer, caching them by source.

    Building the llguidance tokenizer takes about a second, so it happens on first use
    (in the API's worker thread), never at import or on the event loop.
    """

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._cache: OrderedDict[ConstraintSpec, Grammar] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                # llguidance.hf.from_tokenizer does this with a transformers wrapper the router lacks.
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._tokenizer.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, spec: ConstraintSpec) -> Grammar:
        """The compiled grammar of spec. Raises ValidationError (HTTP 422) naming the reason."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        grammar = Grammar(spec, self._build(spec))
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        try:
            if spec.kind is ConstraintKind.JSON_SCHEMA:
                source = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_LAYOUT)
            else:
                source = llguidance.grammar_from(spec.kind.value, spec.source)
        except ValueError as e:
            raise ValidationError(f"invalid {spec.kind.value}: {e}") from None
        tokenizer = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error:
            raise ValidationError(f"invalid {spec.kind.value}: {_reason(messages)}")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValidationError(f"invalid {spec.kind.value}: {_reason([matcher.get_error()])}")
        return matcher


def _reason(messages: list[str]) -> str:
    """llguidance's message on one line (it spans several, with a caret under the error)."""
    lines = [line.strip() for line in (messages[0] if messages else "").splitlines()]
    text = " ".join(line for line in lines if line and line != "^") or "the grammar does not compile"
    return text[:500]


class MaskFiller:
    """Computes one step's allowed-token bitmasks for every constrained sequence in a plan."""

    def __init__(self, compiler: GrammarCompiler, executor: llguidance.LLExecutor | None = None) -> None:
        self._compiler = compiler
        self._executor = executor or llguidance.LLExecutor()

    def fill(self, plan: StepPlan, matcher_of: Callable[[int], Matcher | None]) -> None:
        """Sets plan.allowed_token_masks for the plan's sequences that have a matcher.

        Sequences that only prefill a chunk get one too: cheap, and the plan need not
        know which chunk completes a prompt. Masks are computed in parallel (Rust threads).
        """
        matchers: list[tuple[int, Matcher]] = []
        for seq_id in _plan_seq_ids(plan):
            matcher = matcher_of(seq_id)
            if matcher is not None and matcher.error is None:
                matchers.append((seq_id, matcher))
        if not matchers:
            return
        vocab_size = self._compiler.ll_tokenizer.vocab_size
        masks = allocate_token_bitmask(len(matchers), vocab_size)  # [seqs, words] int32
        fill_next_token_bitmask_par(self._executor, [(m.ll, i) for i, (_, m) in enumerate(matchers)], masks)
        masks = masks.astype("<i4", copy=False)
        plan.allowed_token_masks = {seq_id: masks[i].tobytes() for i, (seq_id, _) in enumerate(matchers)}


def _plan_seq_ids(plan: StepPlan) -> list[int]:
    ids = []
    for new in plan.new_requests:
        ids.append(new.request_id)
        ids.extend(fork.request_id for fork in new.forks)
    for running in plan.running_requests:
        ids.append(running.request_id)
        ids.extend(fork.request_id for fork in running.forks)
    return ids


def allowed_ids(mask: bytes) -> np.ndarray:
    """The token ids a packed mask allows (for tests and fakes)."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits)
