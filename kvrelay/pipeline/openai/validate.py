"""Field checks shared by the OpenAI request parsers: types, integer ranges, Unicode, content.

Every error names the field the client sent (`param`), and never echoes an invalid string:
a message holding a lone surrogate could not itself be encoded as UTF-8.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvrelay.core.sampling import INT64_MAX, INT64_MIN, encodes_utf8
from kvrelay.pipeline.errors import RequestError, bad_request, unsupported

_EXPECTED = {
    "bool": "a boolean",
    "int": "an integer",
    "number": "a number",
    "str": "a string",
    "dict": "an object",
    "list": "an array",
}


def type_error(name: str, expected: str) -> RequestError:
    return bad_request(f"'{name}' must be {expected}", param=name, code="invalid_type")


def missing(name: str) -> RequestError:
    return bad_request(
        f"'{name}' is a required property", param=name, code="missing_required_parameter"
    )


def check_int64(value: int, name: str) -> int:
    """Integers travel as MessagePack int64: refuse what does not fit (never echo a huge value)."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise bad_request(
            f"'{name}' must be an integer between {INT64_MIN} and {INT64_MAX}", param=name
        )
    return value


def get_field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """Field `name` checked against kind: bool, int, number, str, dict, list (null: default)."""
    value = body.get(name)
    if value is None:
        return default
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "bool": isinstance(value, bool),
        "int": is_int,
        "number": is_int or (isinstance(value, float) and math.isfinite(value)),
        "str": isinstance(value, str),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        raise type_error(name, _EXPECTED[kind])
    if kind == "int":
        return check_int64(value, name)
    if kind == "number" and is_int and not INT64_MIN <= value <= INT64_MAX:
        # float() of a huge JSON integer raises OverflowError; no sane value is this big
        raise bad_request(f"'{name}' is out of range", param=name)
    return value


def int_list(value: Any, name: str) -> list[int] | None:
    """`value` as a list of int64 integers, or None when it is not a list of integers."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return None
    for i, t in enumerate(value):
        check_int64(t, f"{name}[{i}]")
    return list(value)


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def check_unicode(body: Any) -> None:
    """Refuse a body holding a string UTF-8 cannot encode (a lone surrogate like "\\ud83d")."""
    try:  # fast path: the whole body in one C call
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except (UnicodeEncodeError, ValueError, RecursionError):
        pass
    stack: list[tuple[str, Any]] = [("", body)]  # iterative: any nesting depth json.loads took
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and not encodes_utf8(value):
            raise bad_request(
                f"'{where}' is not valid Unicode: it holds a lone UTF-16 surrogate",
                param=where or None,
                code="invalid_value",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not encodes_utf8(key):
                    raise bad_request(
                        f"a field name in '{where or 'the body'}' holds a lone UTF-16 surrogate",
                        param=where or None,
                        code="invalid_value",
                    )
                stack.append((_path(where, key), item))
        elif isinstance(value, list):
            stack.extend((_path(where, i), item) for i, item in enumerate(value))


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise type_error(where, "an object")
    kind = part.get("type")
    if kind is None:
        raise missing(f"{where}.type")
    if not isinstance(kind, str):
        raise type_error(f"{where}.type", "a string")
    if kind != "text":
        raise unsupported(f"{where}.type", f"content part type {kind[:64]!r}")
    text = part.get("text")
    if text is None:
        raise missing(f"{where}.text")
    if not isinstance(text, str):
        raise type_error(f"{where}.text", "a string")
    return text


def content_text(msg: dict[str, Any], index: int, role: str) -> str:
    """A message's content as one string; only assistant messages may omit it (or send null)."""
    name = f"messages[{index}].content"
    content = msg.get("content")
    if content is None:
        if role == "assistant":
            return ""
        if "content" not in msg:
            raise missing(name)
        raise type_error(name, "a string or an array of text parts, not null")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(name, "a string or an array of text parts")
    return "".join(_part_text(part, f"{name}[{j}]") for j, part in enumerate(content))


# Fields honoured on both endpoints (OpenAI's plus the vLLM extensions we implement).
_COMMON = frozenset(
    [
        "model",
        "stream",
        "stream_options",
        "user",
        "n",
        "logit_bias",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "cache_salt",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
    ]
)
HONOURED = {
    "chat": _COMMON
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
    | {"response_format"},
    "completion": _COMMON | {"prompt", "echo", "best_of", "suffix"},
}
# Accepted and not acted on: they change nothing in the output (docs/api.md lists them).
PASS_THROUGH = {
    "chat": frozenset(
        [
            "metadata",
            "store",
            "service_tier",
            "safety_identifier",
            "prompt_cache_key",
            "parallel_tool_calls",
            "modalities",
        ]
    ),
    "completion": frozenset(["metadata", "service_tier", "safety_identifier", "prompt_cache_key"]),
}
# OpenAI fields we do not implement: named as unsupported rather than unknown.
_OPENAI_UNSUPPORTED = {
    "functions": "functions (legacy function calling)",
    "function_call": "function_call (legacy function calling)",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning_effort",
    "verbosity": "verbosity",
    "web_search_options": "web search",
}


def check_known_fields(body: dict[str, Any], api: str) -> None:
    """400 for a field this server neither honours nor may safely ignore (null means absent)."""
    honoured, passed = HONOURED[api], PASS_THROUGH[api]
    for name, value in body.items():
        if value is None or name in honoured:
            continue
        if name not in passed:
            if name in _OPENAI_UNSUPPORTED:
                raise unsupported(name, _OPENAI_UNSUPPORTED[name])
            raise bad_request(
                f"Unrecognized request argument supplied: {name[:64]} (this server does not "
                "implement it)",
                param=name[:256],
                code="unknown_parameter",
            )
        _check_pass_through(body, name, value)


def _check_pass_through(body: dict[str, Any], name: str, value: Any) -> None:
    """Pass-through fields are only harmless with values that ask for nothing we lack."""
    if name == "store" and get_field(body, name, "bool"):
        raise unsupported(name, "store=true (stored completions)")
    if name == "modalities" and value != ["text"]:
        raise unsupported(name, 'output modalities other than ["text"]')
    if name == "metadata":
        get_field(body, name, "dict")
    if name in ("service_tier", "safety_identifier", "prompt_cache_key"):
        get_field(body, name, "str")
    if name == "parallel_tool_calls":
        get_field(body, name, "bool")
