"""Sending one Responses API answer to its HTTP client: typed SSE events or the response object.

Lifecycle: reply starts -> [opening events] -> chunks read from out:{id} (XREAD BLOCK) from
token 0 -> one delta event per chunk with text -> final chunk -> the final response object,
stored (`store: true`) -> closing events, or the whole object. The chunks are always read from
the start (the final object holds the whole text); a client that reattaches with
Last-Event-ID gets the deltas after that token, with the sequence numbers of the first reply.
A client that goes away has its request cancelled after the disconnect grace, as on the
completion endpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.responses import Response
from starlette.types import Send

from kvrelay.core.enums import FinishReason
from kvrelay.pipeline.errors import error_body
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.response_builder import ResponseBuilder
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
from kvrelay.pipeline.server.output import output_expired
from kvrelay.pipeline.server.response_store import ResponseStore

if TYPE_CHECKING:
    from kvrelay.pipeline.server.app import Ingress

logger = logging.getLogger(__name__)

_QUEUE_LOST = "the request queue (Redis) is unavailable"


@dataclass(slots=True)
class ResponseJob:
    """Delivers one response from `out:{request_id}` to one HTTP client."""

    ingress: Ingress
    builder: ResponseBuilder
    stream: bool
    store: ResponseStore | None  # None: `store: false`, nothing is kept
    messages: list[dict[str, Any]]  # the conversation stored with the answer
    key_id: str
    deadline: float | None = None
    last_event_id: int | None = None  # a reattached stream: only the deltas after this token
    timer: RequestTimer | None = None  # None on a reattach: the first reader measures
    attach_seq: int = 0
    server_ended: bool = False  # the ingress ended the reply (Redis lost): no cancel
    slot: Slot | None = None

    @property
    def request_id(self) -> str:
        return self.builder.request_id

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

    def _chunks(self):
        ing = self.ingress
        return read_chunks(
            ing.redis,
            ing.keys,
            self.request_id,
            block_ms=ing.config.read_block_ms,
            deadline=self.deadline,
        )

    async def _stream(self, send: Send) -> None:
        await send(sse_start(self._headers))
        async for event in self._events():
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events(self) -> AsyncIterator[bytes]:
        builder, last = self.builder, self.last_event_id
        for event in builder.opening():  # made either way: they take their sequence numbers
            if last is None:
                yield event
        result = Completion(self.request_id)
        try:
            async for chunk in self._chunks():
                self._count(chunk)
                result.add(chunk)
                event = builder.delta(chunk)
                if event is not None and (last is None or chunk.index > last):
                    yield event
        except OutputTimeout:
            await self._deadline_passed(result)
        except RedisError as exc:
            self.server_ended = True
            logger.error("request %s: lost the output stream: %s", self.request_id, exc)
            yield builder.error_event(_QUEUE_LOST, "queue_unavailable")
            return
        except OutputExpired:
            err = output_expired(self.request_id)
            yield builder.error_event(err.message, err.code)
            return
        except RequestNotFound:
            yield builder.error_event(_not_found(self.request_id), "request_not_found")
            return
        for event in builder.closing(await self._finish(result)):
            yield event

    async def _whole(self, send: Send) -> None:
        result = Completion(self.request_id)
        try:
            async for chunk in self._chunks():
                self._count(chunk)
                result.add(chunk)
        except OutputTimeout:
            await self._deadline_passed(result)
        except RedisError as exc:
            self.server_ended = True
            logger.error("request %s: lost the output stream: %s", self.request_id, exc)
            body = error_body(_QUEUE_LOST, "service_unavailable", None, "queue_unavailable")
            await send_json(send, 503, body, self._headers)
            return
        except OutputExpired:
            err = output_expired(self.request_id)
            await send_json(send, err.status, err.body(), self._headers)
            return
        except RequestNotFound:
            body = error_body(_not_found(self.request_id), code="request_not_found")
            await send_json(send, 404, body, self._headers)
            return
        final = await self._finish(result)
        # the errors the completion endpoints answer with (the stored object says "failed")
        if result.finish_reason == FinishReason.TIMEOUT:
            body = error_body(DEADLINE_PASSED, "timeout", None, "request_timeout")
            await send_json(send, 504, body, self._headers)
        elif result.finish_reason == FinishReason.ERROR:
            message = result.error or "generation failed"
            body = error_body(message, "server_error", None, "generation_failed")
            await send_json(send, 500, body, self._headers)
        else:
            await send_json(send, 200, final, self._headers)

    def _count(self, chunk) -> None:
        if self.timer:
            self.timer.tokens(len(chunk.token_ids), time.monotonic())

    async def _finish(self, result: Completion) -> dict[str, Any]:
        """The final response object, stored when asked (a Redis error only costs the copy)."""
        if self.timer:  # counted once: a deadline the ingress ended is counted already
            reason = result.finish_reason or FinishReason.STOP
            self.timer.finish(reason, result.usage, time.monotonic())
            self.ingress.observe_queue_time(self.request_id, self.timer.model)
        final = self.builder.final(result)
        if self.store is not None:
            try:
                await self.store.save(final, self.messages, self.request_id, self.key_id)
            except RedisError as exc:
                logger.error("request %s: cannot store the response: %s", self.request_id, exc)
        return final

    async def _deadline_passed(self, result: Completion) -> None:
        """The reply ends at the deadline (a failed response); the workers are told to stop."""
        result.finish_reason, result.error = FinishReason.TIMEOUT, DEADLINE_PASSED
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
            if timer:
                timer.finish(FinishReason.CANCELLED, None, time.monotonic())

        await self.ingress.client_gone(self.request_id, self.attach_seq, cancelled)


def _not_found(request_id: str) -> str:
    return f"request {request_id} is unknown or expired"
