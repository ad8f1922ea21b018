"""ASGI middleware: an X-Request-Id on every response, 500s in the OpenAI shape, error counts,
and a bound on how long a request body may stall.

A response that names no request gets the client's X-Request-Id (when valid) or a fresh
`req-…` id. A request refused for an invalid id (header or path) gets no id at all: it never
existed, so no id would mean anything. Errors from the completion endpoints are counted in
`kvrelay:requests_rejected_total{status}`. A body that sends nothing for `body_timeout_s`
gets a 408 and its connection closed (uvicorn has no body read timeout of its own).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.queue.submit import new_request_id, valid_request_id
from kvrelay.pipeline.server.http import BodyTimeout, error_response

if TYPE_CHECKING:
    from kvrelay.pipeline.metrics import Metrics

logger = logging.getLogger(__name__)

OMIT_REQUEST_ID = "omit_request_id"  # scope["state"] flag: this response carries no id
_HEADER = b"x-request-id"
_COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def omit_request_id(scope: Scope) -> None:
    """Mark this exchange's response as carrying no X-Request-Id (the id given is invalid)."""
    scope.setdefault("state", {})[OMIT_REQUEST_ID] = True


class RequestIdMiddleware:
    """Adds X-Request-Id where missing, answers unhandled errors with a 500, counts errors."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == _HEADER), None)
        given = raw.decode("latin-1") if raw is not None else None
        fallback: str | None = None
        if given is None:
            fallback = new_request_id("req")
        elif valid_request_id(given):
            fallback = given
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER]
                own = [v for k, v in message.get("headers", []) if k.lower() == _HEADER]
                omit = scope.get("state", {}).get(OMIT_REQUEST_ID)
                rid = own[0] if own else (fallback.encode() if fallback else None)
                if rid is not None and not omit:
                    headers.append((_HEADER, rid))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status:  # the response has started: nothing can be sent in its place
                raise
            logger.exception("unhandled error on %s", scope.get("path"), exc_info=exc)
            err = RequestError("internal server error", 500, type="server_error")
            await error_response(err)(scope, receive, send_with_id)
        finally:
            if status >= 400 and scope.get("path") in _COUNTED_PATHS:
                self.metrics.requests_rejected.labels(str(status)).inc()


class BodyTimeoutMiddleware:
    """Each read of a request body waits at most `timeout_s` for data (nginx's
    client_body_timeout: between two reads, not for the whole body); past it the read raises
    the 408 `BodyTimeout`, which the endpoint answers (else this middleware), with
    `Connection: close`. Reads after the body (waiting for a disconnect) are not bounded."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done, started = False, False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                logger.info(
                    "%s %s from %s: no request body data for %g s: 408",
                    scope.get("method"),
                    scope.get("path"),
                    scope.get("client"),
                    self.timeout_s,
                )
                raise BodyTimeout(self.timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except BodyTimeout as err:  # an endpoint that let it through
            if started:
                raise
            await error_response(err)(scope, receive, tracked_send)
