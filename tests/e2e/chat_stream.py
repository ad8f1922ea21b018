"""A streamed chat completion through the OpenAI client, as the fault tests read it: the
text, the finish reason, and a callback at each token (to kill something mid-stream)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import openai

from tests.e2e.stack import MODEL, Stack

LIGHTHOUSE = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def openai_client(stack: Stack) -> openai.OpenAI:
    """The stack's OpenAI client: no retries of its own, a long read timeout."""
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=180)


def stream_text(
    client: openai.OpenAI,
    request_id: str,
    on_token: Callable[[int], None] | None = None,
    *,
    sampling: dict,
    messages: list[dict] = LIGHTHOUSE,
) -> tuple[str, str | None]:
    """(text, finish reason) of one streamed chat request (ignore_eos) with these sampling
    fields; `on_token(n)` after the n-th token event."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
        **sampling,
    )
    text, reason, n = "", None, 0
    for event in stream:
        if event.choices:
            text += event.choices[0].delta.content or ""
            reason = event.choices[0].finish_reason or reason
            n += 1
            if on_token:
                on_token(n)
    return text, reason


def stream_killing(
    stream: Callable[..., tuple[str, str | None]],
    client: openai.OpenAI,
    stack: Stack,
    request_id: str,
    program: str,
    at: int = 8,
) -> tuple[list[tuple[str, str | None]], list[Exception], list[int]]:
    """`stream(client, request_id, on_token)` on a thread, SIGKILLing `program` at its `at`-th
    token: (the stream's result, if it ended; the API errors it raised; the killed pid)."""
    killed: list[int] = []

    def kill(n: int) -> None:
        if n == at and not killed:
            killed.append(stack.kill(program))

    results: list[tuple[str, str | None]] = []
    errors: list[Exception] = []

    def victim() -> None:
        try:
            results.append(stream(client, request_id, kill))
        except openai.APIError as exc:
            errors.append(exc)

    thread = threading.Thread(target=victim)
    thread.start()
    thread.join(180)
    return results, errors, killed
