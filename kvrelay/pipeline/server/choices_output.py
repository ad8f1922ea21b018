"""Sending a request answered by several choices (n, best_of, a list of prompts) to its client.

Lifecycle: one reader task per choice follows its chunks (the output feed) -> chunks merged
in the order they arrive -> SSE events whose `choices[].index` tells the choices apart
(interleaved, as OpenAI sends them), or one body once every choice has finished (best_of: the
n with the highest cumulative logprob per prompt) -> [usage: completion tokens of every choice
generated summed (best_of's candidates too), each prompt counted once] -> [DONE]. A choice
that fails, the deadline or a lost Redis end the whole reply, and the other choices are
cancelled; a client that goes away has them all cancelled
(after the grace period). Events carry no `id:` line: token indices are per choice, so a
reattach replays from the start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from starlette.types import Send

from kvrelay.core.enums import FinishReason
from kvrelay.core.errors import KvrelayError
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.completion_format import DONE, ResponseFormatter, usage_dict
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.output import Completion, OutputTimeout
from kvrelay.pipeline.queue.submit import choice_id
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.context import OutputHost
from kvrelay.pipeline.server.http import send_json
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.output import READ_FAILURES, Delivery, finish_failure, read_failure

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    """One choice of the request: its own request id and formatter (which holds its index)."""

    request_id: str
    fmt: ResponseFormatter
    prompt: int  # the index of its prompt in the request


class _Ended(KvrelayError):
    """A choice ended the reply early (failed, or ended at the deadline)."""

    def __init__(self, chunk: TokenChunk):
        super().__init__(chunk.finish_reason)
        self.chunk = chunk


def _failure(exc: BaseException, request_id: str) -> RequestError:
    """The error for what ended a reply early."""
    if isinstance(exc, _Ended):  # raised for the finishes finish_failure answers
        failed = finish_failure(exc.chunk.finish_reason, exc.chunk.error)
        assert failed is not None
        return failed
    return read_failure(exc, request_id)


def _strip_id(event: bytes) -> bytes:
    """An SSE event without its `id:` line (a choice's token index, not the request's)."""
    if event.startswith(b"id: "):
        return event.split(b"\n", 1)[1]
    return event


@dataclass(slots=True)
class ChoicesJob(Delivery):
    """Delivers every choice of `request_id` to one HTTP client, from the start."""

    ingress: OutputHost
    request_id: str
    choices: list[Choice]  # prompt-major: choice i answers prompt i // per_prompt
    n: int  # choices returned per prompt (fewer than generated with best_of)
    stream: bool
    prompt_tokens: int  # of the whole request, each prompt counted once
    include_usage: bool = False
    deadline: float | None = None
    timer: RequestTimer | None = None
    attach_seq: int = 0
    server_ended: bool = False
    slot: Slot | None = None
    # one per choice, in order, when the choices were queued naming the feed (posted here)
    subscriptions: list[Subscription] = field(default_factory=list)

    def _chunks(self, i: int) -> AsyncIterator[TokenChunk]:
        if self.subscriptions:
            return self.subscriptions[i].chunks(deadline=self.deadline, submitted=True)
        return self.ingress.feed.chunks(self.choices[i].request_id, deadline=self.deadline)

    def _usage(
        self, kept: list[int], usages: list[dict[str, int] | None], counts: list[int]
    ) -> dict[str, Any]:
        """The request's usage from the choices returned (`kept`, with their usages and token
        counts): completion tokens summed; prompt tokens, and the cached ones (those the
        first choice returned for a prompt found), once per prompt."""
        cached, seen = 0, set()
        for i, usage in zip(kept, usages, strict=True):
            if self.choices[i].prompt not in seen:
                seen.add(self.choices[i].prompt)
                cached += int((usage or {}).get("cached_tokens", 0))
        completion = sum(
            int((usage or {}).get("completion_tokens", count))
            for usage, count in zip(usages, counts, strict=True)
        )
        usage = {"prompt_tokens": self.prompt_tokens, "cached_tokens": cached}
        return usage_dict({**usage, "completion_tokens": completion}, 0, 0)

    def _finished(self, reason: str, usage: dict[str, Any] | None) -> None:
        if self.timer:
            self.timer.finish(reason, usage, time.monotonic())
            self.ingress.observe_queue_time(self.choices[0].request_id, self.timer.model)

    async def _end_early(self, exc: BaseException) -> None:
        """What ended the reply before every choice finished: count it, stop the others."""
        if isinstance(exc, RedisError):
            self._lost(exc)
            return
        if isinstance(exc, OutputTimeout) or (
            isinstance(exc, _Ended) and exc.chunk.finish_reason == FinishReason.TIMEOUT
        ):
            self._finished(FinishReason.TIMEOUT, None)
        elif isinstance(exc, _Ended):
            self._finished(FinishReason.ERROR, None)
        await self.ingress.try_cancel(self.request_id)

    # streaming ----------------------------------------------------------------------------
    async def _read(self, i: int, queue: asyncio.Queue) -> None:
        try:
            async for chunk in self._chunks(i):
                await queue.put((i, chunk))
        except Exception as exc:  # handed to the merging loop, which ends the reply
            await queue.put((i, exc))

    async def _events(self) -> AsyncIterator[bytes]:
        if self.choices[0].fmt.api == Api.CHAT:
            for choice in self.choices:
                yield choice.fmt.role_event()
        queue: asyncio.Queue = asyncio.Queue()
        readers = [asyncio.create_task(self._read(i, queue)) for i in range(len(self.choices))]
        usages: list[dict[str, int] | None] = [None] * len(self.choices)
        left, first_reason = len(self.choices), None
        try:
            while left:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                chunk: TokenChunk = item
                if self.timer:
                    self.timer.tokens(len(chunk.token_ids), time.monotonic())
                event = self.choices[i].fmt.chunk_event(chunk)
                if event:
                    yield _strip_id(event)
                if chunk.finished:
                    if chunk.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                        raise _Ended(chunk)
                    usages[i], left = chunk.usage, left - 1
                    if i == 0:
                        first_reason = chunk.finish_reason
            counts = [c.fmt.completion_tokens for c in self.choices]
            usage = self._usage(list(range(len(self.choices))), usages, counts)
            if self.include_usage:
                yield self.choices[0].fmt.usage_event(usage)
            self._finished(first_reason or FinishReason.STOP, usage)
        except (_Ended, *READ_FAILURES) as exc:
            await self._end_early(exc)
            err = _failure(exc, self.request_id)
            yield ResponseFormatter.error_event(err.message, err.type, err.code)
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        yield DONE

    # one body -----------------------------------------------------------------------------
    async def _collect(self, i: int, result: Completion) -> None:
        async for chunk in self._chunks(i):
            if self.timer:
                self.timer.tokens(len(chunk.token_ids), time.monotonic())
            result.add(chunk)
            if chunk.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                raise _Ended(chunk)

    async def _whole(self, send: Send) -> None:
        results = [Completion(c.request_id) for c in self.choices]
        tasks = [asyncio.create_task(self._collect(i, r)) for i, r in enumerate(results)]
        try:
            await asyncio.gather(*tasks)
        except (_Ended, *READ_FAILURES) as exc:
            await self._end_early(exc)
            err = _failure(exc, self.request_id)
            await send_json(send, err.status, err.body(), self._headers)
            return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        kept = self._best(results)
        bodies = []
        for index, i in enumerate(kept):
            self.choices[i].fmt.index = index
            bodies.append(self.choices[i].fmt.response(results[i]))
        # every choice generated counts, best_of's discarded candidates too: as OpenAI bills
        # them, and as the usage counters count them (lua/usage.lua, per choice)
        usage = self._usage(
            list(range(len(results))),
            [r.usage for r in results],
            [len(r.token_ids) for r in results],
        )
        self._finished(results[0].finish_reason or FinishReason.STOP, usage)
        body = {key: bodies[0][key] for key in ("id", "object", "created", "model")}
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = usage
        if "prompt_logprobs" in bodies[0]:  # chat: the prompt's, at the top as vLLM puts it
            body["prompt_logprobs"] = bodies[0]["prompt_logprobs"]
        await send_json(send, 200, body, self._headers)

    def _best(self, results: list[Completion]) -> list[int]:
        """The choices returned, in order: all of them, or (best_of) per prompt the n with the
        highest cumulative logprob of their tokens, highest first (vLLM's order)."""
        per_prompt = len(self.choices) // (self.choices[-1].prompt + 1)
        if per_prompt == self.n:
            return list(range(len(self.choices)))
        kept: list[int] = []
        for start in range(0, len(self.choices), per_prompt):
            group = range(start, start + per_prompt)
            ranked = sorted(group, key=lambda i: -_cumulative_logprob(results[i]))
            kept += ranked[: self.n]
        return kept


def _cumulative_logprob(result: Completion) -> float:
    return sum(float(lp["logprob"]) for lp in result.logprobs or ())


def choices_job(
    ing: OutputHost,
    request_id: str,
    options: IngressOptions,
    model: str,
    prompt_tokens: int,
    stream: bool,
    include_usage: bool,
    *,
    deadline: float | None,
    token_text: Any,
    num_choices: int | None = None,
    created: int | None = None,
) -> ChoicesJob:
    """The output job of a request of several choices, from its ingress options."""
    per_prompt = options.per_prompt
    count = num_choices or per_prompt * max(1, len(options.echoes))
    choices = []
    for i in range(count):
        fmt = options.formatter(
            request_id,
            model,
            0,  # the usage is the request's, counted by the job
            token_text=token_text,
            include_usage=include_usage,
            created=options.created_at(created),
            index=i,
            # each choice's own calls, their ids derived from its id (distinct, stable)
            calls_id=choice_id(request_id, i),
        )
        choices.append(Choice(choice_id(request_id, i), fmt, i // per_prompt))
    return ChoicesJob(
        ing,
        request_id,
        choices,
        options.n,
        stream,
        prompt_tokens,
        include_usage=include_usage,
        deadline=deadline,
    )
