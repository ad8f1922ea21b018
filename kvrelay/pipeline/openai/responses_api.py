"""Parse OpenAI `/v1/responses` bodies (the Responses API) into a ResponsesCall.

The request model states each field once, as `models.py` does for the completion endpoints
(types, ranges, wording; a field this server does not know is a 400 naming it). A call maps
onto the chat path: `instructions` becomes a system message, then the conversation of
`previous_response_id` (resolved by the ingress from its store), then `input`. Input items
become chat messages: `function_call` items an assistant message's `tool_calls` (joined to
the assistant message before them), `function_call_output` items `tool` messages (each must
answer a function call of the conversation: `ResponsesCall.check_call_outputs`). Function
`tools` (Responses' flat shape) and `tool_choice` become chat's (tools.py), and so take the
same constraints and parsers; `text.format` json_schema / json_object the same
StructuredOutput as chat's `response_format`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import JSON_OBJECT, StructuredOutput
from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.openai.explain import Says, explain, fail, fail_as, refuse
from kvrelay.pipeline.openai.models import (
    CacheRetention,
    MaxTokens,
    Priority,
    Temperature,
    TopP,
    field_names,
)
from kvrelay.pipeline.openai.protocol import Api, GenerationRequest
from kvrelay.pipeline.openai.structured import checked_json_schema
from kvrelay.pipeline.openai.tools import (
    AUTO,
    NAME_RULE,
    CallFunction,
    FunctionDefinition,
    FunctionTool,
    NamedToolChoice,
    ToolCalling,
    tool_calling,
    tool_constraint,
    valid_name,
)
from kvrelay.pipeline.openai.validate import check_known_fields, check_unicode

InputRole = Literal["user", "assistant", "system", "developer"]
INPUT_ROLES: tuple[str, ...] = get_args(InputRole)
# content part types that carry text: input_text (any role), output_text (earlier answers)
TEXT_PARTS = ("input_text", "output_text")


class _Nested(BaseModel):
    """Nested objects: keys other than these are ignored, as the OpenAI API does (an input
    message copied from an earlier response's output carries `id` and `status`)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class InputPart(_Nested):
    """A content part of an input message: text only."""

    type: Annotated[StrictStr, WithJsonSchema({"type": "string", "enum": list(TEXT_PARTS)})]
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in TEXT_PARTS:
            kind = data.get("type")
            what = f"content part type {str(kind)[:64]!r}" if kind else "a content part"
            raise refuse(what, field="type")
        return data


class InputMessage(_Nested):
    """An input message (`type` "message" or absent): content a string or text parts."""

    type: Literal["message"] | None = None
    role: InputRole
    content: Annotated[
        StrictStr | Annotated[list[InputPart], Field(min_length=1)],
        Says(expect="a string or an array of input_text parts"),
    ]

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # refused as "must be an object"
        kind = data.get("type")
        if kind is not None and kind not in ITEM_TYPES:
            raise refuse(f"input item type {str(kind)[:64]!r}", field="type")
        if data.get("role") not in INPUT_ROLES:
            message = f"{{param}} must be one of {', '.join(INPUT_ROLES)}"
            raise fail(message, field="role", templated=True)
        if data.get("content") == []:
            message = "'{param}' must not be an empty array"
            raise fail(message, field="content", code="invalid_value", templated=True)
        return data


class FunctionCallItem(_Nested):
    """A function call the model made earlier (an earlier response's output item)."""

    type: Literal["function_call"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr  # JSON text, as the model wrote it

    def tool_call(self) -> dict[str, Any]:
        """As chat templates take an assistant's tool call (see CallFunction)."""
        arguments = CallFunction(name=self.name, arguments=self.arguments).template_arguments()
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.call_id, "type": "function", "function": function}


class FunctionCallOutputItem(_Nested):
    """The result of a function call, for the model to read (a chat `tool` message)."""

    type: Literal["function_call_output"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    output: Annotated[
        StrictStr | Annotated[list[InputPart], Field(min_length=1)],
        Says(expect="a string or an array of input_text parts"),
    ]


ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_type(data: Any) -> str:
    """The input item's branch; anything unknown is a message, which words the refusal."""
    kind = data.get("type") if isinstance(data, dict) else None
    return kind if kind in ITEM_TYPES[1:] else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # NAME_RULE, as a JSON schema states it


class TextFormat(_Nested):
    """`text.format`: `text`, `json_object` (any JSON object) or `json_schema` (output valid
    for `schema`; Responses' flat shape of chat's `response_format.json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, WithJsonSchema({"type": "string", "pattern": _NAME})] | None = None
    description: StrictStr | None = None
    schema_: Annotated[
        dict[str, Any] | None, Field(alias="schema"), WithJsonSchema({"type": "object"})
    ] = None
    strict: StrictBool | None = None  # the schema is always enforced exactly
    _spec: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            if not isinstance(kind, str):
                raise fail_as("type", field="type", expected="a string")
            raise refuse(f"text.format type {kind[:64]!r}", field="type")
        if kind == "json_schema":
            for name in ("name", "schema"):
                if data.get(name) is None:
                    raise fail_as("missing", field=name)
            if not isinstance(data["schema"], dict):
                raise fail_as("type", field="schema", expected="an object (a JSON schema)")
        return data

    @model_validator(mode="after")
    def _compile(self) -> TextFormat:
        if self.type == "json_schema" and self.name is not None and not valid_name(self.name):
            raise fail(NAME_RULE, field="name", templated=True)
        # compact JSON, as chat's response_format and OpenAI's structured outputs
        if self.type == "json_object":
            self._spec = StructuredOutput(JSON_OBJECT, any_whitespace=False)
        elif self.type == "json_schema" and self.schema_ is not None:
            self._spec = checked_json_schema(self.schema_, "schema", any_whitespace=False)
        return self

    def spec(self) -> StructuredOutput | None:
        """The constraint asked for (None for text)."""
        return self._spec

    def echo(self) -> dict[str, Any]:
        """As the response object repeats it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "description": self.description,
            "schema": self.schema_,
            "strict": self.strict,
        }


class TextConfig(_Nested):
    """`text`: the output's format."""

    format: TextFormat | None = None


class ResponsesFunctionTool(FunctionDefinition):
    """One entry of `tools`: a function, in Responses' flat shape (no `function` wrapper)."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            kind = data.get("type")
            if not isinstance(kind, str):
                raise fail_as("type", field="type", expected="a string")
            raise refuse(f"tool type {kind[:64]!r} (only function tools)", field="type")
        return data

    def chat_tool(self) -> FunctionTool:
        """The same tool in chat's shape (what the tool machinery and templates take)."""
        definition = FunctionDefinition.model_construct(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return FunctionTool.model_construct(type="function", function=definition)

    def echo(self) -> dict[str, Any]:
        """As the response object repeats it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


class NamedFunction(_Nested):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            kind = data.get("type")
            if isinstance(kind, str):
                raise refuse(f"tool_choice type {kind[:64]!r}", field="type")
        return data


_CHOICES = '"none", "auto", "required" or {"type": "function", "name": ...}'
ResponsesToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedFunction,
    Says(
        expect=_CHOICES,
        invalid="'{param}' must be " + _CHOICES.replace("{", "{{").replace("}", "}}"),
    ),
]


_EMPTY_INPUT = Says(expect="a string or a non-empty array of input items")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (text and function calls; no hosted tools, no reasoning)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1), Says(missing="you must provide a model parameter")]
    input: Annotated[
        Annotated[StrictStr, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)],
        _EMPTY_INPUT,
    ]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    text: TextConfig | None = None
    truncation: Annotated[Literal["disabled"], Says(refused="truncation={value!r}")] | None = None
    # a reasoning model's settings: only the empty object (nothing asked) passes
    reasoning: Annotated[
        Any, WithJsonSchema({"type": "object", "maxProperties": 0}), Says(refused="reasoning")
    ] = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    user: StrictStr | None = None
    # pass-through: accepted, change nothing (docs/api.md); metadata is repeated in the answer
    metadata: (
        Annotated[dict[str, StrictStr], Says(expect="an object of strings", whole=True)] | None
    ) = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # the retained session (else user, the chain)
    prompt_cache_retention: CacheRetention | None = None
    priority: Priority | None = None  # None: the API key's default

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        """The whole body first: UTF-8 everywhere, no field we do not know; null is absent."""
        if isinstance(data, dict):
            try:
                check_unicode(data)
                check_known_fields(data, _accepted())
            except RequestError as err:
                raise fail(err.message, field=err.param or "", code=err.code) from err
            reasoning = data.get("reasoning")
            if reasoning is not None and (
                not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())
            ):
                raise refuse("reasoning", field="reasoning")
            if data.get("input") in ("", []):
                raise fail("'input' must not be empty", field="input", code="invalid_value")
            return {name: value for name, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _tool_choice(self) -> ResponsesRequest:
        calling = self.tool_calling()
        text_format = self.text.format if self.text is not None else None
        constrained = text_format is not None and text_format.spec() is not None
        if calling is not None and calling.mode != AUTO and constrained:
            message = (
                f"tool_choice {calling.mode} cannot be combined with another output "
                "constraint (text.format)"
            )
            raise fail(message, field="tool_choice")
        if calling is not None:
            tool_constraint(calling, self.chat_tools())  # required: the calls' schema compiles
        return self

    def chat_tools(self) -> list[FunctionTool]:
        return [tool.chat_tool() for tool in self.tools or ()]

    def tool_calling(self) -> ToolCalling | None:
        """What the output is with tools (None: plain text), by chat's rules."""
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice.model_validate(
                {"type": "function", "function": {"name": choice.name}}
            )
        return tool_calling(self.chat_tools(), choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutput | None:
        """The output constraint: a named or required tool choice's, else text.format's."""
        calling = self.tool_calling()
        if calling is not None:
            spec = tool_constraint(calling, self.chat_tools())
            if spec is not None:
                return spec
        return self.text.format.spec() if self.text and self.text.format else None

    def to_sampling_params(self) -> tuple[SamplingParams, frozenset[str]]:
        """The sampling this body asks for, and the SamplingParams fields it set (as
        `_Request.to_sampling_params`: the served model's defaults fill the others)."""
        given = {
            name: value
            for name in ("temperature", "top_p")
            if (value := getattr(self, name)) is not None
        }
        limit = self.max_output_tokens
        sampling = SamplingParams(max_tokens=limit, structured=self.structured(), **given)
        given_names = [*given, *(["max_tokens"] if limit is not None else [])]
        return sampling.normalize(), frozenset(given_names)


@functools.cache
def _accepted() -> frozenset[str]:
    return field_names(ResponsesRequest)


@dataclass(slots=True)
class ResponsesCall:
    """A validated Responses request: the generation to run and what its answer repeats."""

    generation: GenerationRequest  # messages: this call's input only, until conversation()
    input_messages: list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    # request values the response object repeats (metadata, user, max_output_tokens, ...)
    repeated: dict[str, Any] = field(default_factory=dict)
    # `input` items: (index, call_id) of each function_call_output, call_ids of function_calls
    call_outputs: list[tuple[int, str]] = field(default_factory=list)
    call_ids: frozenset[str] = frozenset()

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages to run: instructions, the earlier turns, then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return [*system, *history, *self.input_messages]

    def check_call_outputs(self, history: list[dict[str, Any]]) -> None:
        """400 for a function_call_output whose call_id names no function call of the
        conversation (this input, or the earlier turns of `previous_response_id`), as OpenAI."""
        known = set(self.call_ids)
        for message in history:
            known.update(str(call.get("id")) for call in message.get("tool_calls") or ())
        for index, call_id in self.call_outputs:
            if call_id not in known:
                raise bad_request(
                    f"No tool call found for function call output with call_id {call_id[:64]!r}.",
                    param=f"input[{index}].call_id",
                )

    def digest(self, generation_digest: str) -> str:
        """What a re-post must match: the generation, and what the answer repeats or stores."""
        what = {
            "generation": generation_digest,
            "store": self.store,
            "previous_response_id": self.previous_response_id,
            "repeated": self.repeated,
        }
        raw = json.dumps(what, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(raw.encode()).hexdigest()


def _text(content: str | list[InputPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before it
    (as one chat answer holds its text and its calls), an output is a `tool` message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(item.tool_call())
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [item.tool_call()]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
        else:
            out.append({"role": item.role, "content": _text(item.content)})
    return out


_OUTPUT_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items (messages, function calls) as the chat messages a
    follow-up continues from; an answer with no output is an empty assistant turn."""
    try:
        messages = chat_messages(_OUTPUT_ITEMS.validate_python(output))
    except ValidationError:
        messages = []
    return messages or [{"role": "assistant", "content": ""}]


def parse_responses(body: Any) -> ResponsesCall:
    """Validate a /v1/responses body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise explain(exc, ResponsesRequest) from None
    sampling, fields_set = req.to_sampling_params()
    limit = req.max_output_tokens
    items: list[Any] = []
    if isinstance(req.input, str):
        messages = [{"role": "user", "content": req.input}]
    else:
        items, messages = req.input, chat_messages(req.input)
    generation = GenerationRequest(
        api=Api.RESPONSES,
        model=req.model,
        sampling=sampling,
        messages=list(messages),
        stream=bool(req.stream),
        user=req.user,
        max_tokens_param="max_output_tokens",
        fields_set=fields_set,
        cache_session=req.prompt_cache_key or req.user,
        cache_retention=req.prompt_cache_retention,
        priority=req.priority,
    )
    if req.tools:
        generation.tools = [tool.chat_tool().to_dict() for tool in req.tools]
        generation.tool_calling = req.tool_calling()
    text_format = req.text.format if req.text and req.text.format else None
    choice: str | dict[str, str] | None
    if isinstance(req.tool_choice, NamedFunction):
        choice = {"type": "function", "name": req.tool_choice.name}
    else:
        choice = req.tool_choice
    repeated = {
        "instructions": req.instructions,
        "max_output_tokens": limit,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "tool_choice": choice or "auto",
        "tools": [tool.echo() for tool in req.tools or ()],
        "text": {"format": text_format.echo() if text_format else {"type": "text"}},
        "user": req.user,
        "service_tier": req.service_tier,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
    }
    return ResponsesCall(
        generation=generation,
        input_messages=messages,
        instructions=req.instructions,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        repeated=repeated,
        call_outputs=[
            (i, item.call_id)
            for i, item in enumerate(items)
            if isinstance(item, FunctionCallOutputItem)
        ],
        call_ids=frozenset(item.call_id for item in items if isinstance(item, FunctionCallItem)),
    )
