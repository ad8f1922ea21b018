"""Parse and validate OpenAI `/v1/chat/completions` and `/v1/completions` bodies (strict types).

A field this server neither honours nor lists as a harmless pass-through is a 400 naming it
(a silently ignored field would change the output unnoticed), and so is a known field of the
wrong type or a value this server does not implement (n > 1, tools, echo, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.errors import bad_request, unsupported
from kvrelay.pipeline.openai.validate import (
    check_known_fields,
    check_unicode,
    content_text,
    get_field,
    int_list,
    missing,
    type_error,
)

CHAT, COMPLETION = "chat", "completion"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class GenerationRequest:
    """A validated request, before tokenization."""

    api: str  # chat | completion
    model: str
    sampling: SamplingParams  # max_tokens None: fill from the context left
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    cache_salt: str = ""
    max_tokens_param: str = "max_tokens"  # the field the client set, for errors about it


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise type_error("stop", "a string or an array of strings")


def _sampling(body: dict) -> SamplingParams:
    p = SamplingParams(max_tokens=None)
    p.temperature = float(get_field(body, "temperature", "number", 1.0))
    p.top_p = float(get_field(body, "top_p", "number", 1.0))
    p.top_k = get_field(body, "top_k", "int", 0)
    p.min_p = float(get_field(body, "min_p", "number", 0.0))
    p.presence_penalty = float(get_field(body, "presence_penalty", "number", 0.0))
    p.frequency_penalty = float(get_field(body, "frequency_penalty", "number", 0.0))
    p.repetition_penalty = float(get_field(body, "repetition_penalty", "number", 1.0))
    p.seed = get_field(body, "seed", "int")
    p.stop = _stop(body)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = int_list(stop_ids, "stop_token_ids")
        if ids is None:
            raise type_error("stop_token_ids", "an array of integers")
        p.stop_token_ids = ids
    p.min_tokens = get_field(body, "min_tokens", "int", 0)
    p.ignore_eos = get_field(body, "ignore_eos", "bool", False)
    p.skip_special_tokens = get_field(body, "skip_special_tokens", "bool", True)
    p.include_stop_str_in_output = get_field(body, "include_stop_str_in_output", "bool", False)
    return p


def _common(body: dict, api: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    check_unicode(body)  # msgpack, Redis and the tokenizer all need UTF-8: refuse it up front
    check_known_fields(body, api)
    model = get_field(body, "model", "str")
    if not model:
        raise bad_request(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    n = get_field(body, "n", "int", 1)
    if n != 1:
        raise unsupported("n", f"n={n} (only n=1)")
    if get_field(body, "logit_bias", "dict"):
        raise unsupported("logit_bias", "logit_bias")
    stream = get_field(body, "stream", "bool", False)
    options = get_field(body, "stream_options", "dict")
    if options is not None and not stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    include_usage = get_field(options or {}, "include_usage", "bool", False)
    sampling = _sampling(body)
    names = ("max_tokens", "max_completion_tokens") if api == CHAT else ("max_tokens",)
    max_tokens_param = "max_tokens"
    for name in names:  # the last one given wins: max_completion_tokens over max_tokens
        value = get_field(body, name, "int")
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"{name} must be at least 1, got {value}", param=name)
        sampling.max_tokens, max_tokens_param = value, name
    user = get_field(body, "user", "str")
    salt = get_field(body, "cache_salt", "str", "")
    return GenerationRequest(
        api=api,
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=user,
        cache_salt=salt,
        max_tokens_param=max_tokens_param,
    )


def _messages(body: dict) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list) or not raw:
        raise type_error("messages", "a non-empty array")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise type_error(f"messages[{i}]", "an object")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        if msg.get("tool_calls"):
            raise unsupported(f"messages[{i}].tool_calls", "tool calls")
        clean: dict[str, Any] = {"role": role, "content": content_text(msg, i, role)}
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise type_error(f"messages[{i}].name", "a string")
        if name is not None:
            clean["name"] = name
        out.append(clean)
    return out


def parse_chat(body: Any) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    req = _common(body, CHAT)
    req.messages = _messages(body)
    if get_field(body, "tools", "list"):
        raise unsupported("tools", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise unsupported("tool_choice", f"tool_choice={choice!r}")
    fmt = get_field(body, "response_format", "dict")
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported("response_format", f"response_format type {fmt.get('type')!r}")
    req.logprobs = get_field(body, "logprobs", "bool", False)
    top = get_field(body, "top_logprobs", "int")
    if top is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs"
            )
    req.sampling.logprobs = (top or 0) if req.logprobs else None
    return req


def parse_completion(body: Any) -> GenerationRequest:
    """Validate a /v1/completions body (one prompt: text or token ids)."""
    req = _common(body, COMPLETION)
    prompt, where = body.get("prompt"), "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt, where = prompt[0], "prompt[0]"  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif (ids := int_list(prompt, where)) is not None and ids:
        req.prompt_token_ids = ids
    elif prompt is None:
        raise missing("prompt")
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt", code="invalid_value")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", "more than one prompt per request")
    else:
        raise type_error("prompt", "a string or an array of token ids")
    if get_field(body, "echo", "bool", False):
        raise unsupported("echo", "echo")
    if get_field(body, "best_of", "int", 1) != 1:
        raise unsupported("best_of", "best_of > 1")
    if get_field(body, "suffix", "str"):
        raise unsupported("suffix", "suffix")
    logprobs = get_field(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs"
        )
    req.logprobs = logprobs is not None
    req.sampling.logprobs = logprobs
    return req
