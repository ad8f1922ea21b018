"""The OpenAI-compatible HTTP ingress (Starlette): `Ingress` and `create_app(config)`.

It validates and tokenizes requests, routes each to stream:prefill or stream:decode, and relays
their chunks (one output feed per process, queue/feed.py) back as JSON or SSE. It imports
neither torch nor the workers, so it starts fast.

`Ingress` is the application: the shared state, its lifespan, and `routes()`, the route table.
Every endpoint is a method of `GenerationApi` (routes.py: completions and the request
endpoints), `ResponsesApi` (responses_routes.py: the Responses API), `TokenizationApi`
(tokenization.py: /tokenize, /detokenize) or `InfoApi` (info.py: models, health, metrics,
OpenAPI), each holding the Ingress, typed by the narrow Protocols of context.py that it
satisfies, so that none of them imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvrelay.core import record as fields
from kvrelay.core.keys import Keys
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.metrics import Metrics
from kvrelay.pipeline.model_registry import ModelEntry, ModelRegistry
from kvrelay.pipeline.queue import choices_state
from kvrelay.pipeline.queue.backpressure import Backpressure
from kvrelay.pipeline.queue.cluster import ClusterState
from kvrelay.pipeline.queue.feed import output_feed
from kvrelay.pipeline.queue.quota import HOLD_GRACE_S, Quotas
from kvrelay.pipeline.queue.redis_options import async_redis, resilient
from kvrelay.pipeline.queue.route import Router
from kvrelay.pipeline.queue.session_cache import SessionCache
from kvrelay.pipeline.queue.shard_count import check_shard_count
from kvrelay.pipeline.queue.submit import Producer
from kvrelay.pipeline.server.config import PRIORITY, IngressConfig, load_config
from kvrelay.pipeline.server.http import error_response
from kvrelay.pipeline.server.info import InfoApi
from kvrelay.pipeline.server.lora_routes import LoraApi
from kvrelay.pipeline.server.middleware import BodyTimeoutMiddleware, RequestIdMiddleware
from kvrelay.pipeline.server.responses_routes import ResponsesApi
from kvrelay.pipeline.server.routes import GenerationApi
from kvrelay.pipeline.server.tokenization import TokenizationApi
from kvrelay.pipeline.tokens import max_chars_per_token

logger = logging.getLogger(__name__)


class Ingress:
    """The application: shared state (Redis, producer, cluster, metrics), lifespan, routes."""

    def __init__(
        self,
        config: IngressConfig,
        tokenizers: dict[str, Any] | None = None,
        redis: aioredis.Redis | None = None,
    ):
        self.config = config
        self.keys = Keys(config.key_prefix, shards=config.shards)
        # Bounded reads: a hung Redis (stopped, not dead) gives 503s within seconds.
        # Sized as when each open request held a connection for its blocking read (now the
        # feed's one read serves them all): --max-inflight plus headroom never runs dry.
        self.redis = redis or async_redis(
            config.redis_url,
            max_connections=config.max_inflight + 256,
            pool_timeout_s=config.redis_timeout_s,
            options=resilient(config.redis_socket_timeout_s, config.redis_timeout_s),
        )
        # the one reader of every output this process delivers (started on first use too)
        self.feed = output_feed(self.redis, self.keys, block_ms=config.read_block_ms)
        self.registry = ModelRegistry(config.models, None, tokenizers, config.generation_override)
        self.cluster = ClusterState(
            self.redis,
            self.keys,
            config.state_refresh_s,
            pipelines=list(self.registry.pipelines.values()),
        )
        self.registry.cluster = self.cluster
        self.router = Router(
            self.redis, self.keys, config.mode, config.route_threshold, self.cluster
        )
        self.producer = Producer(
            self.redis,
            self.keys,
            self.registry,
            self.router,
            max_prompt_tokens=config.max_prompt_tokens,
            max_tokens_limit=config.max_tokens_limit,
            timeout_s=config.request_timeout_s,
            record_ttl_s=config.record_ttl_s,
            max_waiting=config.max_waiting,
            retry_after_s=config.retry_after_s,
            submit_wait_s=config.submit_wait_s,
            replica_ack_timeout_ms=config.replica_ack_timeout_ms,
            session_cache=SessionCache(
                self.redis,
                self.keys,
                config.cache_retention_s,
                config.max_cache_retention_s,
                config.prefetch_hints,
            ),
            ordered=config.scheduling_policy == PRIORITY,
            priority_age_s=config.priority_age_s,
        )
        self.metrics = Metrics()
        self.backpressure = Backpressure(
            self.cluster, config.max_waiting, config.max_inflight, config.retry_after_s
        )
        # per-key quotas; a unit lapses a while after its request's deadline
        self.quotas = Quotas(self.redis, self.keys, config.request_timeout_s + HOLD_GRACE_S)
        self.started = int(time.time())
        self._token_text: dict[str, Callable[[int], str]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.generation = GenerationApi(self)
        self.info = InfoApi(self)
        self.responses = ResponsesApi(self)
        self.tokenization = TokenizationApi(self)

    def lora_routes(self) -> list[Route]:
        """vLLM's run-time LoRA endpoints, where the configuration allows them."""
        if not self.config.allow_runtime_lora_updating:
            return []
        lora = LoraApi(self)
        return [
            Route("/v1/load_lora_adapter", lora.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]),
        ]

    def routes(self) -> list[Route]:
        """The route table: every endpoint the ingress serves, and the method that serves it."""
        gen, info, resp = self.generation, self.info, self.responses
        return [
            Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
            Route("/v1/completions", gen.completions, methods=["POST"]),
            Route("/v1/responses", resp.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", resp.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", resp.delete, methods=["DELETE"]),
            Route("/v1/models", info.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", info.retrieve_model, methods=["GET"]),
            Route("/v1/requests/{request_id}", gen.request_state, methods=["GET"]),
            Route("/v1/requests/{request_id}", gen.cancel_request, methods=["DELETE"]),
            Route("/v1/requests/{request_id}/stream", gen.resume_stream, methods=["GET"]),
            Route("/health", info.health, methods=["GET"]),
            Route("/metrics", info.metrics, methods=["GET"]),
            Route("/openapi.json", info.openapi, methods=["GET"]),
            Route("/tokenize", self.tokenization.tokenize, methods=["POST"]),
            Route("/detokenize", self.tokenization.detokenize, methods=["POST"]),
            *self.lora_routes(),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Starlette lifespan: check Redis, load the tokenizers, close everything at shutdown."""
        try:
            await self.redis.ping()
        except RedisError as exc:
            logger.warning("redis at %s is not reachable yet: %s", self.config.redis_url, exc)
        else:
            await check_shard_count(self.redis, self.keys)  # refuse another shard count
        await self.feed.start()
        await self.warm_up()
        yield
        await self.aclose()

    def token_text(self, entry: ModelEntry) -> Callable[[int], str]:
        """Cached text of one token id (for logprobs), special tokens included."""
        fn = self._token_text.get(entry.name)
        if fn is None:
            tok = entry.tokenizer
            fn = functools.lru_cache(maxsize=65536)(
                lambda tid: tok.decode([tid], skip_special_tokens=False)
            )
            self._token_text[entry.name] = fn
        return fn

    async def cancel(self, request_id: str) -> None:
        """Set the cancel flag in the request's progress (and each choice's, for a request of
        several); workers drop the request and finish it as cancelled."""
        await choices_state.cancel(self.redis, self.keys, request_id)

    async def try_cancel(self, request_id: str) -> None:
        """cancel() that only logs when Redis is unavailable (the deadline stops workers too)."""
        try:
            await self.cancel(request_id)
        except RedisError as exc:
            logger.error("request %s: cannot set the cancel flag: %s", request_id, exc)

    async def client_gone(
        self, request_id: str, attach_seq: int = 0, on_cancel: Callable[[], None] | None = None
    ) -> None:
        """The client disconnected: cancel now, or after the grace period unless it returns.

        `attach_seq` is the reader's attach number; any later attach means someone came back,
        even one that arrived before this disconnect was noticed. `on_cancel` runs once the
        cancel flag is set.
        """
        grace = self.config.disconnect_grace_s
        try:
            if grace <= 0:
                await self.cancel(request_id)
                if on_cancel:
                    on_cancel()
            else:
                self._spawn(self._cancel_later(request_id, attach_seq, grace, on_cancel))
        except RedisError as exc:
            logger.error("request %s: cannot cancel after a disconnect: %s", request_id, exc)

    async def _cancel_later(
        self, request_id: str, attach_seq: int, grace: float, on_cancel: Callable[[], None] | None
    ) -> None:
        await asyncio.sleep(grace)
        try:
            raw = await self.redis.hget(self.keys.of(request_id).request(request_id), fields.ATTACH)
            current = RequestRecord.decode_fields((fields.ATTACH,), (raw,)).attach
            if (current or 0) == attach_seq:
                logger.info("request %s: client did not come back; cancelling", request_id)
                await self.cancel(request_id)
                if on_cancel:
                    on_cancel()
        except RedisError as exc:
            logger.error("request %s: cannot cancel after a disconnect: %s", request_id, exc)

    async def reattached(self, request_id: str) -> int:
        """A client came back for this request: count the attach, which keeps it running."""
        if self.config.disconnect_grace_s <= 0:
            return 0
        key = self.keys.of(request_id).request(request_id)
        return int(await self.redis.hincrby(key, fields.ATTACH, 1))

    def observe_queue_time(self, request_id: str, model: str) -> None:
        """Record queue time from the record's `created` and `started` (set by the worker)."""

        async def observe() -> None:
            try:
                names = (fields.CREATED, fields.STARTED)
                raw = await self.redis.hmget(self.keys.of(request_id).request(request_id), *names)
                times = RequestRecord.decode_fields(names, raw)
                if times.created and times.started:
                    wait = max(0.0, times.started - times.created)
                    self.metrics.request_queue_time.labels(model).observe(wait)
            except (RedisError, ValueError) as exc:
                logger.debug("request %s: no queue time: %s", request_id, exc)

        self._spawn(observe())

    def _spawn(self, coro) -> None:
        """Run `coro` in the background, kept referenced until done (cancelled on close)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm_up(self) -> None:
        """Load the configured models' tokenizers (and their numbers) now, not on a request."""
        for name in self.config.models:
            try:
                entry = await self.registry.get(name)
                # the bound that refuses hopelessly long prompts before tokenizing them
                await asyncio.to_thread(max_chars_per_token, entry.tokenizer)
            except (RequestError, RedisError, OSError) as exc:
                logger.warning("model %s not loaded yet: %s", name, exc)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.quotas.aclose()
        await self.feed.stop()
        self.cluster.close()
        await self.redis.aclose()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(RequestError(str(exc.detail), exc.status_code, code=code))


def create_app(
    config: IngressConfig | None = None,
    *,
    tokenizers: dict[str, Any] | None = None,
    redis: aioredis.Redis | None = None,
) -> Starlette:
    """The ingress ASGI app; `app.state.ingress` holds its shared state."""
    config = (config or load_config()).validate()
    ingress = Ingress(config, tokenizers, redis)
    app = Starlette(
        routes=ingress.routes(),
        middleware=[
            Middleware(RequestIdMiddleware, metrics=ingress.metrics),
            Middleware(BodyTimeoutMiddleware, timeout_s=config.body_timeout_s),
        ],
        # unexpected errors become OpenAI-shaped 500s in RequestIdMiddleware
        exception_handlers={HTTPException: _http_error},
        lifespan=ingress.lifespan,
    )
    app.state.ingress = ingress
    return app
