"""Structured output: the normalized constraint a request carries, and its grammar.

The ingress turns `response_format` (json_object, json_schema) and vLLM's `structured_outputs`
into one `StructuredOutput` (kind + value), which travels in `SamplingParams.structured`. The
ingress validates it (`grammar_error`) so an impossible constraint is a 400 and never queued;
the engine compiles the same grammar text (`grammar`) against its tokenizer. The grammar engine
is llguidance: it is torch-free (the ingress can validate without the engine's dependencies),
and vLLM's `guidance` backend spells each kind the same way.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvrelay.core.errors import KvrelayError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON, REGEX, CHOICE, GRAMMAR, JSON_OBJECT = "json", "regex", "choice", "grammar", "json_object"
KINDS = (JSON, REGEX, CHOICE, GRAMMAR, JSON_OBJECT)
_ANY_OBJECT = '{"type":"object"}'  # json_object: any JSON object (vLLM's guidance backend)


class InvalidStructuredOutput(KvrelayError, ValueError):
    """A structured-output constraint that no request can use (bad schema, regex, grammar)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One output constraint. `value`: json -> the schema as compact JSON text (key order kept:
    properties are generated in schema order); regex -> the pattern; grammar -> Lark or GBNF
    text; choice -> the strings; json_object -> "". `any_whitespace`: json kinds may put
    whitespace between tokens (vLLM's default; `disable_any_whitespace` turns it off)."""

    kind: str
    value: str | list[str] = ""
    any_whitespace: bool = True

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
        )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "any_whitespace": self.any_whitespace}

    @property
    def key(self) -> tuple[Any, ...]:
        """Hashable identity (the compile caches' key)."""
        value = tuple(self.value) if isinstance(self.value, list) else self.value
        return (self.kind, value, self.any_whitespace)

    def to_request(self) -> dict[str, Any]:
        """The `structured_outputs` request field that asks for this constraint."""
        value: Any = True if self.kind == JSON_OBJECT else self.value
        out: dict[str, Any] = {self.kind: value}
        if not self.any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    def check(self) -> StructuredOutput:
        """Raise InvalidStructuredOutput for a malformed spec (shape only; see grammar_error)."""
        if self.kind not in KINDS:
            raise InvalidStructuredOutput(
                f"structured kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.any_whitespace, bool):
            raise InvalidStructuredOutput("structured any_whitespace must be a boolean")
        if self.kind == CHOICE:
            if (
                not isinstance(self.value, list)
                or not self.value
                or not all(isinstance(c, str) for c in self.value)
            ):
                raise InvalidStructuredOutput("choice must be a non-empty array of strings")
        elif self.kind == JSON_OBJECT:
            if self.value != "":
                raise InvalidStructuredOutput("json_object takes no value")
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidStructuredOutput(f"{self.kind} must be a non-empty string")
        elif self.kind == JSON:
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise InvalidStructuredOutput(f"json schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidStructuredOutput("json schema must be a JSON object")
        return self

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (InvalidStructuredOutput if it has none)."""
        import llguidance  # only code that uses structured output loads it

        matcher = llguidance.LLMatcher
        whitespace: JsonCompileOptions = {"whitespace_flexible": self.any_whitespace}
        text = cast(str, self.value)  # a string for every kind but choice (callers check() first)
        try:
            if self.kind == JSON:
                return matcher.grammar_from_json_schema(text, defaults=whitespace)
            if self.kind == JSON_OBJECT:
                return matcher.grammar_from_json_schema(_ANY_OBJECT, defaults=whitespace)
            if self.kind == REGEX:
                return matcher.grammar_from_regex(text)
            if self.kind == CHOICE:
                return llguidance.grammar_from("choice", json.dumps(self.value))
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


def grammar_error(spec: StructuredOutput) -> str | None:
    """Why `spec`'s grammar cannot be compiled, or None when it can (without a tokenizer: the
    check the ingress makes; cached per spec)."""
    return _grammar_error(spec.key)


@functools.lru_cache(maxsize=256)
def _grammar_error(key: tuple[Any, ...]) -> str | None:
    import llguidance

    kind, value, any_whitespace = key
    value = list(value) if isinstance(value, tuple) else value
    spec = StructuredOutput(kind, value, any_whitespace)
    try:
        spec.check()
        grammar = spec.grammar()
    except InvalidStructuredOutput as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid grammar") if is_error else None
