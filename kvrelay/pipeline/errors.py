"""Errors a request can get before and after it is queued, in the OpenAI error shape."""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.core.errors import KvrelayError

logger = logging.getLogger(__name__)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error body `{"error": {"message", "type", "param", "code"}}`: the one builder."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestError(KvrelayError):
    """A request the pipeline refuses; rendered by the ingress as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(message, 400, param=param, code=code)


def unsupported(param: str, what: str) -> RequestError:
    """A field whose value this server does not implement."""
    return RequestError(
        f"{what} is not supported by this server", 400, param=param, code="unsupported_value"
    )


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the answer


def client_closed_request() -> RequestError:
    """499: the client disconnected while sending its request (no one receives this answer)."""
    return RequestError(
        "the client closed the connection before sending the whole request body",
        CLIENT_CLOSED_REQUEST,
        code="client_closed_request",
    )


def model_not_found(model: str, served: list[str]) -> RequestError:
    return RequestError(
        f"The model `{model}` does not exist. Served models: {', '.join(served) or 'none'}.",
        404,
        param="model",
        code="model_not_found",
    )


def model_unavailable(model: str, retry_after_s: int) -> RequestError:
    """503: the model is served here, but none of its workers is live while others are."""
    return RequestError(
        f"The model `{model}` has no live worker: every worker serving it is stopped, "
        f"draining or restarting. Retry after {retry_after_s} s, or start one "
        f"(`kvrelay worker decode --model {model}`).",
        503,
        type="service_unavailable",
        param="model",
        code="model_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def overloaded(reason: str, retry_after_s: int) -> RequestError:
    return RequestError(
        f"The server is overloaded ({reason}); retry after {retry_after_s} s.",
        429,
        type="rate_limit_error",
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def queue_unavailable(exc: BaseException) -> RequestError:
    """503 queue_unavailable for a Redis failure (logged here, once for both API paths)."""
    logger.error("redis unavailable: %s", exc or type(exc).__name__)
    return RequestError(
        "the request queue (Redis) is unavailable",
        503,
        type="service_unavailable",
        code="queue_unavailable",
    )
