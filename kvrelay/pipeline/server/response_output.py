"""Sending one Responses API answer to its HTTP client: typed SSE events or the response object.

Lifecycle: reply starts -> [opening events] -> chunks from the output feed (queue/feed.py) from
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
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from starlette.types import Send

from kvrelay.core.enums import FinishReason
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.response_builder import ResponseBuilder
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.output import (
    DEADLINE_PASSED,
    Completion,
    OutputTimeout,
)
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.context import OutputHost
from kvrelay.pipeline.server.http import send_json
from kvrelay.pipeline.server.output import READ_FAILURES, Delivery, finish_failure, read_failure
from kvrelay.pipeline.server.response_store import ResponseStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ResponseJob(Delivery):
    """Delivers one response from `out:{request_id}` to one HTTP client."""

    ingress: OutputHost
    builder: ResponseBuilder
    stream: bool
    store: ResponseStore | None  # None: `store: false`, nothing is kept
    messages: list[dict[str, Any]]  # the conversation stored with the answer
    key_id: str
    deadline: float | None = None
    last_event_id: int | None = None  # a reattached stream: only the deltas after this token
    timer: RequestTimer | None = None
    attach_seq: int = 0
    server_ended: bool = False
    slot: Slot | None = None
    subscriptions: list[Subscription] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.builder.request_id

    def _chunks(self):
        if self.subscriptions:
            return self.subscriptions[0].chunks(deadline=self.deadline, submitted=True)
        return self.ingress.feed.chunks(self.request_id, deadline=self.deadline)

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
                delta = builder.delta(chunk)
                if delta is not None and (last is None or chunk.index > last):
                    yield delta
        except OutputTimeout:  # a failed response, closed as any other
            await self._deadline_passed(result)
        except READ_FAILURES as exc:
            err = self._read_failed(exc)
            yield builder.error_event(err.message, err.code)
            return
        for event in builder.closing(await self._finish(result)):
            yield event

    async def _whole(self, send: Send) -> None:
        result = Completion(self.request_id)
        try:
            async for chunk in self._chunks():
                self._count(chunk)
                result.add(chunk)
        except OutputTimeout:  # a failed response, answered as the worker's timeout
            await self._deadline_passed(result)
        except READ_FAILURES as exc:
            err = self._read_failed(exc)
            await send_json(send, err.status, err.body(), self._headers)
            return
        final = await self._finish(result)
        # the errors the completion endpoints answer with (the stored object says "failed")
        failed = finish_failure(result.finish_reason, result.error)
        if failed is not None:
            await send_json(send, failed.status, failed.body(), self._headers)
        else:
            await send_json(send, 200, final, self._headers)

    def _read_failed(self, exc: BaseException) -> RequestError:
        """Redis lost, the output expired or the request unknown: the client's error."""
        if isinstance(exc, RedisError):
            self._lost(exc)
        return read_failure(exc, self.request_id)

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
