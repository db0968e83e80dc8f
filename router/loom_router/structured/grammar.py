"""Constrained decoding on the router: grammars compiled by llguidance, one matcher per
constrained sequence, and the allowed-token bitmasks each step carries to the shards.

    spec ──compile (own threads, bounded time, cached by source; 422 on error)──▶ Grammar
    Grammar ──new_matcher()──▶ Matcher per choice
    every step: fill_masks(plan) ─▶ plan.allowed_token_masks ─▶ shard masks the logits
    every sampled token: matcher.consume(token_id)

A constraint llguidance accepts may still be impossible to enforce (a regex its lexer cannot
build, a schema that allows nothing): compiling runs its first token to find that out (422);
what only shows later fails that request with an error, never a success that breaks it.

A matcher only ever sees a sequence's generated tokens, in order, so its state survives a
preemption (swap or recompute) and a prefix-cache hit unchanged: neither alters those tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from loom_proto.step import StepPlan
from loom_router.structured.spec import JSON_LAYOUT, ConstraintKind, ConstraintSpec
from loom_router.tokenizer import Tokenizer
from loom_router.types import OverloadedError, ValidationError

log = logging.getLogger("loom.grammar")

CACHE_SIZE = 128  # compiled grammars kept, least recently used dropped first
COMPILE_TIMEOUT_S = 10.0  # a constraint still compiling past this is refused (422)
COMPILE_THREADS = 2  # compiles run here, never on the threads that tokenize
# Errors without the parser's state and grammar: a client reads them.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# llguidance's names for a few failures, in words a client can act on.
KNOWN_ERRORS = {"NoExtensionBias": "it allows no output (does a $ref refer to itself?)"}
ENGINE_FAILURE = "the grammar engine failed on it (too large or too complex)"


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
        """Why the matcher cannot go on, in a client's words; None while it can."""
        return describe_error(self.ll.get_error()) if self.ll.is_error() else None


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

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[ConstraintSpec, Grammar] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                # llguidance.hf.from_tokenizer does this with a transformers wrapper the router lacks.
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._tokenizer.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    async def compile_async(self, spec: ConstraintSpec) -> Grammar:
        """`compile` on the compiler's own threads, within compile_timeout_s. Past it: 422 when
        it was compiling (too large or complex), 429 when it was still waiting for a thread
        (the server is busy compiling others). A compile that started runs on to its end (it
        cannot be interrupted) and is cached."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="loom-grammar")
            future = self._pool.submit(self.compile, spec)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.compile_timeout_s)
        except TimeoutError:
            if future.cancelled():  # never started
                raise OverloadedError(f"no thread was free to compile the constraint within "
                                      f"{self.compile_timeout_s:g} s; retry later") from None
            raise ValidationError(f"the constraint did not compile within {self.compile_timeout_s:g} s: "
                                  "it is too large or too complex") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _cached(self, spec: ConstraintSpec) -> Grammar | None:
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
            return cached

    def compile(self, spec: ConstraintSpec) -> Grammar:
        """The compiled grammar of spec. Raises ValidationError (HTTP 422) naming the reason."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        grammar = Grammar(spec, self._build(spec))
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """llguidance's matcher of spec; its grammar checked against the limits."""
        kind = "grammar (Lark or GBNF)" if spec.kind is ConstraintKind.LARK else spec.kind.value
        try:
            if spec.kind is ConstraintKind.JSON_SCHEMA:
                source = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_LAYOUT)
            elif spec.kind is ConstraintKind.CHOICE:
                source = llguidance.grammar_from("grammar", choice_grammar(json.loads(spec.source)))
            else:  # llguidance's "grammar" reads Lark, and GBNF (llama.cpp's) converted to Lark
                source = llguidance.grammar_from("grammar" if spec.kind is ConstraintKind.LARK else kind, spec.source)
            tokenizer = self.ll_tokenizer
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=LIMITS)
            if is_error:
                raise ValidationError(f"invalid {kind}: {describe_error(messages[0] if messages else '')}")
            matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=LIMITS)
            if matcher.is_error():
                raise ValidationError(f"invalid {kind}: {describe_error(matcher.get_error())}")
        except ValidationError:
            raise
        except ValueError as e:
            raise ValidationError(f"invalid {kind}: {describe_error(str(e))}") from None
        except BaseException as e:  # a Rust panic arrives as pyo3's PanicException (a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            log.error("llguidance failed on a %s: %r", kind, e)
            raise ValidationError(f"invalid {kind}: {ENGINE_FAILURE}") from None
        problem = _first_token_problem(matcher.deep_copy())
        if problem is not None:
            raise ValidationError(f"the {kind} cannot be enforced: {problem}")
        return matcher


def _first_token_problem(matcher: llguidance.LLMatcher) -> str | None:
    """Why the constraint cannot produce its first token, if it cannot: some only show once the
    parser moves (a regex the lexer cannot build, a schema that allows nothing)."""
    allowed = allowed_ids(matcher.compute_bitmask())
    if matcher.is_error():
        return describe_error(matcher.get_error())
    if len(allowed) == 0:
        return KNOWN_ERRORS["NoExtensionBias"]
    if not matcher.consume_token(int(allowed[0])) or matcher.is_error():
        return describe_error(matcher.get_error())
    if not matcher.is_stopped():
        matcher.compute_bitmask()
        if matcher.is_error():
            return describe_error(matcher.get_error())
    return None


def describe_error(message: str) -> str:
    """llguidance's message on one line, without its caret lines or placeholders; a panic's
    text and backtrace are logged, never returned (a client reads the result)."""
    if "panic" in message or "backtrace" in message:
        log.error("llguidance failed: %s", message)
        return ENGINE_FAILURE
    lines = [line.strip() for line in message.splitlines()]
    text = " ".join(line for line in lines if line and line not in ("^", "<non-verbose/>"))
    text = KNOWN_ERRORS.get(text, text) or "the grammar does not compile"
    return text[:500]


class MaskFiller:
    """Computes one step's allowed-token bitmasks for every constrained sequence in a plan."""

    def __init__(self, compiler: GrammarCompiler, executor: llguidance.LLExecutor | None = None) -> None:
        self._compiler = compiler
        self._executor = executor or llguidance.LLExecutor()

    def fill(self, plan: StepPlan, matcher_of: Callable[[int], Matcher | None]) -> dict[int, str]:
        """Sets plan.allowed_token_masks for the plan's sequences that have a matcher; returns
        the sequences whose grammar cannot go on (an error, or no token allowed), each with the
        reason: they get no mask and must not run.

        Sequences that only prefill a chunk get one too: cheap, and the plan need not
        know which chunk completes a prompt. Masks are computed in parallel (Rust threads).
        """
        matchers = [(seq_id, matcher) for seq_id in _plan_seq_ids(plan)
                    if (matcher := matcher_of(seq_id)) is not None]
        if not matchers:
            return {}
        vocab_size = self._compiler.ll_tokenizer.vocab_size
        masks = allocate_token_bitmask(len(matchers), vocab_size)  # [seqs, words] int32
        fill_next_token_bitmask_par(self._executor, [(m.ll, i) for i, (_, m) in enumerate(matchers)], masks)
        masks = masks.astype("<i4", copy=False)
        allows_any = masks.any(axis=1)
        failed: dict[int, str] = {}
        for i, (seq_id, matcher) in enumerate(matchers):
            problem = matcher.error or (None if allows_any[i] else KNOWN_ERRORS["NoExtensionBias"])
            if problem is None:
                plan.allowed_token_masks[seq_id] = masks[i].tobytes()
            else:
                failed[seq_id] = problem
        return failed


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


def choice_grammar(options: list[str]) -> str:
    """A Lark grammar whose output is exactly one of options, as one terminal: the lexer matches
    it (a parser rule of more than 2,000 alternatives is past llguidance's parser)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(option) for option in options) + "\n"
