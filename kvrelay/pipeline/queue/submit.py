"""Building and queueing requests: the one code path shared by the ingress and the client.

prompt (messages | text | token ids) -> token ids -> length and sampling checks -> the
PrefillTask (`prepare`) -> route -> one Lua script that creates `req:{id}` (refusing an id that
exists) and its progress (naming the feed of the reader that follows it) and XADDs the task
(a DecodeTask when routed straight to decode), so a request is either fully queued or not at
all.

Redis unreachable (a Valkey restart) is waited out, up to `submit_wait_s` and the request's
deadline (`outage.py`, as the output readers do): the caller gets a slower answer, not a 503.
Retrying the script is safe: it recognises its own submission by the `submission_id` it
wrote, so a retry whose first try ran (the reply was lost) queues nothing twice.

On a replicated Valkey (a `redis+sentinel://` client) the script is followed, on the same
connection, by a PUBLISH to a channel nobody reads and `WAIT 1 <replica_ack_timeout_ms>`: a
request is acknowledged only once a replica holds it. WAIT counts the replicas that hold this
connection's last propagated command; the PUBLISH (propagated, data untouched) makes that "now",
so a retry that finds the request already queued (by an earlier try, its reply lost) waits for
that earlier write too. When no replica holds it in time, the submission fails with a 503
`not_replicated` (the request may still run on the primary); a retry with the same request id
finds it (reattaches) and a failover that lost it lets the retry queue it again.

On a Valkey Cluster with replicas (CLUSTER NODES lists a replica, `kvrelay up --shards S
--valkey-replicas N`) submissions wait the same way, with the same setting and the same 503.
There PUBLISH is not propagated to replicas (the cluster bus carries it) and the client routes
WAIT to a node of its own choosing, so after the submit script the primary serving the
request's hash slot gets, on one connection (`redis_options.wait_on_slot_primary`): EXISTS
req:{id}, a write under the request's hash tag (`{tag}:replicated`, a key that expires), and
WAIT. An acknowledgment means a replica holds everything that primary held when the record
was there: the record and its stream entry (one script). A cluster without replicas does not
wait.

A client that retries after a `not_replicated` 503 reattaches to the queued request without
submitting again: `confirm_replicated` is that retry's wait (the same EXISTS, propagated write
and WAIT, also on Sentinel), so it too is answered only once a replica holds the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec
from redis.asyncio.cluster import RedisCluster

from kvrelay.core import record as rec
from kvrelay.core.enums import RequestStatus
from kvrelay.core.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, Retention
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams
from kvrelay.pipeline.errors import RequestError, bad_request, model_unavailable, overloaded
from kvrelay.pipeline.model_registry import ModelEntry, ModelRegistry
from kvrelay.pipeline.openai.protocol import GenerationRequest
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.choices_state import choice_id as choice_id  # where it was
from kvrelay.pipeline.queue.field_ttl import field_ttl
from kvrelay.pipeline.queue.outage import REDIS_RETRY_S, Outage
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.redis_options import (
    AsyncRedis,
    cluster_has_replicas,
    is_cluster_client,
    replicated,
    wait_on_slot_primary,
)
from kvrelay.pipeline.queue.route import DECODE, Route, Router
from kvrelay.pipeline.queue.session_cache import SessionCache
from kvrelay.pipeline.tokens import (
    check_lengths,
    known_max_chars,
    max_chars_per_token,
    tokenize,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_INLINE_TOKENIZE_CHARS = 16384
# The request limits' defaults, for the ingress (IngressConfig) and the producer client alike
MAX_PROMPT_TOKENS = 32768  # also capped by the model's context length
MAX_TOKENS_LIMIT = 4096  # largest max_tokens a request may ask for
REQUEST_TIMEOUT_S = 600.0  # deadline given to workers
_HOPELESS_MARGIN = 2  # normalizers (NFKC) may fold characters: never refuse one that fits
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
REPLICA_ACK_TIMEOUT_MS = 1000  # WAIT for one replica this long (a replicated Valkey only)
REPLICAS_RECHECK_S = 10.0  # a cluster's topology (has it replicas?) is read again this often
MARKER_TTL_MS = 60000  # the `{tag}:replicated` key a cluster WAIT writes before it expires

# lua/submit.lua: create req:{id} and XADD the task in one step, refusing a duplicate id (but
# not a retry of the same submission) and, at max_waiting unread entries, any new request
# (backpressure.py's exact bound)
_SUBMIT_LUA = scripts.ordered("submit")
# lua/submit_choices.lua: the same for a request fanned out into several choices (a parent
# record, and a record and a task per choice), all or nothing
_SUBMIT_CHOICES_LUA = scripts.ordered("submit_choices")


def not_replicated(request_id: str, timeout_ms: int, retry_after_s: int) -> RequestError:
    """503 not_replicated: queued on the primary, but no replica acknowledged it in time."""
    return RequestError(
        f"request {request_id} was not replicated: no Valkey replica acknowledged it within "
        f"{timeout_ms} ms. Retry with the same X-Request-Id (it is queued once).",
        503,
        type="service_unavailable",
        code="not_replicated",
        headers={"Retry-After": str(retry_after_s)},
    )


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def valid_request_id(request_id: str) -> bool:
    """1-128 characters of [A-Za-z0-9._:-] (fullmatch: `$` would let a trailing newline in)."""
    return _REQUEST_ID.fullmatch(request_id) is not None


def check_request_id(request_id: str, param: str = "X-Request-Id") -> str:
    """A caller-chosen id must be 1-128 characters of [A-Za-z0-9._:-]."""
    if not valid_request_id(request_id):
        raise bad_request(
            "request id must be 1-128 characters of letters, digits and ._:-",
            param=param,
            code="invalid_request_id",
        )
    return request_id


def routed(task: PrefillTask, route: Route) -> PrefillTask | DecodeTask:
    """The wire message of a prepared request for the first stage of `route`."""
    if route.stage == DECODE:  # a colocated decode worker prefills it
        fields = {**msgspec.structs.asdict(task), "num_cached_tokens": route.cached_tokens}
        return DecodeTask(**fields, num_stored_pages=route.cached_pages, prefilled=False)
    return msgspec.structs.replace(task, num_cached_tokens=route.cached_tokens)


# a request without max_tokens is charged this many generated tokens in the fair-share order
UNBOUNDED_COST = 512


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whom a request is queued for: its priority (lower first), its tenant and the tenant's
    fair-share weight (the ingress takes them from the caller's API key)."""

    priority: int = 0
    tenant: str = ""
    weight: float = 1.0


def new_submission_id() -> str:
    """Tells the submit script a retry of one submission from another with the same id."""
    return uuid.uuid4().hex


class Producer:
    """Prepares and queues requests for the ingress and the producer client alike."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        registry: ModelRegistry,
        router: Router,
        *,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        max_tokens_limit: int = MAX_TOKENS_LIMIT,
        timeout_s: float | None = REQUEST_TIMEOUT_S,
        record_ttl_s: int = 86400,
        max_waiting: int = 0,
        retry_after_s: int = 1,
        submit_wait_s: float = REDIS_RETRY_S,
        replica_ack_timeout_ms: int = REPLICA_ACK_TIMEOUT_MS,
        session_cache: SessionCache | None = None,
        ordered: bool = False,
        priority_age_s: float = 60.0,
    ):
        self.redis, self.keys, self.registry, self.router = redis, keys, registry, router
        # --scheduling-policy priority: queued by priority and tenants' fair shares, a request
        # waiting past priority_age_s first (lua/ordered.lua); else at the streams' end
        self.ordered, self.priority_age_ms = ordered, max(1, round(priority_age_s * 1000))
        # retention of named sessions, prefetch hints (defaults: 600 s, a day at most, on)
        self.session_cache = session_cache or SessionCache(redis, keys)
        self.max_prompt_tokens, self.max_tokens_limit = max_prompt_tokens, max_tokens_limit
        self.timeout_s, self.record_ttl_s = timeout_s, record_ttl_s
        # 0: no bound (the producer client); the ingress refuses with 429 at this many
        self.max_waiting, self.retry_after_s = max_waiting, retry_after_s
        self.submit_wait_s = submit_wait_s  # how long a Redis outage is waited out
        # 0: no WAIT (a Valkey without replicas, or disabled); a cluster: see _ack_ms()
        self.replica_ack_ms = replica_ack_timeout_ms if replicated(redis) else 0
        self._cluster_ack_ms = replica_ack_timeout_ms if is_cluster_client(redis) else 0
        self._cluster_replicas = False  # as of the last look, REPLICAS_RECHECK_S at most ago
        self._replicas_seen_at: float | None = None
        self._replicas_lock = asyncio.Lock()  # one look at a time; the others wait for it
        self._submit = redis.register_script(_SUBMIT_LUA)
        self._submit_choices = redis.register_script(_SUBMIT_CHOICES_LUA)

    async def ride_out(self, request_id: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` (a Redis read for a new request) retried through a Redis outage, as
        long as submission waits: up to `submit_wait_s` and the request's timeout."""
        until = time.time() + self.timeout_s if self.timeout_s else None
        return await Outage(f"request {request_id}", self.submit_wait_s, until).retry(attempt)

    async def prepare(
        self,
        model: str,
        sampling: SamplingParams,
        *,
        request_id: str,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str = "",
        retention: Retention | None = None,
        tenancy: Tenancy = Tenancy(),
        detokenize: bool = True,
        max_tokens_param: str = "max_tokens",
        fields_set: Collection[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[PrefillTask, ModelEntry]:
        """Tokenize and check one request into its task (routed by `enqueue`); raise
        RequestError when it cannot be served.

        `fields_set`: the sampling fields the request gave; the model's generation defaults
        fill the others (None: none are applied). Queued first come, first served (not
        `ordered`), a request takes priority 0 only.
        """
        if tenancy.priority and not self.ordered:
            raise bad_request(
                "priority is only served under the priority scheduling policy (the ingress's "
                "--scheduling-policy priority); this stack serves requests first come, first "
                "served",
                param="priority",
                code="unsupported_value",
            )
        entry = await self.ride_out(request_id, lambda: self.registry.get(model))
        model = entry.name  # an alias (--served-model-name) is queued under the model's name
        await self._refuse_unserved(request_id, entry)
        defaults = entry.generation_defaults
        if fields_set is not None:
            sampling = defaults.apply(sampling, fields_set)
        size = len(prompt or "") + sum(len(str(m.get("content", ""))) for m in messages or ())
        param = "messages" if messages is not None else "prompt"
        await self._refuse_hopeless(entry, size, param)
        args: dict[str, Any] = dict(
            messages=messages, prompt=prompt, prompt_token_ids=prompt_token_ids
        )
        if tools:
            args["tools"] = tools
        if size > _INLINE_TOKENIZE_CHARS:  # milliseconds of work or more: off the event loop
            ids = await asyncio.to_thread(tokenize, entry, **args, threaded=True)
        else:
            ids = tokenize(entry, **args)
        check_lengths(
            entry,
            ids,
            sampling,
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens_limit=self.max_tokens_limit,
            param=param,
            max_tokens_param=max_tokens_param,
            default_max_tokens=defaults.max_tokens if fields_set is not None else None,
        )
        try:  # the request models checked the ranges; what needs the model and max_tokens:
            sampling.check_fit(entry.vocab_size)
        except InvalidSamplingParams as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        now = time.time()
        deadline = now + self.timeout_s if self.timeout_s else None
        task = PrefillTask(
            request_id=request_id,
            model=model,
            prompt_token_ids=ids,
            sampling=sampling,
            cache_salt=cache_salt,
            retention=retention,
            priority=tenancy.priority,
            tenant=tenancy.tenant,
            weight=tenancy.weight,
            lora=entry.lora,
            arrival_time=now,
            deadline=deadline,
            detokenize=detokenize,
        )
        return task, entry

    async def _refuse_unserved(self, request_id: str, entry: ModelEntry) -> None:
        """503 model_unavailable when workers are live but none serves the model: on a stack
        of several models, one whose workers are all stopped (its requests would wait for
        a worker that may never come). With no worker live at all, requests queue as they
        always did (a stack starting or restarting)."""
        cluster = self.router.cluster
        if cluster is None:
            return
        model = entry.worker_model
        if not await self.ride_out(request_id, lambda: cluster.serving(model)):
            logger.warning("request %s refused: no live worker serves %s", request_id, model)
            raise model_unavailable(entry.name, self.retry_after_s)

    async def _refuse_hopeless(self, entry: ModelEntry, chars: int, param: str) -> None:
        """400 context_length_exceeded, before tokenizing, for text no allowed prompt can hold.

        Each token stands for at most `max_chars_per_token` characters, so longer text cannot
        fit; the margin covers normalizers that fold characters together (NFKC).
        """
        limit = min(self.max_prompt_tokens, entry.max_model_len - 1)
        if chars <= limit:  # cannot be hopeless: skip computing the per-token bound
            return
        tok = entry.tokenizer
        per_token = known_max_chars(tok)
        if not per_token:
            per_token = await asyncio.to_thread(max_chars_per_token, tok)
        if chars > limit * per_token * _HOPELESS_MARGIN:
            raise RequestError(
                f"'{param}' has {chars} characters: more than {limit} tokens (the longest "
                f"prompt accepted here) can hold, at {per_token} characters per token at most. "
                f"Please reduce the length of the {param}.",
                400,
                param=param,
                code="context_length_exceeded",
            )

    async def prepare_parsed(
        self,
        parsed: GenerationRequest,
        *,
        request_id: str,
        detokenize: bool = True,
        tenancy: Tenancy | None = None,
    ) -> tuple[PrefillTask, ModelEntry]:
        """prepare() for a parsed OpenAI body (the ingress and the producer client).

        `tenancy`: the caller's (None: the body's priority, no tenant)."""
        if tenancy is None:
            tenancy = Tenancy(priority=parsed.priority or 0)
        return await self.prepare(
            parsed.model,
            parsed.sampling,
            request_id=request_id,
            messages=parsed.messages,
            prompt=parsed.prompt,
            prompt_token_ids=parsed.prompt_token_ids,
            cache_salt=parsed.cache_salt,
            retention=self.session_cache.retention(parsed.cache_session, parsed.cache_retention),
            tenancy=tenancy,
            detokenize=detokenize,
            max_tokens_param=parsed.max_tokens_param,
            fields_set=parsed.fields_set,
            tools=parsed.tools,
        )

    async def enqueue(
        self,
        task: PrefillTask,
        entry: ModelEntry,
        record: dict[str, Any] | None = None,
        feed: str = "",
    ) -> Route | None:
        """Route and queue a prepared `task`; None when another request with this id exists.

        `feed`: the output reader (`OutputFeed.reader_id`) that follows the request from its
        first chunk ("" when none does yet: a reader attaches later).

        Raises a 429 RequestError when `max_waiting` entries already wait in the streams, and
        redis' ConnectionError when Redis stays unreachable past `submit_wait_s` or the
        deadline.
        """
        outage = Outage(f"request {task.request_id}", self.submit_wait_s, task.deadline)
        submission = new_submission_id()  # the same for every retry below
        route, entry_id = await outage.retry(
            lambda: self._queue(task, entry, record, feed, submission)
        )
        if not entry_id:
            return None
        if isinstance(entry_id, int):  # the bound was reached: nothing was queued
            logger.warning(
                "request %s refused: %d queued entries (bound %d)",
                task.request_id,
                entry_id,
                self.max_waiting,
            )
            raise overloaded(f"{entry_id} requests waiting for a worker", self.retry_after_s)
        if as_str(entry_id) == submission:  # a retry found its own first try queued
            logger.info("request %s: queued by a try whose reply was lost", task.request_id)
        await self.session_cache.hint(entry, task.prompt_token_ids, task.cache_salt)
        logger.info(
            "request %s queued to %s (%d prompt tokens, %d cached: %s)",
            task.request_id,
            route.stage,
            len(task.prompt_token_ids),
            route.cached_tokens,
            route.reason,
        )
        return route

    async def _queue(
        self,
        task: PrefillTask,
        entry: ModelEntry,
        record: dict[str, Any] | None,
        feed: str,
        submission: str,
    ) -> tuple[Route, Any]:
        """One try: route, then the submit script; (route, the script's reply)."""
        route = await self.router.route(entry, task.prompt_token_ids, task.cache_salt)
        # the request's shard: its keys; its model's pipeline: its streams
        keys = self.keys.of(task.request_id).for_pipeline(entry.pipeline)
        stream = keys.decode_stream if route.stage == DECODE else keys.prefill_stream
        flat = _record_items(task, route.stage, len(task.prompt_token_ids), route.cached_tokens)
        flat += _items(record or {})
        ttl_fields = await field_ttl(self.redis)
        call = dict(
            keys=[
                keys.request(task.request_id),
                stream,
                keys.prefill_stream,
                keys.decode_stream,
                keys.progress,
            ],
            args=[
                self.record_ttl_s,
                routed(task, route).encode(),
                self.max_waiting,
                PREFILL_GROUP,
                DECODE_GROUP,
                submission,
                task.request_id,
                new_progress(feed),
                ttl_fields,
                *self._order(task),
                *flat,
            ],
        )
        entry_id = await self._replicated(task.request_id, self._submit, call)
        return route, entry_id

    def _order(self, task: PrefillTask) -> list[str | int | float]:
        """The submit scripts' ordering items: ordered?, priority, tenant, cost, age bound."""
        if not self.ordered:
            return ["", 0, "", 0, 0]
        max_tokens = task.sampling.max_tokens
        tokens = len(task.prompt_token_ids) + (max_tokens if max_tokens else UNBOUNDED_COST)
        cost = tokens / task.weight
        return ["1", task.priority, task.tenant, repr(cost), self.priority_age_ms]

    async def _ack_ms(self) -> int:
        """How long a submission WAITs for a replica (0: it does not): the setting on a
        Sentinel-replicated Valkey, and on a cluster that has a replica (looked up at most
        every REPLICAS_RECHECK_S; a stopped or failed replica still counts)."""
        if self.replica_ack_ms or not self._cluster_ack_ms:
            return self.replica_ack_ms

        def stale() -> bool:
            seen = self._replicas_seen_at
            return seen is None or time.monotonic() - seen > REPLICAS_RECHECK_S

        if stale():
            async with self._replicas_lock:
                if stale():  # not looked at while this one waited for the lock
                    cluster = cast(RedisCluster, self.redis)
                    self._cluster_replicas = await cluster_has_replicas(cluster)
                    self._replicas_seen_at = time.monotonic()
        return self._cluster_ack_ms if self._cluster_replicas else 0

    async def _replicated(self, request_id: str, script: Any, call: dict[str, Any]) -> Any:
        """The submit `script`'s reply; on a replicated Valkey run with `WAIT 1` on the same
        connection (WAIT counts the replicas holding that connection's writes), and a 503
        not_replicated when a queued request reached no replica in time."""
        ack_ms = await self._ack_ms()
        if not ack_ms:
            return await script(**call)
        if not self.replica_ack_ms:  # a cluster: WAIT on the request's slot's primary
            reply = await script(**call)
            if not isinstance(reply, int):  # queued now or before (as below)
                await self._wait_on_slot(request_id, call["keys"][0], ack_ms)
            return reply
        pipe = self.redis.pipeline(transaction=False)
        await script(**call, client=pipe)
        pipe.execute_command("PUBLISH", f"{self.keys.prefix}replicated", "")
        pipe.execute_command("WAIT", 1, self.replica_ack_ms)
        reply, _, acks = await pipe.execute()
        # queued now or before (a retry; an existing id is reattached): a replica must hold it
        if not isinstance(reply, int) and int(acks) < 1:
            logger.warning(
                "request %s queued but held by no replica after %d ms: 503",
                request_id,
                self.replica_ack_ms,
            )
            raise not_replicated(request_id, self.replica_ack_ms, self.retry_after_s)
        return reply

    async def _wait_on_slot(self, request_id: str, record_key: str, ack_ms: int) -> None:
        """On a cluster: EXISTS `record_key`, a propagated write under its hash tag and
        `WAIT 1 ack_ms`, on one connection of the primary serving its slot; a 503
        not_replicated unless the record was there and a replica acknowledged."""
        marker = self.keys.of(request_id).replicated
        write = ("SET", marker, "1", "PX", MARKER_TTL_MS)
        exists, _, acks = await wait_on_slot_primary(
            cast(RedisCluster, self.redis),
            record_key,
            [("EXISTS", record_key), write],
            1,
            ack_ms,
        )
        self._check_held(request_id, int(exists), int(acks), ack_ms)

    def _check_held(self, request_id: str, exists: int, acks: int, ack_ms: int) -> None:
        if not exists:  # a failover lost it since: the retry queues it again
            logger.warning("request %s: its record is gone from the primary: 503", request_id)
            raise not_replicated(request_id, ack_ms, self.retry_after_s)
        if acks < 1:
            logger.warning(
                "request %s queued but held by no replica after %d ms: 503", request_id, ack_ms
            )
            raise not_replicated(request_id, ack_ms, self.retry_after_s)

    async def confirm_replicated(self, request_id: str) -> None:
        """For a client reattaching to a queued request with a POST (a retry after a 503
        not_replicated, which submits nothing): return once a replica holds req:{id}, else
        raise the same 503 not_replicated. On a Valkey without replicas, at once.

        The primary gets EXISTS req:{id}, a propagated write (Sentinel: the PUBLISH a
        submission sends; a cluster: `{tag}:replicated`) and `WAIT 1`, on one connection:
        the write makes WAIT cover whatever wrote the request, on whichever connection. A
        Redis outage is ridden out as a submission's is."""
        record_key = self.keys.of(request_id).request(request_id)

        async def attempt() -> None:
            ack_ms = await self._ack_ms()
            if not ack_ms:
                return
            if not self.replica_ack_ms:
                await self._wait_on_slot(request_id, record_key, ack_ms)
                return
            pipe = self.redis.pipeline(transaction=False)
            pipe.exists(record_key)
            pipe.execute_command("PUBLISH", f"{self.keys.prefix}replicated", "")
            pipe.execute_command("WAIT", 1, ack_ms)
            exists, _, acks = await pipe.execute()
            self._check_held(request_id, int(exists), int(acks), ack_ms)

        await self.ride_out(request_id, attempt)

    async def enqueue_choices(
        self,
        request_id: str,
        tasks: list[PrefillTask],
        entry: ModelEntry,
        record: dict[str, Any] | None = None,
        choice_record: dict[str, Any] | None = None,
        feed: str = "",
    ) -> list[Route] | None:
        """Queue the prepared choices `tasks` (ids `choice_id(request_id, k)`, sharing one deadline)
        under the parent record req:{request_id}; their routes, or None when the id (or a
        choice's) exists. `record` goes into the parent record, `choice_record` into each
        choice's; `feed` follows every choice (as in enqueue()). Raises as enqueue() does;
        nothing is queued unless all are."""
        outage = Outage(f"request {request_id}", self.submit_wait_s, tasks[0].deadline)
        submission = new_submission_id()  # the same for every retry below
        routes, reply = await outage.retry(
            lambda: self._queue_choices(
                request_id, tasks, entry, record, choice_record, feed, submission
            )
        )
        if isinstance(reply, int):  # the bound was reached: nothing was queued
            logger.warning(
                "request %s (%d choices) refused: %d queued entries (bound %d)",
                request_id,
                len(tasks),
                reply,
                self.max_waiting,
            )
            raise overloaded(f"{reply} requests waiting for a worker", self.retry_after_s)
        if not reply:
            return None
        if as_str(reply) == submission:
            logger.info("request %s: queued by a try whose reply was lost", request_id)
        await self.session_cache.hint(entry, tasks[0].prompt_token_ids, tasks[0].cache_salt)
        logger.info(
            "request %s queued as %d choices to %s (%d prompt tokens, %d cached)",
            request_id,
            len(tasks),
            ",".join(sorted({r.stage for r in routes})),
            len(tasks[0].prompt_token_ids),
            routes[0].cached_tokens,
        )
        return routes

    async def _queue_choices(
        self,
        request_id: str,
        tasks: list[PrefillTask],
        entry: ModelEntry,
        record: dict[str, Any] | None,
        choice_record: dict[str, Any] | None,
        feed: str,
        submission: str,
    ) -> tuple[list[Route], Any]:
        """One try: route each distinct prompt once (its choices go the same way), then the
        submit_choices script; (the routes, the script's reply)."""
        by_prompt: dict[tuple[int, ...], Route] = {}
        routes: list[Route] = []
        for task in tasks:
            prompt = tuple(task.prompt_token_ids)
            if prompt not in by_prompt:
                by_prompt[prompt] = await self.router.route(
                    entry, task.prompt_token_ids, task.cache_salt
                )
            routes.append(by_prompt[prompt])
        # the parent counts each distinct prompt once, as the usage does
        prompt_tokens = sum(len(p) for p in by_prompt)
        cached = sum(r.cached_tokens for r in by_prompt.values())
        parent = _record_items(tasks[0], routes[0].stage, prompt_tokens, cached)
        count = RequestRecord(num_choices=len(tasks)).changes()
        parent += [*_items(count), *_items(record or {})]
        args: list[Any] = [
            self.record_ttl_s,
            self.max_waiting,
            PREFILL_GROUP,
            DECODE_GROUP,
            submission,
            len(tasks),
            new_progress(feed),
            await field_ttl(self.redis),
            *self._order(tasks[0]),
            len(parent),
            *parent,
        ]
        for task, route in zip(tasks, routes, strict=True):
            items = _record_items(
                task, route.stage, len(task.prompt_token_ids), route.cached_tokens
            )
            items += [
                *_items(RequestRecord(parent=request_id).changes()),
                *_items(choice_record or {}),
            ]
            stage = "d" if route.stage == DECODE else "p"
            args += [stage, task.request_id, routed(task, route).encode(), len(items), *items]
        # the choices `{id}.{k}` share the parent's shard, and the model's pipeline
        keys = self.keys.of(request_id).for_pipeline(entry.pipeline)
        call = dict(
            keys=[
                keys.request(request_id),
                keys.prefill_stream,
                keys.decode_stream,
                keys.progress,
                *(keys.request(task.request_id) for task in tasks),
            ],
            args=args,
        )
        reply = await self._replicated(request_id, self._submit_choices, call)
        return routes, reply


# the fields a submission writes, and the decimals of its times
SUBMITTED = (
    rec.STATUS,
    rec.STAGE,
    rec.MODEL,
    rec.CREATED,
    rec.UPDATED,
    rec.PROMPT_TOKENS,
    rec.COMPLETION_TOKENS,
    rec.CACHED_TOKENS,
    rec.DEADLINE,
)
SUBMITTED_PLACES = {rec.CREATED: 6, rec.UPDATED: 6, rec.DEADLINE: rec.MILLIS}


def _record_items(task: PrefillTask, stage: str, prompt_tokens: int, cached: int) -> list[Any]:
    """The req:{id} fields written at submission, as HSET items."""
    record = RequestRecord(
        status=RequestStatus.QUEUED,
        stage=stage,
        model=task.model,
        created=task.arrival_time,
        updated=time.time(),
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        cached_tokens=cached,
        deadline=task.deadline,  # none: ""
    )
    return _items(record.encode(SUBMITTED, places=SUBMITTED_PLACES))


def _items(fields: dict[str, Any]) -> list[Any]:
    """HSET items of `fields`: plain values as they are, others (objects) as JSON."""
    flat: list[Any] = []
    for key, value in fields.items():
        plain = isinstance(value, str | int | float) and not isinstance(value, bool)
        flat += [key, value if plain else json.dumps(value)]
    return flat
