"""Building and queueing requests: the one code path shared by the ingress and the client.

prompt (messages | text | token ids) -> token ids -> length and sampling checks -> route ->
one Lua script that creates `req:{id}` (refusing an id that exists) and XADDs the PrefillTask
or DecodeTask, so a request is either fully queued or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from kvrelay.pipeline.errors import RequestError, bad_request, context_length_exceeded
from kvrelay.pipeline.keys import Keys
from kvrelay.pipeline.messages import DecodeTask, PrefillTask
from kvrelay.pipeline.model_registry import ModelEntry, ModelRegistry
from kvrelay.pipeline.openai_protocol import GenerationRequest
from kvrelay.pipeline.route import DECODE, Route, Router
from kvrelay.pipeline.sampling import InvalidSamplingParams, SamplingParams

logger = logging.getLogger(__name__)

_INLINE_TOKENIZE_CHARS = 16384
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# KEYS: req:{id}, work stream. ARGV: ttl, payload, field/value pairs.
# Returns the new entry id, or false when req:{id} already exists (a duplicate submission).
_SUBMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return redis.call('XADD', KEYS[2], '*', 'm', ARGV[2])
"""


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


@dataclass(slots=True)
class Submission:
    """A request ready to queue: tokenized, checked, with its sampling parameters complete."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str = ""
    arrival_time: float = field(default_factory=time.time)
    deadline: float | None = None
    detokenize: bool = True


def build_task(sub: Submission, route: Route) -> PrefillTask | DecodeTask:
    """The wire message for the first stage of `route`."""
    common = dict(
        request_id=sub.request_id,
        model=sub.model,
        prompt_token_ids=list(sub.prompt_token_ids),
        sampling=sub.sampling.to_dict(),
        cache_salt=sub.cache_salt,
        arrival_time=sub.arrival_time,
        deadline=sub.deadline,
        num_cached_tokens=route.cached_tokens,
        detokenize=sub.detokenize,
    )
    if route.stage == DECODE:
        return DecodeTask(**common, num_stored_pages=route.cached_pages, prefilled=False)
    return PrefillTask(**common)


def tokenize(
    model: ModelEntry,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
) -> list[int]:
    """Prompt token ids: chat template for messages, plain encoding for text, ids as given."""
    from kvrelay.pipeline.tokenizer import ChatTemplateError

    if messages is not None:
        try:
            return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc
    if prompt is not None:
        # Like vLLM's completions: special tokens (a BOS, for models that use one) are added.
        ids = model.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        return ids
    if not prompt_token_ids:
        raise bad_request("a prompt is required", param="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} is outside the vocabulary (size {model.vocab_size})",
            param="prompt",
            code="invalid_token_id",
        )
    return list(prompt_token_ids)


def check_lengths(
    model: ModelEntry,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    max_prompt_tokens: int,
    max_tokens_limit: int,
    param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> None:
    """Refuse prompts or max_tokens that cannot fit; fill max_tokens when not given."""
    n = len(prompt_ids)
    limit = model.max_model_len
    if n > max_prompt_tokens:
        raise RequestError(
            f"the prompt has {n} tokens, more than this server accepts ({max_prompt_tokens})",
            400,
            param=param,
            code="context_length_exceeded",
        )
    if n >= limit:
        raise context_length_exceeded(limit, n, 1, param)
    if sampling.max_tokens is None:
        sampling.max_tokens = min(max_tokens_limit, limit - n)
    elif sampling.max_tokens > max_tokens_limit:
        raise bad_request(
            f"{max_tokens_param} must be at most {max_tokens_limit}, got {sampling.max_tokens}",
            param=max_tokens_param,
        )
    elif n + sampling.max_tokens > limit:
        raise context_length_exceeded(limit, n, sampling.max_tokens, param)


class Producer:
    """Prepares and queues requests for the ingress and the producer client alike."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        registry: ModelRegistry,
        router: Router,
        *,
        max_prompt_tokens: int = 32768,
        max_tokens_limit: int = 4096,
        timeout_s: float | None = 600.0,
        record_ttl_s: int = 86400,
    ):
        self.redis, self.keys, self.registry, self.router = redis, keys, registry, router
        self.max_prompt_tokens, self.max_tokens_limit = max_prompt_tokens, max_tokens_limit
        self.timeout_s, self.record_ttl_s = timeout_s, record_ttl_s
        self._submit = redis.register_script(_SUBMIT_LUA)

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
        detokenize: bool = True,
        max_tokens_param: str = "max_tokens",
    ) -> tuple[Submission, ModelEntry]:
        """Tokenize and check one request; raise RequestError when it cannot be served."""
        entry = await self.registry.get(model)
        size = len(prompt or "") + sum(len(str(m.get("content", ""))) for m in messages or ())
        args = dict(messages=messages, prompt=prompt, prompt_token_ids=prompt_token_ids)
        if size > _INLINE_TOKENIZE_CHARS:  # milliseconds of work: keep the event loop free
            ids = await asyncio.to_thread(tokenize, entry, **args)
        else:
            ids = tokenize(entry, **args)
        check_lengths(
            entry,
            ids,
            sampling,
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens_limit=self.max_tokens_limit,
            param="messages" if messages is not None else "prompt",
            max_tokens_param=max_tokens_param,
        )
        try:
            sampling.validate(entry.vocab_size)
        except InvalidSamplingParams as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        now = time.time()
        deadline = now + self.timeout_s if self.timeout_s else None
        sub = Submission(request_id, model, ids, sampling, cache_salt, now, deadline, detokenize)
        return sub, entry

    async def prepare_parsed(
        self, parsed: GenerationRequest, *, request_id: str, detokenize: bool = True
    ) -> tuple[Submission, ModelEntry]:
        """prepare() for a parsed OpenAI body (the ingress and the producer client)."""
        return await self.prepare(
            parsed.model,
            parsed.sampling,
            request_id=request_id,
            messages=parsed.messages,
            prompt=parsed.prompt,
            prompt_token_ids=parsed.prompt_token_ids,
            cache_salt=parsed.cache_salt,
            detokenize=detokenize,
            max_tokens_param=parsed.max_tokens_param,
        )

    async def enqueue(
        self, sub: Submission, entry: ModelEntry, record: dict[str, Any] | None = None
    ) -> Route | None:
        """Route and queue `sub`; None when a request with this id already exists."""
        route = await self.router.route(entry, sub.prompt_token_ids, sub.cache_salt)
        task = build_task(sub, route)
        stream = self.keys.decode_stream if route.stage == DECODE else self.keys.prefill_stream
        fields: dict[str, Any] = {
            "status": "queued",
            "stage": route.stage,
            "model": sub.model,
            "created": f"{sub.arrival_time:.6f}",
            "updated": f"{time.time():.6f}",
            "prompt_tokens": len(sub.prompt_token_ids),
            "completion_tokens": 0,
            "cached_tokens": route.cached_tokens,
            "deadline": "" if sub.deadline is None else f"{sub.deadline:.3f}",
        }
        for key, value in (record or {}).items():
            plain = isinstance(value, str | int | float) and not isinstance(value, bool)
            fields[key] = value if plain else json.dumps(value)
        flat: list[Any] = []
        for key, value in fields.items():
            flat += [key, value]
        entry_id = await self._submit(
            keys=[self.keys.request(sub.request_id), stream],
            args=[self.record_ttl_s, task.encode(), *flat],
        )
        if not entry_id:
            return None
        logger.info(
            "request %s queued to %s (%d prompt tokens, %d cached: %s)",
            sub.request_id,
            route.stage,
            len(sub.prompt_token_ids),
            route.cached_tokens,
            route.reason,
        )
        return route
