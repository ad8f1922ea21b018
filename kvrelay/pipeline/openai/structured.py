"""The request fields that constrain the output: OpenAI's `response_format` and vLLM's
`structured_outputs`, as pydantic models (used by `models.py` on both endpoints).

Each validates its constraint once, here at the edge: it becomes a `StructuredOutput` whose
grammar llguidance compiles (without a tokenizer) and follows along a few byte paths under the
engine's limits (`grammar_error`), so a bad schema, regex or grammar, or one past those
limits, is a 400 naming the field and nothing is queued. JSON is compact (no whitespace
between tokens, as OpenAI's) unless `structured_outputs` asks for whitespace.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    WithJsonSchema,
    model_validator,
)

from kvrelay.core.structured import (
    CHOICE,
    GRAMMAR,
    JSON,
    JSON_OBJECT,
    REGEX,
    InvalidStructuredOutput,
    StructuredOutput,
    grammar_error,
    json_schema_text,
    whitespace_error,
)
from kvrelay.pipeline.openai.explain import Says, fail, fail_as, refuse

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's StructuredOutputsParams options this server does not implement (refused by name)
_UNSUPPORTED_OPTIONS = {
    "structural_tag": "structured_outputs.structural_tag",
    "disable_additional_properties": "structured_outputs.disable_additional_properties",
}
_CONSTRAINTS = (JSON, REGEX, CHOICE, GRAMMAR, JSON_OBJECT)
_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback")
_MAX_ERROR = 1000  # characters of the grammar engine's message (it may quote the schema)


def _checked(spec: StructuredOutput, field: str, what: str) -> StructuredOutput:
    """`spec` if its grammar compiles, else the 400 for `field` (below the validated object)."""
    error = grammar_error(spec)
    if error is not None:
        raise fail(f"{what}: {error[:_MAX_ERROR]}", field=field)
    return spec


def checked_json_schema(
    schema: dict[str, Any], field: str, any_whitespace: bool = True
) -> StructuredOutput:
    """The constraint of a JSON schema given in `field`, or its 400 (the grammar compiles);
    `any_whitespace` False: compact JSON."""
    spec = StructuredOutput(JSON, json_schema_text(schema), any_whitespace)
    return _checked(spec, field, "invalid JSON schema")


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's {name, description, schema, strict}."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    # required (the validator below words its absence); the JSON schema says so too
    schema_: Annotated[dict[str, Any], Field(alias="schema"), WithJsonSchema({"type": "object"})]
    strict: StrictBool | None = None  # the schema is always enforced exactly

    @model_validator(mode="before")
    @classmethod
    def _schema_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema") is None:
            raise fail_as("missing", field="schema")
        if isinstance(data, dict) and not isinstance(data["schema"], dict):
            raise fail_as("type", field="schema", expected="an object (a JSON schema)")
        return data


class ResponseFormat(BaseModel):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (output valid for `json_schema.schema`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _spec: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in RESPONSE_FORMATS:
            kind = data.get("type")
            if not isinstance(kind, str):
                raise fail_as("type", field="type", expected="a string")
            raise refuse(f"response_format type {kind[:64]!r}", field="type")
        if isinstance(data, dict) and data["type"] == "json_schema" and not data.get("json_schema"):
            raise fail_as("missing", field="json_schema")
        return data

    @model_validator(mode="after")
    def _compile(self) -> ResponseFormat:
        if self.type == "json_object":
            self._spec = StructuredOutput(JSON_OBJECT, any_whitespace=False)  # compact, as OpenAI's
        elif self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_
            self._spec = checked_json_schema(schema, "json_schema.schema", any_whitespace=False)
        return self

    def spec(self) -> StructuredOutput | None:
        """The constraint asked for (None for text)."""
        return self._spec


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of `json` (a JSON schema, as an object or its
    JSON text), `regex`, `choice` (strings), `grammar` (Lark, or GBNF / EBNF in llama.cpp's
    syntax) and `json_object: true`; options `disable_any_whitespace` (false: any whitespace
    between JSON tokens, vLLM's default; by default there is none), `whitespace_pattern` (the
    whitespace allowed there, a regex) and `disable_fallback` (accepted: there is one grammar
    engine, so never a fallback)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: Annotated[
        dict[str, Any] | StrictStr | None,
        Field(alias="json"),
        WithJsonSchema({"type": ["object", "string"]}),
    ] = None
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    choice: (
        Annotated[list[StrictStr], Field(min_length=1), Says(expect="a non-empty array of strings")]
        | None
    ) = None
    grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    whitespace_pattern: StrictStr | None = None
    disable_fallback: StrictBool | None = None
    _spec: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _one_constraint(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # refused as "must be an object"
        for key, value in data.items():
            if value is None:
                continue
            if key in _UNSUPPORTED_OPTIONS:
                raise refuse(_UNSUPPORTED_OPTIONS[key], field=key)
            if key not in _CONSTRAINTS and key not in _OPTIONS:
                raise fail(
                    f"unknown structured_outputs field {key[:64]!r} (known: "
                    f"{', '.join(_CONSTRAINTS + _OPTIONS)})",
                    field=key[:256],
                    code="unknown_parameter",
                )
        given = [k for k in _CONSTRAINTS if data.get(k) is not None and data.get(k) is not False]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise fail(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object (got {what})"
            )
        return data

    @model_validator(mode="after")
    def _compile(self) -> StructuredOutputs:
        any_whitespace, pattern = self._whitespace()
        if self.json_ is not None:
            try:
                text = json_schema_text(self.json_)
            except InvalidStructuredOutput as exc:
                raise fail(f"invalid JSON schema: {exc}", field="json") from None
            spec = StructuredOutput(JSON, text, any_whitespace, pattern)
            self._spec = _checked(spec, "json", "invalid JSON schema")
        elif self.regex is not None:
            self._spec = _checked(StructuredOutput(REGEX, self.regex), "regex", "invalid regex")
        elif self.choice is not None:
            spec = StructuredOutput(CHOICE, list(self.choice))
            self._spec = _checked(spec, "choice", "invalid choice")
        elif self.grammar is not None:
            spec = StructuredOutput(GRAMMAR, self.grammar)
            self._spec = _checked(spec, "grammar", "invalid grammar")
        else:
            spec = StructuredOutput(JSON_OBJECT, "", any_whitespace, pattern)
            self._spec = _checked(spec, "json_object", "invalid json_object")
        return self

    def _whitespace(self) -> tuple[bool, str]:
        """(any_whitespace, whitespace_pattern) of the JSON kinds: compact JSON unless
        `disable_any_whitespace: false` (vLLM's default, asked for) or a pattern."""
        pattern = self.whitespace_pattern or ""
        if not pattern:
            return self.disable_any_whitespace is False, ""
        if self.json_ is None and not self.json_object:
            message = "whitespace_pattern applies to json and json_object only"
            raise fail(message, field="whitespace_pattern", code="unsupported_value")
        if self.disable_any_whitespace:
            message = "whitespace_pattern allows whitespace, disable_any_whitespace forbids it"
            raise fail(message, field="whitespace_pattern")
        error = whitespace_error(pattern)
        if error is not None:
            raise fail(
                f"invalid whitespace_pattern: {error[:_MAX_ERROR]}", field="whitespace_pattern"
            )
        return False, pattern

    def spec(self) -> StructuredOutput | None:
        return self._spec
