"""Structured outputs: a grammar that a request's output must match, enforced while sampling.

    StructuredOutputs (frozen, in SamplingParams)   what the client asked for: a JSON schema,
        |  .grammar()                               any JSON object, a regex, a choice of
        v                                           strings or a Lark/GBNF grammar
    Grammars.guide()  -- compiled once per spec (bounded LRU), copied per request
        v
    Guide (Request.guide)   the request's position in its grammar: each step the sampler
                            asks it for the allowed tokens (a bitmask over the vocabulary,
                            batched over the constrained rows), the scheduler advances it
                            with each accepted token and ends the request when it is done

The grammar engine is llguidance (Rust, on the CPU). It was picked over xgrammar by
measurement on smollm2's 49,152-token vocabulary (20 schemas, random valid walks):
llguidance 0.25 ms to compile a schema, 0.1-0.17 ms per mask and row; xgrammar 4 ms to
compile, 0.02-0.09 ms per mask. Both masks are under 1% of a decode step here; the
compile time counts towards the first token of every new schema; and llguidance depends on
nothing, while xgrammar brings torch, transformers, triton and tvm-ffi into every worker.

This module is torch-free (the frontend validates specs with it); the mask is applied to
the logits in engine/sampler.py.
"""

from __future__ import annotations

import enum
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

from rtp_serve.core.validation import InvalidRequestError

# Compact JSON (no free whitespace): a small model given room for whitespace may spend its
# whole budget on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
MAX_CACHED_GRAMMARS = 64
_PARAM = "structured_outputs"


class GuideKind(enum.StrEnum):
    JSON = "json"  # `spec` is a JSON schema (text)
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of `choices`
    GRAMMAR = "grammar"  # Lark (llguidance's dialect) or GBNF


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """The constraint on one request's output. `resume_tokens`: the request resumes another
    worker's (its prompt ends with this many output tokens already made under the
    constraint); the grammar starts past them."""

    kind: GuideKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    resume_tokens: int = 0

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(GuideKind.JSON, text)

    @classmethod
    def json_object(cls) -> StructuredOutputs:
        return cls(GuideKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputs:
        return cls(GuideKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputs:
        return cls(GuideKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputs:
        return cls(GuideKind.GRAMMAR, text)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What the compiled grammar depends on (not where a request resumes)."""
        return (self.kind, self.spec, self.choices)

    def to_grammar(self) -> str:
        """llguidance's grammar for this spec; raises InvalidRequestError."""
        return _grammar(self)

    def validate(self, param: str = _PARAM) -> None:
        """Raise InvalidRequestError naming `param` unless this spec compiles."""
        try:
            grammar = self.to_grammar()
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{param}: {exc}", param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequestError(f"{param}: {error.strip()}", param)


def _grammar(so: StructuredOutputs) -> str:
    M = llguidance.LLMatcher
    match so.kind:
        case GuideKind.JSON:
            try:
                schema = json.loads(so.spec)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {exc}", _PARAM
                ) from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object", _PARAM)
            try:
                return M.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            except ValueError as exc:  # llguidance takes no integer past 64 bits (found by fuzzing)
                raise InvalidRequestError(f"the JSON schema: {exc}", _PARAM) from None
        case GuideKind.JSON_OBJECT:
            return M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        case GuideKind.REGEX:
            return M.grammar_from_regex(so.spec)
        case GuideKind.CHOICE:
            if not so.choices or not all(so.choices):
                raise InvalidRequestError("choices must be non-empty strings", _PARAM)
            return M.grammar_from_regex("|".join(map(_escape, so.choices)))
        case GuideKind.GRAMMAR:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(so.spec)
            except Exception as exc:  # the converter's own errors (GBNF syntax)
                raise InvalidRequestError(f"bad grammar: {exc}", _PARAM) from None
            return M.grammar_from_lark(lark)
    raise InvalidRequestError(f"unknown structured output kind {so.kind!r}", _PARAM)


def _escape(text: str) -> str:
    """A literal in llguidance's (Rust) regex syntax."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class Guide:
    """One request's matcher: which tokens may come next, and whether it is done."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end (or has failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class Grammars:
    """Compiles specs for one model's tokenizer, keeping the most recent ones (LRU).

    Safe to call from any thread. The tokenizer's token table is built on first use
    (~0.4 s for a 49k vocabulary), so engines that never see a constraint never pay it.
    """

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        capacity: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json.read_text(encoding="utf-8"),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos,
                )
            return self._tokenizer

    def guide(self, so: StructuredOutputs, prefix: Sequence[int] = ()) -> Guide:
        """A fresh matcher for `so`, advanced past `prefix`; raises InvalidRequestError."""
        template = self._template(so)
        guide = Guide(template.deep_copy())
        if prefix and not guide.matcher.consume_tokens(list(prefix)):
            raise InvalidRequestError(
                f"the resumed output does not match the grammar: {guide.error}",
                _PARAM,
            )
        return guide

    def _template(self, so: StructuredOutputs) -> llguidance.LLMatcher:
        key = so.key
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return template
        tokenizer = self.tokenizer
        matcher = llguidance.LLMatcher(tokenizer, so.to_grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{_PARAM}: {matcher.get_error().strip()}", _PARAM)
        with self._lock:
            self.misses += 1
            self._compiled[key] = matcher
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return matcher

    @property
    def num_cached(self) -> int:
        return len(self._compiled)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> llguidance.LLExecutor:
    """The thread pool that fills the bitmasks of a batch's guides in parallel (the GIL is
    released while it runs)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        return _executor


def fill_bitmasks(
    rows: list[tuple[Guide, int, list[int]]], bitmask_ptr: int, words_per_row: int, n: int
) -> None:
    """For each (guide, k, drafts): write the allowed tokens (bit t of word t // 32) of
    `guide` at row k, and of `guide` after drafts[:i] at row k + i, of an int32
    [n, words_per_row] C-contiguous buffer at `bitmask_ptr`. Rows past the first draft the
    grammar refuses are left as they are. The guides end where they started."""
    plain = [(g.matcher, k) for g, k, drafts in rows if not drafts]
    drafted = [(g.matcher, k, drafts) for g, k, drafts in rows if drafts]
    size = words_per_row * 4
    if plain:
        executor().unsafe_compute_mask_ptr(plain, bitmask_ptr, size, n)
    if drafted:  # llguidance refuses an empty draft list here
        executor().unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask_ptr, size, n)
