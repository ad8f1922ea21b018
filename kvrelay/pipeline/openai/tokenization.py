"""The bodies of vLLM's POST /tokenize and /detokenize, as pydantic models, and their parsing.

/tokenize takes a text prompt (`add_special_tokens` default true, as completions encode it) or
chat messages (rendered by the chat template; `add_generation_prompt` default true,
`add_special_tokens` default false, as chat completions encode them). /detokenize takes token
ids. `model` may be left out: the first served model. Errors are the one OpenAI-shaped 400
(`explain.py`), worded as for the completion bodies.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    model_validator,
)

from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.openai.explain import explain, fail
from kvrelay.pipeline.openai.models import ChatMessage, Int64, Says, field_names
from kvrelay.pipeline.openai.validate import check_known_fields, check_unicode


class _Body(BaseModel):
    """Fields of both endpoints; any other field is refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        """The whole body first: UTF-8 everywhere, no field we do not know; null is absent."""
        if isinstance(data, dict):
            try:
                check_unicode(data)
                check_known_fields(data, _fields(cls))
            except RequestError as err:
                raise fail(err.message, field=err.param or "", code=err.code) from err
            return {name: value for name, value in data.items() if value is not None}
        return data


class TokenizeCompletionRequest(_Body):
    """POST /tokenize with a text prompt."""

    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    """POST /tokenize with chat messages (the chat template renders them)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1), Says(expect="a non-empty array")]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    tokens: Annotated[list[Int64], Says(expect="an array of integers", whole=True)]


@functools.cache
def _fields(model: type[BaseModel]) -> frozenset[str]:
    return field_names(model)


def _validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise explain(exc, model) from None


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Validate a /tokenize body: `messages` makes it a chat request, else a text prompt."""
    chat = isinstance(body, dict) and body.get("messages") is not None
    return _validated(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    """Validate a /detokenize body."""
    return _validated(DetokenizeRequest, body)
