"""Body-level checks run before the request models (the field set, Unicode) and the wording
of the common field errors (wrong type, absent, outside int64).

Every error names the field the client sent (`param`), and never echoes an invalid string:
a message holding a lone surrogate could not itself be encoded as UTF-8.
"""

from __future__ import annotations

import json
from typing import Any

from kvrelay.core.sampling import INT64_MAX, INT64_MIN, encodes_utf8
from kvrelay.pipeline.errors import RequestError, bad_request, unsupported


def type_error(name: str, expected: str) -> RequestError:
    return bad_request(f"'{name}' must be {expected}", param=name, code="invalid_type")


def missing(name: str) -> RequestError:
    return bad_request(
        f"'{name}' is a required property", param=name, code="missing_required_parameter"
    )


def outside_int64(name: str) -> RequestError:
    """Integers travel as MessagePack int64: what does not fit is refused (never echoed)."""
    return bad_request(
        f"'{name}' must be an integer between {INT64_MIN} and {INT64_MAX}", param=name
    )


def check_int64(value: int, name: str) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise outside_int64(name)
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


def check_cache_salt(body: dict[str, Any]) -> None:
    """Refuse an HTTP body's empty `cache_salt`, as vLLM does: it would isolate nothing (an
    empty salt shares pages with unsalted requests).

    HTTP only: the producer client's `cache_salt=""` is its way of saying "no salt".
    """
    if body.get("cache_salt") == "":
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
            code="invalid_value",
        )


# OpenAI (and vLLM) fields we do not implement: named as unsupported rather than unknown.
_OPENAI_UNSUPPORTED = {
    "functions": "functions (legacy function calling)",
    "function_call": "function_call (legacy function calling)",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning_effort",
    "verbosity": "verbosity",
    "web_search_options": "web search",
}


def check_known_fields(body: dict[str, Any], accepted: frozenset[str]) -> None:
    """400 for a field this server neither honours nor may safely ignore (null means absent)."""
    for name, value in body.items():
        if value is None or name in accepted:
            continue
        if name in _OPENAI_UNSUPPORTED:
            raise unsupported(name, _OPENAI_UNSUPPORTED[name])
        raise bad_request(
            f"Unrecognized request argument supplied: {name[:64]} (this server does not "
            "implement it)",
            param=name[:256],
            code="unknown_parameter",
        )
