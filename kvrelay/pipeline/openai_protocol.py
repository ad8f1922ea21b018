"""Parse and validate OpenAI `/v1/chat/completions` and `/v1/completions` bodies (strict types).

Unknown fields are ignored (clients send extras), but a known field of the wrong type or a
value this server does not implement (n > 1, tools, echo, ...) is a 400 naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvrelay.pipeline.errors import RequestError, bad_request, unsupported
from kvrelay.pipeline.sampling import SamplingParams

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


def _type_error(name: str, expected: str) -> RequestError:
    return bad_request(f"'{name}' must be {expected}", param=name, code="invalid_type")


def _get(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """Field `name` checked against kind: bool, int, number, str, dict, list."""
    value = body.get(name)
    if value is None:
        return default
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value),
        "str": isinstance(value, str),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        expected = {
            "bool": "a boolean",
            "int": "an integer",
            "number": "a number",
            "str": "a string",
            "dict": "an object",
            "list": "an array",
        }[kind]
        raise _type_error(name, expected)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _type_error("stop", "a string or an array of strings")


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return list(value)
    return None


def _sampling(body: dict) -> SamplingParams:
    p = SamplingParams(max_tokens=None)
    p.temperature = float(_get(body, "temperature", "number", 1.0))
    p.top_p = float(_get(body, "top_p", "number", 1.0))
    p.top_k = _get(body, "top_k", "int", 0)
    p.min_p = float(_get(body, "min_p", "number", 0.0))
    p.presence_penalty = float(_get(body, "presence_penalty", "number", 0.0))
    p.frequency_penalty = float(_get(body, "frequency_penalty", "number", 0.0))
    p.repetition_penalty = float(_get(body, "repetition_penalty", "number", 1.0))
    p.seed = _get(body, "seed", "int")
    p.stop = _stop(body)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_ids(stop_ids)
        if ids is None:
            raise _type_error("stop_token_ids", "an array of integers")
        p.stop_token_ids = ids
    p.min_tokens = _get(body, "min_tokens", "int", 0)
    p.ignore_eos = _get(body, "ignore_eos", "bool", False)
    p.skip_special_tokens = _get(body, "skip_special_tokens", "bool", True)
    p.include_stop_str_in_output = _get(body, "include_stop_str_in_output", "bool", False)
    return p


def _common(body: dict, api: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    model = _get(body, "model", "str")
    if not model:
        raise bad_request(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    n = _get(body, "n", "int", 1)
    if n != 1:
        raise unsupported("n", f"n={n} (only n=1)")
    if _get(body, "logit_bias", "dict"):
        raise unsupported("logit_bias", "logit_bias")
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "dict")
    if options is not None and not stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    include_usage = _get(options or {}, "include_usage", "bool", False)
    sampling = _sampling(body)
    max_tokens = _get(body, "max_tokens", "int")
    if api == CHAT:
        max_tokens = _get(body, "max_completion_tokens", "int", max_tokens)
    sampling.max_tokens = max_tokens
    user = _get(body, "user", "str")
    salt = _get(body, "cache_salt", "str", "")
    return GenerationRequest(
        api=api,
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=user,
        cache_salt=salt,
    )


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise unsupported(f"messages[{index}].content", "content parts other than text")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{index}].content", "a string or an array of text parts")


def _messages(body: dict) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        raise bad_request(
            "'messages' is a required property", param="messages", code="missing_required_parameter"
        )
    if not isinstance(raw, list) or not raw:
        raise _type_error("messages", "a non-empty array")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise _type_error(f"messages[{i}]", "an object")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        if msg.get("tool_calls"):
            raise unsupported(f"messages[{i}].tool_calls", "tool calls")
        content = msg.get("content")
        clean: dict[str, Any] = {
            "role": role,
            "content": "" if content is None else _content_text(content, i),
        }
        if isinstance(msg.get("name"), str):
            clean["name"] = msg["name"]
        out.append(clean)
    return out


def parse_chat(body: Any) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    req = _common(body, CHAT)
    req.messages = _messages(body)
    if _get(body, "tools", "list"):
        raise unsupported("tools", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise unsupported("tool_choice", f"tool_choice={choice!r}")
    fmt = _get(body, "response_format", "dict")
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported("response_format", f"response_format type {fmt.get('type')!r}")
    req.logprobs = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int")
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
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif (ids := _token_ids(prompt)) is not None and ids:
        req.prompt_token_ids = ids
    elif prompt is None:
        raise bad_request(
            "'prompt' is a required property", param="prompt", code="missing_required_parameter"
        )
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", "more than one prompt per request")
    else:
        raise _type_error("prompt", "a string or an array of token ids")
    if _get(body, "echo", "bool", False):
        raise unsupported("echo", "echo")
    if _get(body, "best_of", "int", 1) != 1:
        raise unsupported("best_of", "best_of > 1")
    if _get(body, "suffix", "str"):
        raise unsupported("suffix", "suffix")
    logprobs = _get(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs"
        )
    req.logprobs = logprobs is not None
    req.sampling.logprobs = logprobs
    return req
