"""ASGI middleware: an X-Request-Id on every response, 500s in the OpenAI shape, error counts.

A response that names no request gets the client's X-Request-Id (when valid) or a fresh
`req-…` id. A request refused for an invalid id (header or path) gets no id at all: it never
existed, so no id would mean anything. Errors from the completion endpoints are counted in
`kvrelay:requests_rejected_total{status}`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.queue.submit import new_request_id, valid_request_id
from kvrelay.pipeline.server.http import error_response

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
