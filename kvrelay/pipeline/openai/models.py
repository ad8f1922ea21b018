"""Pydantic models of the OpenAI request bodies this server accepts (the /openapi.json schemas).

They describe exactly the fields `protocol.py` accepts (`HONOURED` plus `PASS_THROUGH` in
`validate.py`; any other top-level field is refused) with the value ranges the server enforces,
so a body that validates here is one the server takes. The parser in `protocol.py` still gives
the error answers (status, code, param, message).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    WithJsonSchema,
    model_validator,
)

from kvrelay.core.sampling import INT64_MAX, INT64_MIN

Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
One = Annotated[int, Field(strict=True, ge=1, le=1)]  # n, best_of: only 1 is implemented
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16


def _false(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


FalseOnly = Annotated[
    StrictBool, AfterValidator(_false), WithJsonSchema({"type": "boolean", "const": False})
]


class _Nested(BaseModel):
    """Nested objects: the parser reads the keys below and ignores others."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Nested):
    """A content part; only `text` parts are supported."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Nested):
    """One chat message; `content` may be null or absent only on assistant messages."""

    role: Role
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError("content is required except on assistant messages")
        return self


class StreamOptions(_Nested):
    """`stream_options` (only with `stream: true`)."""

    include_usage: StrictBool | None = None


class ResponseFormat(_Nested):
    """`response_format`: only plain text."""

    type: Literal["text"]


class _Request(BaseModel):
    """Fields of both endpoints; null counts as absent."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(strict=True, min_length=1)]
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    n: One | None = None
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = None
    max_tokens: Annotated[Int64, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: (
        Annotated[str, Field(strict=True, min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    cache_salt: StrictStr | None = None
    top_k: Annotated[Int64, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[Int64, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    # pass-through: accepted, change nothing
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        try:  # msgpack, Redis and the tokenizer need UTF-8: no lone surrogates anywhere
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("a string holds a lone UTF-16 surrogate") from exc
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        limit = self._max_tokens()
        if limit is not None and self.min_tokens is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int64, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    response_format: ResponseFormat | None = None
    store: FalseOnly | None = None
    parallel_tool_calls: StrictBool | None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(strict=True, min_length=1)]  # "" tokenizes to nothing: a 400


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, text or token ids (also as a one-element batch)."""

    prompt: (
        PromptText
        | TokenIds
        | Annotated[list[PromptText | TokenIds], Field(min_length=1, max_length=1)]
    )
    echo: FalseOnly | None = None
    best_of: One | None = None
    suffix: Annotated[str, Field(strict=True, max_length=0)] | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = None


def field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level JSON field names a request model accepts."""
    return frozenset(f.alias or name for name, f in model.model_fields.items())
