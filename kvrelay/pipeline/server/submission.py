"""The one path by which a POST becomes a queued request: chat and text completions, several
choices (n, best_of, a list of prompts) and the Responses API are thin adapters over it.

`Submission.post` runs an endpoint's `handle(submission, body)` between the steps every POST
shares and maps every failure to its OpenAI error, in this one place:

    X-Request-Id checked (400, no id sent back) or a new id -> the cluster snapshots fetched
    while we parse -> API key (401) -> body (413, 415, 400) -> handle: parse (off the event
    loop when big) -> `posted_before`: the id names an existing request? the same one is
    reattached (once a replica holds it, as a submission is acknowledged), another is a
    409 -> `admit`: in-flight slots (429) -> the endpoint builds its
    tasks and record -> `start`: `charge`, the key's quotas (429, queue/quota.py; a
    concurrency unit rides on the slot) -> `enqueue` (subscribed to the output first, then
    queued; 429 at `max_waiting`; the same id raced in from another connection: reattach) ->
    `queued` -> the output job takes the slot and subscriptions (`hand_over`).

A request error is its status and body; a Redis failure a 503 (queue_unavailable); a client
that hung up mid-body a 499. Whatever ends a submission before its job took them gives back
its in-flight slot and closes its subscriptions. Once a limited key's quota was checked, every
answer carries its x-ratelimit-* headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Send

from kvrelay.core.messages import PrefillTask
from kvrelay.core.record import RequestRecord
from kvrelay.core.usage import account as usage_account
from kvrelay.pipeline.errors import (
    RequestError,
    bad_request,
    client_closed_request,
    queue_unavailable,
)
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.quota import Limits, new_unit
from kvrelay.pipeline.queue.route import Route, RouteMode
from kvrelay.pipeline.queue.submit import Tenancy
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.api_keys import ANONYMOUS, KeyPolicy
from kvrelay.pipeline.server.attach import check_same, owned_record, raw_record
from kvrelay.pipeline.server.context import RequestHost
from kvrelay.pipeline.server.http import (
    REQUEST_ID_HEADER,
    THREAD_PARSE_BYTES,
    WatchedResponse,
    check_api_key,
    error_response,
    read_json,
)
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.middleware import omit_request_id

logger = logging.getLogger(__name__)

T = TypeVar("T")
Reattach = Callable[[dict[str, str]], Awaitable[Response]]  # an existing record -> its reply


@dataclass(slots=True)
class Submission:
    """One POST on its way to the queue: its id, the caller's key, and what it holds (an
    in-flight slot, output subscriptions) until its output job takes them."""

    ing: RequestHost
    request: Request
    request_id: str
    header_id: str | None  # the X-Request-Id the client sent (None: the id is new)
    arrival: float  # monotonic
    key_id: str = ""
    policy: KeyPolicy = ANONYMOUS  # the caller's key: tenant, priorities, quotas
    slot: Slot | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)  # once the quota was checked
    subscriptions: list[Subscription] = field(default_factory=list)

    @classmethod
    async def post(
        cls,
        ing: RequestHost,
        request: Request,
        *,
        new_id: Callable[[], str],
        bad_id: Callable[[str], RequestError | None],
        handle: Callable[[Submission, Any], Awaitable[Response]],
    ) -> Response:
        """`handle(submission, body)`'s reply, or the OpenAI error of what failed on the way.

        `new_id()`: a fresh request id; `bad_id(header)`: the 400 for an X-Request-Id this
        endpoint does not take (None: valid)."""
        arrival = time.monotonic()
        header_id = request.headers.get(REQUEST_ID_HEADER)
        if header_id is not None and (err := bad_id(header_id)) is not None:
            omit_request_id(request.scope)  # no request was created: send no id back
            return error_response(err)
        sub = cls(ing, request, header_id or new_id(), header_id, arrival)
        # the snapshots admission, the registry and routing read: fetch them while we parse
        ing.cluster.prefetch(workers=ing.config.mode == RouteMode.AUTO)
        try:
            sub.policy = check_api_key(request, ing.config.keys)
            sub.key_id = sub.policy.key_id
            body = await read_json(request, ing.config.max_body_bytes)
            response = await handle(sub, body)
        except RequestError as err:
            sub.abandon()
            response = error_response(err, sub.request_id)
        except RedisError as exc:
            sub.abandon()
            response = error_response(queue_unavailable(exc), sub.request_id)
        except ClientDisconnect:  # hung up mid-body: not a server error; counted as 499
            sub.abandon()
            logger.info("request %s: client disconnected while sending its body", sub.request_id)
            response = error_response(client_closed_request(), sub.request_id)
        except BaseException:
            sub.abandon()
            raise
        return _with_headers(response, sub.rate_headers)

    async def parse(self, body: Any, parse: Callable[[Any], T]) -> T:
        """`parse(body)`, on a worker thread when the body is big (off the event loop)."""
        size = self.request.headers.get("content-length", "")
        if size.isdigit() and int(size) > THREAD_PARSE_BYTES:
            return await asyncio.to_thread(parse, body)
        return parse(body)

    async def posted_before(self, digest: str, reattach: Reattach) -> Response | None:
        """With an X-Request-Id that names an existing request: the same request (same
        endpoint, digest and key) reattached, another a 409; None when the id is new."""
        if self.header_id is None:
            return None
        ing, request_id = self.ing, self.request_id
        # the lookup rides out a Redis restart as the submission does
        rec = await ing.producer.ride_out(request_id, lambda: raw_record(ing, request_id))
        if rec is None:
            return None
        check_same(rec, request_id, digest, self.key_id)
        # a retry after a 503 not_replicated submits nothing: acknowledged, as a submission
        # is, only once a replica holds the request (at once without replicas)
        await ing.producer.confirm_replicated(request_id)
        return await reattach(rec)

    def record(self, options: IngressOptions, user: str | None) -> dict[str, Any]:
        """The fields of the request's record this ingress writes: its delivery options, the
        caller's `user` and API key."""
        return RequestRecord(
            ingress=options.record(), user=user or "", key_id=self.key_id
        ).changes()

    def tenancy(self, asked: int | None) -> Tenancy:
        """The request's priority (`asked`, else its key's default; 400 outside the key's
        range; under the fcfs policy the producer refuses any but 0), tenant and weight."""
        policy, config = self.policy, self.ing.config
        priority = policy.priority if asked is None else asked
        if not policy.min_priority <= priority <= policy.max_priority:
            raise bad_request(
                f"priority must be within [{policy.min_priority}, {policy.max_priority}] for "
                f"this API key, got {priority}",
                param="priority",
            )
        return Tenancy(priority, policy.tenant, config.keys.weight(policy))

    async def admit(self, model: str, count: int = 1) -> None:
        """Take `count` in-flight slots (429 beyond the bound; the waiting bound is per
        model's pipeline)."""
        pipeline = self.ing.registry.known_pipeline(model)
        self.slot = await self.ing.backpressure.admit(count, pipeline)

    async def enqueue(
        self,
        tasks: list[PrefillTask],
        entry: ModelEntry,
        record: dict[str, Any],
        choice_record: dict[str, Any] | None = None,
    ) -> list[Route] | None:
        """Subscribe to each task's output, then queue them (one task: the request; several:
        its choices under the parent record, each with `choice_record`). None when the same
        id raced in from another connection (then `raced`)."""
        ing = self.ing
        # who its usage counts to (lua/usage.lua): the caller's key and tenant, the model named
        policy = self.policy
        account = usage_account(policy.name, policy.tenant, tasks[0].model)
        if choice_record is None:
            record = {**record, **RequestRecord(account=account).changes()}
        else:
            choice_record = {**choice_record, **RequestRecord(account=account).changes()}
        # subscribed first: the request names this ingress's feed from its first chunk
        for task in tasks:
            self.subscriptions.append(await ing.feed.subscribe(task.request_id))
        feed = ing.feed.reader_id
        if choice_record is None:
            [task] = tasks
            route = await ing.producer.enqueue(task, entry, record, feed)
            return None if route is None else [route]
        return await ing.producer.enqueue_choices(
            self.request_id, tasks, entry, record, choice_record, feed
        )

    async def raced(self, digest: str, reattach: Reattach) -> Response:
        """The same id was queued by another connection meanwhile: give back what this one
        took and reattach to it (a 409 when it is another request)."""
        self.abandon()
        rec = await owned_record(self.ing, self.request_id, self.key_id)
        check_same(rec, self.request_id, digest, self.key_id)
        await self.ing.producer.confirm_replicated(self.request_id)  # as posted_before
        return await reattach(rec)

    async def start(
        self,
        tasks: list[PrefillTask],
        entry: ModelEntry,
        record: dict[str, Any],
        digest: str,
        reattach: Reattach,
        respond: Callable[[RequestTimer], Awaitable[Response]],
        choice_record: dict[str, Any] | None = None,
        prompt_tokens: int | None = None,
    ) -> Response:
        """Charge the key's quotas (`charge`), queue the tasks (`enqueue`) and answer with
        `respond(timer)`, which builds the output job from `hand_over()`; when the same id
        raced in, the reattached reply. `prompt_tokens`: the prompts' tokens, each prompt
        once (None: every task's)."""
        await self.charge(tasks, prompt_tokens)
        routes = await self.enqueue(tasks, entry, record, choice_record)
        if routes is None:
            return await self.raced(digest, reattach)
        return await respond(self.queued(tasks[0].model, routes))

    async def charge(self, tasks: list[PrefillTask], prompt_tokens: int | None = None) -> None:
        """Take the caller's quotas (a limited key only): one request, its tokens (the prompts'
        and each choice's max_tokens, as OpenAI counts them) and, with a concurrency limit, a
        unit the slot gives back when the reply ends; a 429 (nothing taken) over a limit."""
        policy = self.policy
        if not policy.limited:
            return
        ing = self.ing
        if prompt_tokens is None:
            prompt_tokens = sum(len(task.prompt_token_ids) for task in tasks)
        tokens = prompt_tokens + sum(task.sampling.max_tokens or 0 for task in tasks)
        limits = Limits(policy.rpm, policy.tpm, policy.max_concurrent)
        key_id, unit = policy.key_id, new_unit(self.request_id)
        state = await ing.producer.ride_out(
            self.request_id, lambda: ing.quotas.take(key_id, limits, tokens, unit)
        )
        self.rate_headers = state.headers()
        if not state.admitted:
            err = state.error(policy.name, ing.config.retry_after_s)
            logger.info("request %s refused: %s", self.request_id, err.message)
            raise err
        if limits.max_concurrent:
            if self.slot is None:  # every endpoint admits first; the unit needs an owner
                self.slot = ing.backpressure.slot(0)
            self.slot.then(lambda: ing.quotas.release_soon(key_id, unit))

    def queued(self, model: str, routes: list[Route]) -> RequestTimer:
        """Count the queued request (its routes' stages, the ingress's queue counters); the
        timer of its reply."""
        ing = self.ing
        ing.backpressure.queued(len(routes))
        ing.cluster.refresh_behind()
        for route in routes:
            ing.metrics.request_route.labels(model, route.stage).inc()
        return RequestTimer(ing.metrics, model, self.arrival)

    def hand_over(self) -> tuple[Slot | None, list[Subscription]]:
        """The slot and subscriptions, now the output job's (no longer given back here)."""
        slot, subs = self.slot, self.subscriptions
        self.slot, self.subscriptions = None, []
        return slot, subs

    def abandon(self) -> None:
        """A submission that gets no output job: its slot and subscriptions given back."""
        slot, subs = self.hand_over()
        if slot is not None:
            slot.release()
        for subscription in subs:
            subscription.close()


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    """`response` sending `headers` too (a reply streamed through raw ASGI `send` as well)."""
    if not headers:
        return response
    response.headers.update(headers)
    if isinstance(response, WatchedResponse):  # its output job starts the reply itself
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        produce = response.produce

        async def produce_with(send: Send) -> None:
            async def send_with(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
                await send(message)

            await produce(send_with)

        response.produce = produce_with
    return response
