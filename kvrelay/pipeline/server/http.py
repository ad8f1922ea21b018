"""HTTP plumbing for the ingress: API keys, body limits, JSON parsing, error responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.server.api_keys import ANONYMOUS, ApiKeys, KeyPolicy

REQUEST_ID_HEADER = "X-Request-Id"


def error_response(err: RequestError, request_id: str | None = None) -> JSONResponse:
    """The OpenAI error body with the error's status and headers."""
    headers = dict(err.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def check_api_key(request: Request, keys: ApiKeys) -> KeyPolicy:
    """Require `Authorization: Bearer <key>` with one of `keys` (no-op when there are none).

    Returns the key's policy (`ANONYMOUS` without keys): requests remember who submitted them
    (`KeyPolicy.key_id`), and its tenant, priorities and quotas apply.
    """
    if not keys.required:
        return ANONYMOUS
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise RequestError(
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            401,
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    policy = keys.match(token.strip())
    if policy is None:
        raise RequestError(
            "Incorrect API key provided.",
            401,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return policy


def _too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body is larger than {limit} bytes", 413, code="request_too_large"
    )


class BodyTimeout(RequestError):
    """408: the request body stopped arriving; the connection is closed after the answer (the
    rest of the body may still come: it cannot be told apart from a next request)."""

    def __init__(self, timeout_s: float):
        super().__init__(
            f"the request body stopped arriving: no data for {timeout_s:g} s",
            408,
            code="request_body_timeout",
            headers={"Connection": "close"},
        )


def check_json_content_type(request: Request) -> None:
    """415 for a body declared as anything but JSON; a body declared as nothing is read as JSON.

    (`application/json` or a `+json` type, as FastAPI, and so vLLM, reads them.) curl's `-d`
    alone declares a form (`application/x-www-form-urlencoded`): refused, so that a body meant
    for another API is not silently read as this one's.
    """
    declared = request.headers.get("content-type", "")
    media = declared.partition(";")[0].strip().lower()
    if not media or media == "application/json":
        return
    kind, _, subtype = media.partition("/")
    if kind == "application" and subtype.endswith("+json"):
        return
    raise RequestError(
        f"Unsupported Content-Type {declared[:100]!r}: send the body as JSON, with "
        "'Content-Type: application/json'",
        415,
        param="Content-Type",
        code="unsupported_media_type",
    )


async def read_json(request: Request, limit: int) -> Any:
    """The JSON body, at most `limit` bytes (415 when declared as another type, 413 beyond the
    limit, 400 when it does not parse)."""
    check_json_content_type(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    if len(body) > THREAD_PARSE_BYTES:  # tens of milliseconds: let other requests run around it
        return await asyncio.to_thread(_loads, body)
    return _loads(body)


THREAD_PARSE_BYTES = 1 << 20


def _loads(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: recursion
        raise RequestError(
            f"We could not parse the JSON body of your request: {exc}", 400, code="invalid_json"
        ) from exc


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (after the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class WatchedResponse(Response):
    """Runs `produce(send)` while watching for a client disconnect, then calls `on_disconnect`.

    Starlette only notices a disconnect when a write fails, but a request waiting for its first
    token writes nothing; the worker must hear about it at once (cancel:{id}).
    """

    def __init__(
        self,
        produce: Callable[[Send], Awaitable[None]],
        on_disconnect: Callable[[], Awaitable[None]],
        on_close: Callable[[], None] | None = None,
    ):
        super().__init__()
        self.produce, self.on_disconnect, self.on_close = produce, on_disconnect, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._run(receive, send)
        finally:
            # here, not in produce(): a task cancelled before it started never runs its finally
            if self.on_close is not None:
                self.on_close()

    async def _run(self, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self.produce(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone = not work.done()
            if gone:
                work.cancel()
                work.add_done_callback(_retrieve)
                # The reader may take a while to wind down (seen under heavy load: a cancelled
                # redis-py read still closing its connection), but the client is gone either
                # way: tell the worker now rather than after the reader has finished.
                await asyncio.wait({work}, timeout=CANCEL_WAIT_S)
                await self.on_disconnect()
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if not gone:
            work.result()


CANCEL_WAIT_S = 0.5


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an error after the client left is not worth a warning


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str]) -> None:
    """Send a whole JSON response through raw ASGI `send`."""
    await JSONResponse(body, status_code=status, headers=headers)(
        {"type": "http"}, _no_receive, send
    )


async def _no_receive() -> dict:
    raise RuntimeError("receive is not available here")


def sse_start(headers: dict[str, str]) -> dict:
    """The http.response.start message of an SSE stream."""
    raw = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http.response.start", "status": 200, "headers": raw}
