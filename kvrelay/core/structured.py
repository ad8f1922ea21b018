"""Structured output: the normalized constraint a request carries, and its grammar.

The ingress turns `response_format` (json_object, json_schema) and vLLM's `structured_outputs`
into one `StructuredOutput` (kind + value + JSON whitespace), which travels in
`SamplingParams.structured`. The ingress validates it (`grammar_error`) so an impossible
constraint is a 400 and never queued; the engine compiles the same grammar text (`grammar`)
against its tokenizer, under the same limits (`parser_limits`). The grammar engine is
llguidance: it is torch-free (the ingress can validate without the engine's dependencies), and
vLLM's `guidance` backend spells each kind the same way.

Some grammars compile yet fail later: llguidance refuses a parser row of more than
`MAX_ITEMS_IN_ROW` Earley items when it gets there (a rule of 3,000 alternatives fails at its
first byte). `grammar_error` therefore also walks a few random byte paths through the grammar
(`_walk_error`); a failure the walks miss fails the request in the engine (engine/grammar.py).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvrelay.core.errors import KvrelayError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from llguidance._lib import JsonCompileOptions

JSON, REGEX, CHOICE, GRAMMAR, JSON_OBJECT = "json", "regex", "choice", "grammar", "json_object"
KINDS = (JSON, REGEX, CHOICE, GRAMMAR, JSON_OBJECT)
_ANY_OBJECT = '{"type":"object"}'  # json_object: any JSON object (vLLM's guidance backend)

# Bounds of a constraint (the compile cost grows with them: docs/api.md, Structured output)
MAX_CHOICES = 10_000  # strings of a choice
MAX_CONSTRAINT_CHARS = 256 * 1024  # of a schema's JSON text, a regex, a grammar, all choices
MAX_WHITESPACE_PATTERN_CHARS = 256
# llguidance's default, pinned: the engine and the ingress's check run under the same limit
MAX_ITEMS_IN_ROW = 2000
_WALKS, _WALK_STEPS = 4, 64  # the ingress's trial walks: how many, of how many bytes each
_JSON_WHITESPACE = r"[\x20\x09\x0A\x0D]*"


class InvalidStructuredOutput(KvrelayError, ValueError):
    """A structured-output constraint that no request can use (bad schema, regex, grammar)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One output constraint. `value`: json -> the schema as compact JSON text (key order kept:
    properties are generated in schema order); regex -> the pattern; grammar -> Lark or GBNF
    text; choice -> the strings; json_object -> "". Whitespace between JSON tokens (json
    kinds): with `whitespace_pattern`, what that regex matches; else with `any_whitespace` any
    run of it (vLLM's default), else none (compact JSON, as OpenAI's: the default of the HTTP
    requests, which set any_whitespace=False)."""

    kind: str
    value: str | list[str] = ""
    any_whitespace: bool = True
    whitespace_pattern: str = ""

    def __post_init__(self) -> None:
        if self.whitespace_pattern and self.any_whitespace is True:  # the pattern replaces it
            object.__setattr__(self, "any_whitespace", False)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutput:
        """From its `to_dict()` form (a wire message, a client's dict)."""
        if isinstance(data, StructuredOutput):
            return data
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise InvalidStructuredOutput("structured must be an object with a 'kind'")
        return cls(
            kind=data["kind"],
            value=data.get("value", ""),
            any_whitespace=data.get("any_whitespace", True),
            whitespace_pattern=data.get("whitespace_pattern", ""),
        )

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "value": self.value, "any_whitespace": self.any_whitespace}
        if self.whitespace_pattern:
            out["whitespace_pattern"] = self.whitespace_pattern
        return out

    @property
    def key(self) -> tuple[Any, ...]:
        """Hashable identity (the compile caches' key)."""
        value = tuple(self.value) if isinstance(self.value, list) else self.value
        return (self.kind, value, self.any_whitespace, self.whitespace_pattern)

    def to_request(self) -> dict[str, Any]:
        """The `structured_outputs` request field that asks for this constraint (compact JSON
        is that field's default)."""
        value: Any = True if self.kind == JSON_OBJECT else self.value
        out: dict[str, Any] = {self.kind: value}
        if self.whitespace_pattern:
            out["whitespace_pattern"] = self.whitespace_pattern
        elif self.any_whitespace and self.kind in (JSON, JSON_OBJECT):
            out["disable_any_whitespace"] = False
        return out

    def check(self) -> StructuredOutput:
        """Raise InvalidStructuredOutput for a malformed spec (shape and bounds only; see
        grammar_error)."""
        if self.kind not in KINDS:
            raise InvalidStructuredOutput(
                f"structured kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        self._check_whitespace()
        if self.kind == CHOICE:
            if (
                not isinstance(self.value, list)
                or not self.value
                or not all(isinstance(c, str) for c in self.value)
            ):
                raise InvalidStructuredOutput("choice must be a non-empty array of strings")
            if len(self.value) > MAX_CHOICES:
                raise InvalidStructuredOutput(
                    f"choice has {len(self.value):,} strings; at most {MAX_CHOICES:,} are allowed"
                )
        elif self.kind == JSON_OBJECT:
            if self.value != "":
                raise InvalidStructuredOutput("json_object takes no value")
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidStructuredOutput(f"{self.kind} must be a non-empty string")
        size = sum(map(len, self.value)) if isinstance(self.value, list) else len(self.value)
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidStructuredOutput(
                f"{self.kind} has {size:,} characters; at most {MAX_CONSTRAINT_CHARS:,} are allowed"
            )
        if self.kind == JSON:
            try:
                schema = json.loads(cast(str, self.value))
            except ValueError as exc:
                raise InvalidStructuredOutput(f"json schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidStructuredOutput("json schema must be a JSON object")
        return self

    def _check_whitespace(self) -> None:
        if not isinstance(self.any_whitespace, bool):
            raise InvalidStructuredOutput("structured any_whitespace must be a boolean")
        pattern = self.whitespace_pattern
        if not isinstance(pattern, str):
            raise InvalidStructuredOutput("structured whitespace_pattern must be a string")
        if pattern and self.kind not in (JSON, JSON_OBJECT):
            raise InvalidStructuredOutput("whitespace_pattern applies to JSON output only")
        if len(pattern) > MAX_WHITESPACE_PATTERN_CHARS:
            raise InvalidStructuredOutput(
                f"whitespace_pattern has {len(pattern):,} characters; at most "
                f"{MAX_WHITESPACE_PATTERN_CHARS} are allowed"
            )

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (InvalidStructuredOutput if it has none)."""
        import llguidance  # only code that uses structured output loads it

        matcher = llguidance.LLMatcher
        whitespace: JsonCompileOptions = {"whitespace_flexible": self.any_whitespace}
        if self.whitespace_pattern:  # (any_whitespace is False with a pattern)
            whitespace["whitespace_pattern"] = self.whitespace_pattern
        text = cast(str, self.value)  # a string for every kind but choice (callers check() first)
        try:
            if self.kind == JSON:
                return matcher.grammar_from_json_schema(text, defaults=whitespace)
            if self.kind == JSON_OBJECT:
                return matcher.grammar_from_json_schema(_ANY_OBJECT, defaults=whitespace)
            if self.kind == REGEX:
                return matcher.grammar_from_regex(text)
            if self.kind == CHOICE:
                # one lexeme, not a rule of N alternatives (one parser row of N items: llguidance
                # refuses rows of more than MAX_ITEMS_IN_ROW)
                strings = " | ".join(json.dumps(c) for c in self.value)
                return matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {strings}\n")
            return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted
        except (ValueError, TypeError) as exc:
            raise InvalidStructuredOutput(str(exc)) from None


def json_schema_text(schema: Any) -> str:
    """A JSON schema (object, or its JSON text) as the compact text `StructuredOutput` holds;
    InvalidStructuredOutput when it is neither."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidStructuredOutput(f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidStructuredOutput("a JSON schema must be an object")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def parser_limits() -> LLParserLimits:
    """The grammar engine's limits, the same in the engine and in the ingress's check (errors
    without the parser's state and the grammar text: a log line, not a dump)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


def matcher_error(matcher: LLMatcher) -> str | None:
    """A failed matcher's error message, None while it has none."""
    if not matcher.is_error():
        return None
    return matcher.get_error().removesuffix("\n<non-verbose/>")


def grammar_error(spec: StructuredOutput) -> str | None:
    """Why the engine cannot follow `spec`'s grammar (it does not compile, or fails on a byte
    path through it), or None when it can (without the model's tokenizer: the check the
    ingress makes; cached per spec)."""
    return _grammar_error(spec.key)


def whitespace_error(pattern: str) -> str | None:
    """Why `pattern` cannot be a JSON whitespace_pattern, or None (cached)."""
    return _grammar_error((JSON_OBJECT, "", False, pattern))


@functools.lru_cache(maxsize=256)
def _grammar_error(key: tuple[Any, ...]) -> str | None:
    import llguidance

    kind, value, any_whitespace, pattern = key
    value = list(value) if isinstance(value, tuple) else value
    spec = StructuredOutput(kind, value, any_whitespace, pattern)
    try:
        spec.check()
        grammar = spec.grammar()
    except InvalidStructuredOutput as exc:
        return str(exc)
    start = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=parser_limits())
    error = matcher_error(start)  # it does not compile (validate_grammar's message)
    if error is not None:
        return error
    if pattern and not _only_whitespace(pattern):
        return (
            f"{pattern!r} matches text other than JSON whitespace (space, tab, newline, "
            "carriage return)"
        )
    error = _walk_error(start)
    return None if error is None else f"the grammar engine cannot follow it: {error}"


def _walk_error(start: LLMatcher) -> str | None:
    """The engine's failure along a few random byte paths from `start` (seeded: the same
    answer each time), or None: a limit that only a later step reaches is found before anything
    is queued. A byte path asks no more of the grammar engine than the model's tokens do."""
    import numpy as np

    for walk in range(_WALKS):
        rng, matcher = random.Random(walk), start.deep_copy()
        for _ in range(_WALK_STEPS):
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:256])  # not the end
            if matcher.is_error() or not len(allowed):
                break
            if not matcher.consume_token(int(rng.choice(allowed))) or matcher.is_stopped():
                break
        error = matcher_error(matcher)
        if error is not None:
            return error
    return None


def _only_whitespace(pattern: str) -> bool:
    """Whether every string `pattern` matches is JSON whitespace: the regex minus those strings
    (llguidance's `&` and `~` on lexemes, its own escaping of the pattern), or the empty
    string, allows no first byte, only the end."""
    import llguidance

    lexeme = json.loads(llguidance.LLMatcher.grammar_from_regex(pattern))["grammars"][0]
    regex = lexeme["lark_grammar"].removeprefix("start: ")
    grammar = llguidance.LLMatcher.grammar_from_lark(
        f'start: OTHER | ""\nOTHER: {regex} & ~/{_JSON_WHITESPACE}/\n'
    )
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    mask = int.from_bytes(matcher.compute_bitmask(), "little")
    return not matcher.is_error() and mask == 1 << _Bytes.eos_token_id


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and an end token): llguidance's
    TokenizerWrapper protocol."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
