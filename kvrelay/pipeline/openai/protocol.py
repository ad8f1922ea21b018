"""Parse OpenAI `/v1/chat/completions` and `/v1/completions` bodies into GenerationRequest.

Validation is the request models' (`models.py`: fields, types, ranges, wording); a failure
becomes the one OpenAI-shaped 400 (`explain.py`). A field this server neither honours nor
lists as a harmless pass-through is a 400 naming it: silently ignored, it would change the
output unnoticed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.errors import bad_request
from kvrelay.pipeline.openai.explain import explain
from kvrelay.pipeline.openai.models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Request,
)
from kvrelay.pipeline.openai.tools import ToolCalling


class Api(enum.StrEnum):
    """Which OpenAI API a request came in by (`GenerationRequest.api`; the attach options)."""

    CHAT = "chat"  # /v1/chat/completions
    COMPLETION = "completion"  # /v1/completions
    RESPONSES = "responses"  # /v1/responses


@dataclass(slots=True)
class GenerationRequest:
    """A validated request, before tokenization."""

    api: Api | str
    model: str
    sampling: SamplingParams  # max_tokens None: fill from the context left
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    echo: bool = False  # completions: the text starts with the prompt
    user: str | None = None
    cache_salt: str = ""
    # the session whose pages the store retains (prompt_cache_key, else user; a Responses
    # chain), and the retention asked for (prompt_cache_retention; None: the ingress default)
    cache_session: str | None = None
    cache_retention: str | int | None = None
    priority: int | None = None  # None: the caller's default (its API key's)
    max_tokens_param: str = "max_tokens"  # the field the client set, for errors about it
    # the SamplingParams fields the body set; the others take the served model's defaults
    fields_set: frozenset[str] = frozenset()
    tools: list[dict[str, Any]] | None = None  # chat: for the chat template
    tool_calling: ToolCalling | None = None  # chat: the output is tool calls (tools.py)
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # completions: choices generated per prompt (None: n)
    # completions with several prompts: all of them (prompt / prompt_token_ids hold the first)
    prompts: list[str | list[int]] | None = None

    @property
    def per_prompt(self) -> int:
        """Choices generated for each prompt."""
        return self.best_of or self.n

    @property
    def num_choices(self) -> int:
        """Generations the request fans out into (1: none, the request is its one choice)."""
        return len(self.prompts or [None]) * self.per_prompt


def _validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise explain(exc, model) from None


def _request(req: _Request, api: Api) -> GenerationRequest:
    """The fields both endpoints share, as a GenerationRequest (the prompt not yet set)."""
    sampling, fields_set = req.to_sampling_params()
    options = req.stream_options
    return GenerationRequest(
        api=api,
        model=req.model,
        sampling=sampling,
        stream=bool(req.stream),
        include_usage=bool(options and options.include_usage),
        user=req.user,
        cache_salt=req.cache_salt or "",
        cache_session=req.prompt_cache_key or req.user,
        cache_retention=req.prompt_cache_retention,
        priority=req.priority,
        max_tokens_param=req.max_tokens_given()[1],
        fields_set=fields_set,
        n=req.n or 1,
    )


def _message(msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    clean: dict[str, Any] = {"role": msg.role, "content": content or ""}
    if msg.name is not None:
        clean["name"] = msg.name
    if msg.tool_calls and msg.role == "assistant":
        clean["tool_calls"] = [call.to_dict() for call in msg.tool_calls]
    if msg.tool_call_id is not None and msg.role == "tool":
        clean["tool_call_id"] = msg.tool_call_id
    return clean


def parse_chat(body: Any) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    chat: ChatCompletionRequest = _validated(ChatCompletionRequest, body)
    req = _request(chat, Api.CHAT)
    req.messages = [_message(msg) for msg in chat.messages]
    req.logprobs = bool(chat.logprobs)
    if chat.tools:
        req.tools = [tool.to_dict() for tool in chat.tools]
        req.tool_calling = chat.tool_calling()
    return req


def parse_completion(body: Any) -> GenerationRequest:
    """Validate a /v1/completions body (a prompt, text or token ids, or a list of them)."""
    completion: CompletionRequest = _validated(CompletionRequest, body)
    req = _request(completion, Api.COMPLETION)
    prompt = completion.prompt  # a batch of one is already unwrapped by the model
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        req.prompts = [p if isinstance(p, str) else list(p) for p in prompt]
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    else:  # token ids (a batch's first prompt is text or token ids too)
        req.prompt_token_ids = list(cast("list[int]", prompt))
    req.logprobs = completion.logprobs is not None
    req.echo = bool(completion.echo)
    req.best_of = completion.best_of if (completion.best_of or 1) > req.n else None
    return req
