"""Producer client: queue requests straight into the streams and read their tokens, no HTTP.

Uses the ingress's own request-building code (`kvrelay.pipeline.queue.submit.Producer`), so a
request sent here becomes exactly the PrefillTask/DecodeTask the ingress would have queued.

    async with AsyncClient("redis://127.0.0.1:6379/0") as client:
        rid = await client.submit("Hello", sampling=SamplingParams(max_tokens=8))
        async for chunk in client.stream(rid):
            print(chunk.text, end="")

`Client` is the same API for synchronous code (batch jobs), driving an event loop in a thread.
Only the Redis URL is needed: without the model on this host, the tokenizer files its workers
publish are used (`kvrelay.pipeline.model_registry`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvrelay.core import record as rec
from kvrelay.core.config import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    RedisSettings,
    check_shards,
    setting,
)
from kvrelay.core.keys import Keys
from kvrelay.core.messages import PRIORITY_BOUND, TokenChunk
from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.core.record import RequestRecord
from kvrelay.core.sampling import GenerationDefaults, InvalidSamplingParams, SamplingParams
from kvrelay.pipeline.client.validate import (
    checked_id,
    parse_request,
    sampling_fields,
)
from kvrelay.pipeline.errors import RequestError, bad_request, queue_unavailable
from kvrelay.pipeline.model_registry import ModelRegistry
from kvrelay.pipeline.openai.validate import type_error
from kvrelay.pipeline.queue import choices_state
from kvrelay.pipeline.queue.cluster import ClusterState
from kvrelay.pipeline.queue.feed import BLOCK_MS, output_feed
from kvrelay.pipeline.queue.outage import REDIS_RETRY_S
from kvrelay.pipeline.queue.output import (
    Completion,
    OutputExpired,
    OutputTimeout,
    RequestNotFound,
)
from kvrelay.pipeline.queue.redis_options import async_redis
from kvrelay.pipeline.queue.route import ROUTE_THRESHOLD, RouteMode, Router
from kvrelay.pipeline.queue.shard_count import check_shard_count
from kvrelay.pipeline.queue.submit import (
    MAX_PROMPT_TOKENS,
    MAX_TOKENS_LIMIT,
    REQUEST_TIMEOUT_S,
    Producer,
    Tenancy,
    new_request_id,
)
from kvrelay.pipeline.queue.subscription import Subscription

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "OutputExpired",
    "OutputTimeout",
    "RequestError",
    "RequestNotFound",
]


@dataclass(frozen=True, slots=True)
class _Options:
    """The client's settings its shard-dependent pieces are built with (`AsyncClient._build`)."""

    tokenizers: dict[str, Any] | None
    mode: RouteMode | str
    route_threshold: int
    timeout_s: float | None
    max_prompt_tokens: int
    max_tokens_limit: int
    submit_wait_s: float
    block_ms: int
    ordered: bool  # --scheduling-policy priority: queued in order (lua/ordered.lua)
    tenant: str
    weight: float


class AsyncClient:
    """Submit requests to a kvrelay pipeline and iterate their tokens (asyncio)."""

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        model: str = DEFAULT_MODEL,
        mode: RouteMode | str = RouteMode.AUTO,
        route_threshold: int = ROUTE_THRESHOLD,
        timeout_s: float | None = REQUEST_TIMEOUT_S,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        max_tokens_limit: int = MAX_TOKENS_LIMIT,
        block_ms: int = BLOCK_MS,
        tokenizers: dict[str, Any] | None = None,
        redis: aioredis.Redis | None = None,
        max_connections: int = 1024,
        override_generation_config: dict[str, Any] | str | None = None,
        submit_wait_s: float = REDIS_RETRY_S,
        shards: int | None = None,
        scheduling_policy: str = "fcfs",
        tenant: str = "",
        weight: float = 1.0,
    ):
        """`scheduling_policy`: the stack's ingress's ("priority": this client's requests are
        queued by priority and fair shares as the ingress's are, as `tenant` with `weight`;
        "fcfs": at the streams' end, priority 0 only)."""
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}"
            )
        if not 0 < weight <= 1e6:
            raise ValueError("weight must be > 0 and <= 1e6")
        self.model = model
        # given (the argument, else KVRELAY_SHARDS): checked against the stack's at first use;
        # not given: the stack's own count, read from its Redis at first use (1 until then)
        if shards is None:
            shards = setting(RedisSettings, "shards", default=None)
        self._shards_given = shards is not None
        self._shards_checked = False
        self._override = _override(override_generation_config)
        self._own_redis = redis is None
        # each request being read holds a connection: beyond max_connections, callers wait
        self.redis = redis or async_redis(redis_url, max_connections)
        self._options = _Options(
            tokenizers, mode, route_threshold, timeout_s, max_prompt_tokens, max_tokens_limit,
            submit_wait_s, block_ms, scheduling_policy == "priority", tenant, weight,
        )  # fmt: skip
        self.block_ms = block_ms
        self._build(Keys(key_prefix, shards=check_shards(shards or 1)))
        self._deadlines: dict[str, float | None] = {}
        self._models: dict[str, str] = {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.feed.stop()
        if self._own_redis:
            await self.redis.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        model: str | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        detokenize: bool = True,
        priority: int = 0,
    ) -> str:
        """Queue one request (text, chat messages or token ids); return its id. `priority`:
        lower first (the "priority" scheduling policy only).

        Raises RequestError (as the HTTP API would answer) for a request that cannot be served,
        an id already in use (409) or Redis unreachable for longer than `submit_wait_s` (503);
        nothing is queued then. No reader follows it yet: stream() attaches to it.
        """
        return await self._submit(
            prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            model=model,
            request_id=request_id,
            cache_salt=cache_salt,
            detokenize=detokenize,
            priority=priority,
        )

    async def _submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        model: str | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        detokenize: bool = True,
        feed: str = "",
        priority: int = 0,
    ) -> str:
        """submit(), naming `feed` as the reader that follows the request."""
        if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
            raise RequestError("give exactly one of prompt, messages or prompt_token_ids")
        request_id = new_request_id() if request_id is None else checked_id(request_id)
        if not isinstance(detokenize, bool):
            raise type_error("detokenize", "a boolean")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise type_error("priority", "an integer")
        if abs(priority) > PRIORITY_BOUND:
            raise RequestError(f"priority must be within +-{PRIORITY_BOUND}", param="priority")
        body = sampling_fields(sampling)
        body.update(model=model or self.model, cache_salt=cache_salt)
        parsed = parse_request(body, prompt, messages, prompt_token_ids)
        try:
            await self._check_shards()
            o = self._options
            tenancy = Tenancy(priority, o.tenant, o.weight)
            task, entry = await self.producer.prepare_parsed(
                parsed, request_id=request_id, detokenize=detokenize, tenancy=tenancy
            )
            route = await self.producer.enqueue(
                task, entry, RequestRecord(source="client").changes(), feed
            )
        except RedisError as exc:
            raise queue_unavailable(exc) from exc
        if route is None:
            raise RequestError(
                f"request id {request_id!r} is already in use",
                409,
                param="request_id",
                code="duplicate_request_id",
            )
        self._deadlines[request_id] = task.deadline
        self._models[request_id] = parsed.model
        return request_id

    def _build(self, keys: Keys) -> None:
        """The pieces that depend on the shard count: keys, cluster view, models, producer and
        the output reader (started on first use)."""
        o = self._options
        self.keys = keys
        self.cluster = ClusterState(self.redis, keys)
        self.registry = ModelRegistry((self.model,), self.cluster, o.tokenizers, self._override)
        router = Router(self.redis, keys, o.mode, o.route_threshold, self.cluster)
        self.producer = Producer(
            self.redis,
            keys,
            self.registry,
            router,
            max_prompt_tokens=o.max_prompt_tokens,
            max_tokens_limit=o.max_tokens_limit,
            timeout_s=o.timeout_s,
            submit_wait_s=o.submit_wait_s,
            ordered=o.ordered,
        )
        # the one reader of the outputs this client reads (started on first use)
        self.feed = output_feed(self.redis, keys, block_ms=o.block_ms)

    async def _check_shards(self) -> None:
        """A given shard count is checked against the stack's (ShardCountError when they
        differ); otherwise the stack's count is taken, before anything used the keys. Done
        once; Redis unreachable (or no process of the stack started yet), tried again at the
        next call (the call itself rides the outage out)."""
        if self._shards_checked:
            return
        try:
            if self._shards_given:
                await check_shard_count(self.redis, self.keys)
            else:
                raw = await self.redis.get(self.keys.shard_count)
                if raw in (None, b"", ""):
                    return  # the stack has not started yet: 1 shard until it says
                stored = check_shards(int(raw))
                if stored != self.keys.shards:
                    self._build(Keys(self.keys.prefix, shards=stored))
        except RedisError:
            return
        self._shards_checked = True

    async def _retext(self, request_id: str):
        model = self._models.get(request_id)
        if model is None:
            key = self.keys.of(request_id).request(request_id)
            raw = await self.redis.hget(key, rec.MODEL)
            model = RequestRecord.decode_fields((rec.MODEL,), (raw,)).model
        if not model:
            return None
        try:
            tokenizer = (await self.registry.get(model)).tokenizer
        except RequestError:
            return None
        return lambda ids: tokenizer.decode(ids)

    async def stream(
        self, request_id: str, start_index: int = 0, *, _subscription: Subscription | None = None
    ) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks from token `start_index` on, ending with the final chunk.

        A chunk that began before `start_index` is cut there (its text re-decoded). Raises
        RequestNotFound (no record), OutputExpired (ended, output no longer kept), OutputTimeout
        (deadline passed), RequestError (bad argument 400, Redis unreachable 503).
        """
        checked_id(request_id)
        if isinstance(start_index, bool) or not isinstance(start_index, int) or start_index < 0:
            raise bad_request(
                f"start_index must be a non-negative integer, got {start_index!r}",
                param="start_index",
                code="invalid_value",
            )
        try:
            await self._check_shards()
            deadline = self._deadlines.get(request_id)
            if deadline is None and request_id not in self._deadlines:
                raw = await self.redis.hget(
                    self.keys.of(request_id).request(request_id), rec.DEADLINE
                )
                deadline = RequestRecord.decode_fields((rec.DEADLINE,), (raw,)).deadline
            retext = await self._retext(request_id) if start_index else None
            # the deadline is met at the deadline itself, as the ingress does
            if _subscription is not None:  # generate(): subscribed before submitting
                chunks = _subscription.chunks(
                    start_index=start_index, deadline=deadline, retext=retext, submitted=True
                )
            else:
                chunks = self.feed.chunks(
                    request_id, start_index=start_index, deadline=deadline, retext=retext
                )
            async for chunk in chunks:
                yield chunk
        except RedisError as exc:
            raise queue_unavailable(exc) from exc
        finally:
            if _subscription is not None:
                _subscription.close()

    async def result(
        self, request_id: str, start_index: int = 0, *, _subscription: Subscription | None = None
    ) -> Completion:
        """Wait for the request to finish and return everything from `start_index` on."""
        done = Completion(request_id)
        async for chunk in self.stream(request_id, start_index, _subscription=_subscription):
            done.add(chunk)
        return done

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """submit() then result(), the request following this client's feed from its first
        chunk (subscribed before it is queued: no history to read)."""
        given = kwargs.pop("request_id", None)
        request_id = new_request_id() if given is None else checked_id(given)
        try:
            await self._check_shards()  # before the subscription takes its shard's feed
        except RedisError as exc:
            raise queue_unavailable(exc) from exc
        subscription = await self.feed.subscribe(request_id)
        try:
            await self._submit(prompt, request_id=request_id, feed=self.feed.reader_id, **kwargs)
        except BaseException:
            subscription.close()
            raise
        return await self.result(request_id, _subscription=subscription)

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to stop the request (it finishes with finish_reason 'cancelled'), and
        every choice of a request of several."""
        checked_id(request_id)
        try:
            await self._check_shards()
            await choices_state.cancel(self.redis, self.keys, request_id)
        except RedisError as exc:
            raise queue_unavailable(exc) from exc

    async def status(self, request_id: str) -> dict[str, Any] | None:
        """The req:{id} record, typed as GET /v1/requests/{id} shows it (counts int, times
        float, absent fields None; a request of several choices combined from them, with
        `choices`); None when unknown or expired."""
        checked_id(request_id)
        try:
            await self._check_shards()
            return await choices_state.request_view(self.redis, self.keys, request_id)
        except RedisError as exc:
            raise queue_unavailable(exc) from exc


class Client:
    """Synchronous wrapper of AsyncClient (same arguments and methods)."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvrelay-client", daemon=True
        )
        self._thread.start()
        self._async: AsyncClient = self._call(_make(redis_url, kwargs))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        return self._call(self._async.submit(prompt, **kwargs))

    def stream(self, request_id: str, start_index: int = 0) -> Iterator[TokenChunk]:
        agen = self._async.stream(request_id, start_index)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._call(agen.aclose())

    def result(self, request_id: str, start_index: int = 0) -> Completion:
        return self._call(self._async.result(request_id, start_index))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return self._call(self._async.generate(prompt, **kwargs))

    def cancel(self, request_id: str) -> None:
        self._call(self._async.cancel(request_id))

    def status(self, request_id: str) -> dict[str, Any] | None:
        return self._call(self._async.status(request_id))


def _override(value: dict[str, Any] | str | None) -> GenerationDefaults:
    """The `override_generation_config` argument: as the ingress's setting, or a dict."""
    try:
        if isinstance(value, dict):
            return GenerationDefaults.parse(value)
        if value is None or isinstance(value, str):
            return GenerationDefaults.from_json(value)
    except InvalidSamplingParams as exc:
        raise bad_request(
            f"override_generation_config: {exc}", param="override_generation_config"
        ) from None
    raise type_error("override_generation_config", "a dict or a JSON object string")


async def _make(redis_url: str, kwargs: dict[str, Any]) -> AsyncClient:
    # built inside the loop thread so the connection pool belongs to that loop
    return AsyncClient(redis_url, **kwargs)
