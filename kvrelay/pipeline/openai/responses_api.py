"""Parse OpenAI `/v1/responses` bodies (the Responses API, text only) into a ResponsesCall.

The request model states each field once, as `models.py` does for the completion endpoints
(types, ranges, wording; a field this server does not know is a 400 naming it). A call maps
onto the chat path: `instructions` becomes a system message, then the conversation of
`previous_response_id` (resolved by the ingress from its store), then `input`.
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
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.openai.explain import Says, explain, fail, refuse
from kvrelay.pipeline.openai.models import Int64, Number, _bounded, field_names
from kvrelay.pipeline.openai.protocol import GenerationRequest
from kvrelay.pipeline.openai.validate import check_known_fields, check_unicode

RESPONSES = "responses"  # GenerationRequest.api of a Responses call
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
    """One input item: a message (`type` "message" or absent), content a string or parts."""

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
        if kind is not None and kind != "message":
            raise refuse(f"input item type {str(kind)[:64]!r}", field="type")
        if data.get("role") not in INPUT_ROLES:
            message = f"{{param}} must be one of {', '.join(INPUT_ROLES)}"
            raise fail(message, field="role", templated=True)
        if data.get("content") == []:
            message = "'{param}' must not be an empty array"
            raise fail(message, field="content", code="invalid_value", templated=True)
        return data


class TextFormat(_Nested):
    """`text.format`: plain text only (json_schema and json_object come with structured output)."""

    type: Literal["text"]

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise refuse(f"text.format type {str(data.get('type'))[:64]!r}")
        return data


class TextConfig(_Nested):
    """`text`: the output's format."""

    format: TextFormat | None = None


_EMPTY_INPUT = Says(expect="a string or a non-empty array of input items")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (text in, text out; no tools, no reasoning)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1), Says(missing="you must provide a model parameter")]
    input: Annotated[
        Annotated[StrictStr, Field(min_length=1)]
        | Annotated[list[InputMessage], Field(min_length=1)],
        _EMPTY_INPUT,
    ]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: _bounded("max_tokens", Int64) | None = None
    temperature: _bounded("temperature", Number) | None = None
    top_p: _bounded("top_p", Number) | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    text: TextConfig | None = None
    truncation: Annotated[Literal["disabled"], Says(refused="truncation={value!r}")] | None = None
    # a reasoning model's settings: only the empty object (nothing asked) passes
    reasoning: Annotated[
        Any, WithJsonSchema({"type": "object", "maxProperties": 0}), Says(refused="reasoning")
    ] = None
    tools: Annotated[list[Any], Field(max_length=0), Says(refused="tools")] | None = None
    tool_choice: (
        Annotated[Literal["none", "auto"], Says(refused="tool_choice={value!r}")] | None
    ) = None
    user: StrictStr | None = None
    # pass-through: accepted, change nothing (docs/api.md); metadata is repeated in the answer
    metadata: (
        Annotated[dict[str, StrictStr], Says(expect="an object of strings", whole=True)] | None
    ) = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None

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

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages to run: instructions, the earlier turns, then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return [*system, *history, *self.input_messages]

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


def _message(item: InputMessage) -> dict[str, Any]:
    content = item.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    return {"role": item.role, "content": content}


def parse_responses(body: Any) -> ResponsesCall:
    """Validate a /v1/responses body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise explain(exc, ResponsesRequest) from None
    given = {
        name: value
        for name in ("temperature", "top_p")
        if (value := getattr(req, name)) is not None
    }
    limit = req.max_output_tokens
    sampling = SamplingParams(max_tokens=limit, **given).normalize()
    if isinstance(req.input, str):
        messages = [{"role": "user", "content": req.input}]
    else:
        messages = [_message(item) for item in req.input]
    generation = GenerationRequest(
        api=RESPONSES,
        model=req.model,
        sampling=sampling,
        messages=list(messages),
        stream=bool(req.stream),
        user=req.user,
        max_tokens_param="max_output_tokens",
        fields_set=frozenset([*given, *(["max_tokens"] if limit is not None else [])]),
    )
    repeated = {
        "instructions": req.instructions,
        "max_output_tokens": limit,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "tool_choice": req.tool_choice or "auto",
        "user": req.user,
        "service_tier": req.service_tier,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }
    return ResponsesCall(
        generation=generation,
        input_messages=messages,
        instructions=req.instructions,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        repeated=repeated,
    )
