"""Tool calling on the request side: OpenAI's `tools`, `tool_choice` and the tool calls of
earlier assistant turns, as pydantic models (used by `models.py`), and `ToolCalling`, what a
request asks of its output.

`tool_choice` named or `required` is enforced by structured output, so any model obeys: named
constrains the output to the function's `parameters` schema (the output is the arguments);
`required` to a JSON array of `{"name", "arguments"}` objects, one per call (at most one
without `parallel_tool_calls`). `auto` leaves the output free and a tool parser
(`--tool-call-parser`) finds the calls in the text. Each function's schema is compiled here,
so a bad one is a 400 naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, model_validator

from kvrelay.core.structured import JSON, StructuredOutput, grammar_error, json_schema_text
from kvrelay.pipeline.openai.explain import Says, fail, fail_as, refuse

NAMED, REQUIRED, AUTO, NONE = "named", "required", "auto", "none"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI's rule for the name of a function, and of a response format's JSON schema
NAME_RULE = "'{param}' must be 1-64 characters of a-z, A-Z, 0-9, underscores and dashes"
_NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters, an empty list
_MAX_ERROR = 1000


def valid_name(name: str) -> bool:
    """Whether `name` keeps OpenAI's rule for names (NAME_RULE)."""
    return _NAME.fullmatch(name) is not None


class _Nested(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDefinition(_Nested):
    """`tools[i].function`: name, description, parameters (a JSON schema), strict."""

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the schema is enforced exactly whenever it is

    @model_validator(mode="after")
    def _check(self) -> FunctionDefinition:
        if not valid_name(self.name):
            raise fail(NAME_RULE, field="name", templated=True)
        error = grammar_error(StructuredOutput(JSON, json_schema_text(self.arguments_schema())))
        if error is not None:
            raise fail(f"invalid JSON schema: {error[:_MAX_ERROR]}", field="parameters")
        return self

    def arguments_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema."""
        return self.parameters if self.parameters is not None else _NO_PARAMETERS


class FunctionTool(_Nested):
    """One entry of `tools`: only function tools."""

    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            kind = data.get("type")
            if not isinstance(kind, str):
                raise fail_as("type", field="type", expected="a string")
            raise refuse(f"tool type {kind[:64]!r} (only function tools)", field="type")
        return data

    def to_dict(self) -> dict[str, Any]:
        """The tool as chat templates receive it (fields left out are absent)."""
        function = self.function.model_dump(exclude_none=True)
        return {"type": "function", "function": function}


class FunctionName(_Nested):
    name: StrictStr


class NamedToolChoice(_Nested):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: FunctionName


_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    Says(
        expect=_CHOICES,
        invalid="'{param}' must be " + _CHOICES.replace("{", "{{").replace("}", "}}"),
    ),
]


class CallFunction(_Nested):
    """An earlier call's function: its name and arguments (JSON text, as the model wrote it)."""

    name: StrictStr
    arguments: StrictStr

    def template_arguments(self) -> Any:
        """The arguments as chat templates take them: an object when the text is one (as
        transformers and vLLM pass them), else the text."""
        try:
            parsed = json.loads(self.arguments)
        except ValueError:
            return self.arguments
        return parsed if isinstance(parsed, dict) else self.arguments


class ToolCall(_Nested):
    """`messages[i].tool_calls[j]` of an assistant message: a call the model made earlier."""

    id: StrictStr
    type: Literal["function"]
    function: CallFunction

    def to_dict(self) -> dict[str, Any]:
        """As chat templates take it (see CallFunction.template_arguments)."""
        function = {"name": self.function.name, "arguments": self.function.template_arguments()}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What the output of a request with tools is: `mode` named (`name` the function),
    required or auto; `parallel`: more than one call allowed."""

    mode: str
    name: str = ""
    parallel: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "name": self.name, "parallel": self.parallel}

    @classmethod
    def from_dict(cls, data: Any) -> ToolCalling | None:
        if not isinstance(data, dict) or data.get("mode") not in (NAMED, REQUIRED, AUTO):
            return None
        return cls(data["mode"], str(data.get("name", "")), bool(data.get("parallel", True)))


def tool_calling(
    tools: list[FunctionTool] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> ToolCalling | None:
    """The output `tool_choice` asks for (None: plain text); raises the 400s of a choice that
    does not fit `tools` (as pydantic errors, from a model validator)."""
    if (isinstance(choice, NamedToolChoice) or choice == REQUIRED) and not tools:
        raise fail("tool_choice is only allowed when tools are specified", field="tool_choice")
    if not tools or choice == NONE:
        return None
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise fail(f"tools has two functions named {name!r}", field=f"tools[{i}]")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            message = f"tool_choice names the function {name[:64]!r}, which is not in tools"
            raise fail(message, field="tool_choice")
        return ToolCalling(NAMED, name, parallel=False)
    mode = REQUIRED if choice == REQUIRED else AUTO
    return ToolCalling(mode, parallel=parallel is not False)


def calls_schema(tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """`required`: a JSON array of calls, each `{"name": one of the functions, "arguments":
    valid for that function's parameters}` (vLLM's schema, with OpenAI's `arguments`)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "arguments": tool.function.arguments_schema(),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_constraint(calling: ToolCalling, tools: list[FunctionTool]) -> StructuredOutput | None:
    """The structured output that enforces a named or required choice (None for auto)."""
    if calling.mode == NAMED:
        tool = next(t for t in tools if t.function.name == calling.name)
        return StructuredOutput(JSON, json_schema_text(tool.function.arguments_schema()))
    if calling.mode == REQUIRED:
        spec = StructuredOutput(JSON, json_schema_text(calls_schema(tools, calling.parallel)))
        error = grammar_error(spec)
        if error is not None:
            raise fail(f"invalid tools: {error[:_MAX_ERROR]}", field="tools")
        return spec
    return None
