"""Sending one request's output to its HTTP client: SSE events or one aggregated body.

Lifecycle: reply starts -> chunks from the ingress's output feed (queue/feed.py: a request
posted here was subscribed to before it was queued; any other attaches) -> events /
aggregation -> final chunk -> [usage] -> [DONE]. A client that goes away has its request
cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from redis.exceptions import RedisError
from starlette.responses import Response
from starlette.types import Send

from kvrelay.core.enums import FinishReason
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.completion_format import DONE, ResponseFormatter
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.output import (
    DEADLINE_PASSED,
    Completion,
    OutputExpired,
    OutputTimeout,
    RequestNotFound,
)
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.context import OutputHost
from kvrelay.pipeline.server.http import REQUEST_ID_HEADER, WatchedResponse, send_json, sse_start

logger = logging.getLogger(__name__)


def output_expired(request_id: str) -> RequestError:
    """410: the request ended and its output stream expired (its state record remains)."""
    return RequestError(
        f"request {request_id} has ended and its output has expired; its state is still at "
        f"GET /v1/requests/{request_id}",
        410,
        code="output_expired",
    )


# What can stop a reply before its final chunk: read_failure() says what the client gets.
READ_FAILURES = (OutputTimeout, RedisError, OutputExpired, RequestNotFound)


def read_failure(exc: BaseException, request_id: str) -> RequestError:
    """The error for an output that could not be read to its end (one of READ_FAILURES): the
    deadline passed (504), Redis is lost (503), the output expired (410), the request is
    unknown (404)."""
    if isinstance(exc, OutputTimeout):
        return RequestError(DEADLINE_PASSED, 504, type="timeout", code="request_timeout")
    if isinstance(exc, RedisError):
        return RequestError(
            "the request queue (Redis) is unavailable",
            503,
            type="service_unavailable",
            code="queue_unavailable",
        )
    if isinstance(exc, OutputExpired):
        return output_expired(request_id)
    return RequestError(
        f"request {request_id} is unknown or expired", 404, code="request_not_found"
    )


def finish_failure(reason: str | None, error: str | None) -> RequestError | None:
    """The error for a request its worker ended without an answer (timeout 504, error 500);
    None for every other finish."""
    if reason == FinishReason.TIMEOUT:
        return RequestError(DEADLINE_PASSED, 504, type="timeout", code="request_timeout")
    if reason == FinishReason.ERROR:
        message = error or "generation failed"
        return RequestError(message, 500, type="server_error", code="generation_failed")
    return None


def abandon(slot: Slot | None, subscription: Subscription | None) -> None:
    """A request that gets no output job: its in-flight slot and subscription given back."""
    if slot is not None:
        slot.release()
    if subscription is not None:
        subscription.close()


class Delivery:
    """What every reply to a request shares (OutputJob, the Responses API's and the several
    choices' jobs, dataclasses with these attributes): the response object, the end of the
    reply (its in-flight slot given back), the SSE framing and what a client that goes away
    does to its request."""

    __slots__ = ()
    ingress: OutputHost
    if TYPE_CHECKING:
        # a field of most jobs; the Responses API's job reads its builder's (a property)
        @property
        def request_id(self) -> str: ...
    else:
        request_id: str
    stream: bool
    timer: RequestTimer | None  # None on a reattach: the first reader measures
    attach_seq: int  # which attach of this request this reader is (disconnect grace)
    # Set when the ingress itself ends the response (Redis lost): a client that then hangs up
    # did not abandon the request, so it is not cancelled; it can reattach by its id.
    server_ended: bool
    slot: Slot | None  # this request's in-flight place, given back when the reply ends
    # made before the request was queued naming the feed (posted here); closed at the end
    subscriptions: list[Subscription]

    def response(self) -> Response:
        produce = self._stream if self.stream else self._whole
        return WatchedResponse(produce, self._disconnected, self._closed)

    def _events(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def _whole(self, send: Send) -> None:
        raise NotImplementedError

    def _closed(self) -> None:
        if self.slot is not None:
            self.slot.release()
        for subscription in self.subscriptions:
            subscription.close()
        if self.timer:
            self.timer.close()

    @property
    def _headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.request_id}

    async def _stream(self, send: Send) -> None:
        await send(sse_start(self._headers))
        async for event in self._events():
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _lost(self, exc: RedisError) -> None:
        """Redis is gone: the ingress ends the reply itself (no cancel when the client goes)."""
        # a dataclass job's slot (Delivery's own slots are empty: it only declares them)
        cast(Any, self).server_ended = True
        logger.error("request %s: lost the output stream: %s", self.request_id, exc)

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


@dataclass(slots=True)
class OutputJob(Delivery):
    """Delivers `out:{request_id}` from token `start_index` on to one HTTP client."""

    ingress: OutputHost
    request_id: str
    fmt: ResponseFormatter
    stream: bool
    deadline: float | None = None
    start_index: int = 0
    timer: RequestTimer | None = None
    send_role: bool = True
    attach_seq: int = 0
    server_ended: bool = False
    slot: Slot | None = None
    subscriptions: list[Subscription] = field(default_factory=list)
    # the text of token ids, for a chunk cut where it overlaps tokens already sent
    retext: Callable[[list[int]], str] | None = None

    @property
    def _read_from(self) -> int:
        # tool calls are found in the whole text: a resumed stream replays the chunks before
        # start_index through the parser, sending none of their events (_events)
        return 0 if self.fmt.tool_calls is not None else self.start_index

    def _chunks(self):
        # The reply ends at the deadline itself (the 504 is due then): a worker's own timeout
        # chunk that lands later would say the same thing, and the reader cancels the request.
        if self.subscriptions:
            return self.subscriptions[0].chunks(
                start_index=self._read_from,
                deadline=self.deadline,
                retext=self.retext,
                submitted=True,
            )
        return self.ingress.feed.chunks(
            self.request_id, start_index=self._read_from, deadline=self.deadline, retext=self.retext
        )

    async def _events(self) -> AsyncIterator[bytes]:
        fmt, timer = self.fmt, self.timer
        if self.send_role and self.start_index == 0 and fmt.api == Api.CHAT:
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
                    # failed, or the worker ended it at the deadline
                    failed = finish_failure(chunk.finish_reason, chunk.error)
                    if failed is not None:
                        yield fmt.error_event(failed.message, failed.type, failed.code)
                    if fmt.include_usage:
                        yield fmt.usage_event(chunk.usage)
                    if timer:
                        timer.finish(chunk.finish_reason or FinishReason.STOP, chunk.usage, now)
                        self.ingress.observe_queue_time(self.request_id, timer.model)
        except READ_FAILURES as exc:
            err = await self._read_failed(exc)
            yield fmt.error_event(err.message, err.type, err.code)
        yield DONE

    async def _whole(self, send: Send) -> None:
        result, timer = Completion(self.request_id), self.timer
        try:
            async for chunk in self._chunks():
                if timer:
                    timer.tokens(len(chunk.token_ids), time.monotonic())
                result.add(chunk)
        except READ_FAILURES as exc:
            err = await self._read_failed(exc)
            await send_json(send, err.status, err.body(), self._headers)
            return
        if timer:
            timer.finish(result.finish_reason or FinishReason.STOP, result.usage, time.monotonic())
            self.ingress.observe_queue_time(self.request_id, timer.model)
        # as the SSE error event and the record say
        failed = finish_failure(result.finish_reason, result.error)
        if failed is not None:
            await send_json(send, failed.status, failed.body(), self._headers)
            return
        await send_json(send, 200, self.fmt.response(result), self._headers)

    async def _read_failed(self, exc: BaseException) -> RequestError:
        """What ended the reading (READ_FAILURES), acted on: the client's error."""
        if isinstance(exc, OutputTimeout):
            await self._deadline_passed()
        elif isinstance(exc, RedisError):
            self._lost(exc)
        return read_failure(exc, self.request_id)

    async def _deadline_passed(self) -> None:
        """The reply ends at the deadline: stop the workers (they record it as a timeout, the
        flag coming after the deadline) and count it as one, streaming or not."""
        if self.timer:
            self.timer.finish(FinishReason.TIMEOUT, None, time.monotonic())
        await self.ingress.try_cancel(self.request_id)
