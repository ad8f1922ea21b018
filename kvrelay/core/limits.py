"""The one token-id check and the one context-length check, shared by the edge and the engine."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any


def bad_token_id(ids: Iterable[Any], vocab_size: int) -> tuple[bool, Any]:
    """(True, the first id that is no integer in [0, vocab_size)) or (False, None)."""
    for t in ids:
        try:
            v = operator.index(t)  # ints and numpy integers; not floats, strings or bools
        except TypeError:
            return True, t
        if isinstance(t, bool) or not 0 <= v < vocab_size:
            return True, t
    return False, None


def token_id_message(bad: Any, vocab_size: int) -> str:
    return f"token id {bad!r} is outside the vocabulary (size {vocab_size})"


def context_overflow(
    limit: int, prompt_tokens: int, completion_tokens: int | None, what: str = "prompt"
) -> str | None:
    """The message when prompt + completion tokens exceed the context `limit`, else None.

    `completion_tokens` None: no completion size was requested, so the prompt alone is
    checked (it must leave room for one token) and worded as vLLM words it.
    """
    if completion_tokens is None:
        if prompt_tokens < limit:
            return None
        return (
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the {what}."
        )
    total = prompt_tokens + completion_tokens
    if total <= limit:
        return None
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{total} tokens ({prompt_tokens} in the {what}, {completion_tokens} in the "
        f"completion). Please reduce the length of the {what} or completion."
    )
