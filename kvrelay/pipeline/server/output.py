"""Sending one request's output to its HTTP client: SSE events or one aggregated body.

Lifecycle: reply starts -> chunks read from out:{id} (XREAD BLOCK) -> events / aggregation ->
final chunk -> [usage] -> [DONE]. A client that goes away has its request cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError
from starlette.responses import Response
from starlette.types import Send

from kvrelay.core.enums import FinishReason
from kvrelay.pipeline.errors import RequestError, error_body
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.responses import DONE, ResponseFormatter
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.output import (
    DEADLINE_PASSED,
    Completion,
    OutputExpired,
    OutputTimeout,
    RequestNotFound,
    read_chunks,
)
from kvrelay.pipeline.server.http import REQUEST_ID_HEADER, WatchedResponse, send_json, sse_start

if TYPE_CHECKING:
    from kvrelay.pipeline.server.app import Ingress

logger = logging.getLogger(__name__)


def _error(message: str, type_: str, code: str) -> dict:
    return error_body(message, type_, None, code)


def output_expired(request_id: str) -> RequestError:
    """410: the request ended and its output stream expired (its state record remains)."""
    return RequestError(
        f"request {request_id} has ended and its output has expired; its state is still at "
        f"GET /v1/requests/{request_id}",
        410,
        code="output_expired",
    )


@dataclass(slots=True)
class OutputJob:
    """Delivers `out:{request_id}` from token `start_index` on to one HTTP client."""

    ingress: Ingress
    request_id: str
    fmt: ResponseFormatter
    stream: bool
    deadline: float | None = None
    start_index: int = 0
    timer: RequestTimer | None = None  # None on a reattach: the first reader measures
    send_role: bool = True
    attach_seq: int = 0  # which attach of this request this reader is (disconnect grace)
    # Set when the ingress itself ends the response (Redis lost): a client that then hangs up
    # did not abandon the request, so it is not cancelled; it can reattach by its id.
    server_ended: bool = False
    slot: Slot | None = None  # this request's in-flight place, given back when the reply ends

    def response(self) -> Response:
        produce = self._stream if self.stream else self._whole
        return WatchedResponse(produce, self._disconnected, self._closed)

    def _closed(self) -> None:
        if self.slot is not None:
            self.slot.release()
        if self.timer:
            self.timer.close()

    @property
    def _headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.request_id}

    @property
    def _read_from(self) -> int:
        # tool calls are found in the whole text: a resumed stream replays the chunks before
        # start_index through the parser, sending none of their events (_events)
        return 0 if self.fmt.tool_calls is not None else self.start_index

    def _chunks(self):
        # The reply ends at the deadline itself (the 504 is due then): a worker's own timeout
        # chunk that lands later would say the same thing, and the reader cancels the request.
        return read_chunks(
            self.ingress.redis,
            self.ingress.keys,
            self.request_id,
            start_index=self._read_from,
            block_ms=self.ingress.config.read_block_ms,
            deadline=self.deadline,
        )

    async def _events(self) -> AsyncIterator[bytes]:
        fmt, timer = self.fmt, self.timer
        if self.send_role and self.start_index == 0 and fmt.api == "chat":
            yield fmt.role_event()
        try:
            async for chunk in self._chunks():
                now = time.monotonic()
                if timer:
                    timer.tokens(len(chunk.token_ids), now)
                # a resumed client already has every chunk before start_index
                if chunk.index >= self.start_index or chunk.token_ids:
                    event = fmt.chunk_event(chunk)
                    replayed = chunk.index < self.start_index  # only when _read_from is 0
                    if event and not replayed:
                        yield event
                if chunk.finished:
                    if chunk.finish_reason == FinishReason.ERROR:
                        yield fmt.error_event(
                            chunk.error or "generation failed", code="generation_failed"
                        )
                    elif chunk.finish_reason == "timeout":  # the worker ended it at the deadline
                        yield fmt.error_event(DEADLINE_PASSED, "timeout", "request_timeout")
                    if fmt.include_usage:
                        yield fmt.usage_event(chunk.usage)
                    if timer:
                        timer.finish(chunk.finish_reason or FinishReason.STOP, chunk.usage, now)
                        self.ingress.observe_queue_time(self.request_id, timer.model)
        except OutputTimeout:
            await self._deadline_passed()
            yield fmt.error_event(DEADLINE_PASSED, "timeout", "request_timeout")
        except RedisError as exc:
            self.server_ended = True
            logger.error("request %s: lost the output stream: %s", self.request_id, exc)
            yield fmt.error_event(
                "the request queue (Redis) is unavailable",
                "service_unavailable",
                "queue_unavailable",
            )
        except OutputExpired:
            err = output_expired(self.request_id)
            yield fmt.error_event(err.message, err.type, err.code)
        except RequestNotFound:
            yield fmt.error_event(
                f"request {self.request_id} is unknown or expired",
                "invalid_request_error",
                "request_not_found",
            )
        yield DONE

    async def _stream(self, send: Send) -> None:
        await send(sse_start(self._headers))
        async for event in self._events():
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _whole(self, send: Send) -> None:
        result, timer = Completion(self.request_id), self.timer
        try:
            async for chunk in self._chunks():
                if timer:
                    timer.tokens(len(chunk.token_ids), time.monotonic())
                result.add(chunk)
        except OutputTimeout:
            await self._deadline_passed()
            body = _error(DEADLINE_PASSED, "timeout", "request_timeout")
            await send_json(send, 504, body, self._headers)
            return
        except RedisError as exc:
            self.server_ended = True
            logger.error("request %s: lost the output stream: %s", self.request_id, exc)
            body = _error(
                "the request queue (Redis) is unavailable",
                "service_unavailable",
                "queue_unavailable",
            )
            await send_json(send, 503, body, self._headers)
            return
        except OutputExpired:
            err = output_expired(self.request_id)
            await send_json(send, err.status, err.body(), self._headers)
            return
        except RequestNotFound:
            body = _error(
                f"request {self.request_id} is unknown or expired",
                "invalid_request_error",
                "request_not_found",
            )
            await send_json(send, 404, body, self._headers)
            return
        if timer:
            timer.finish(result.finish_reason or FinishReason.STOP, result.usage, time.monotonic())
            self.ingress.observe_queue_time(self.request_id, timer.model)
        if result.finish_reason == "timeout":  # as the SSE error event and the record say
            body = _error(DEADLINE_PASSED, "timeout", "request_timeout")
            await send_json(send, 504, body, self._headers)
            return
        if result.finish_reason == FinishReason.ERROR:
            body = _error(result.error or "generation failed", "server_error", "generation_failed")
            await send_json(send, 500, body, self._headers)
            return
        await send_json(send, 200, self.fmt.response(result), self._headers)

    async def _deadline_passed(self) -> None:
        """The reply ends at the deadline: stop the workers (they record it as a timeout, the
        flag coming after the deadline) and count it as one, streaming or not."""
        if self.timer:
            self.timer.finish(FinishReason.TIMEOUT, None, time.monotonic())
        await self.ingress.try_cancel(self.request_id)

    async def _disconnected(self) -> None:
        logger.info("request %s: client disconnected", self.request_id)
        timer = self.timer
        if timer:
            timer.close()
        if self.server_ended:
            return

        def cancelled() -> None:
            if timer:  # counted once the cancel flag is set (after the grace period, if any)
                timer.finish(FinishReason.CANCELLED, None, time.monotonic())

        await self.ingress.client_gone(self.request_id, self.attach_seq, cancelled)
