"""Per-API-key quotas, as OpenAI's rate limits: requests and tokens per minute, requests open.

One script (`lua/quota.lua`) checks every limit of a key and takes what the request uses in
one step, on the server's clock, so the limits are exact across any number of ingress
processes; a request over any limit takes nothing. Each per-minute limit counts in a fixed
window that opens with the first request counted in it and ends a minute later (its counter's
expiry): a refused request is told exactly when its window ends, and a retry then finds the
window reset. An open request holds a unit (a member of a sorted set scored by when it lapses)
from admission until its reply ends; a unit whose ingress died lapses by itself. Every key of
one API key has that key's own hash tag (`Keys.quota_*`): one slot on a Valkey Cluster.

What a quota answers becomes OpenAI's headers (`x-ratelimit-limit-requests`, `...-remaining-`,
`...-reset-`, the same for tokens; resets as Go durations, "1m0s", "250ms") and, refused, a
429 of type "requests" or "tokens", code "rate_limit_exceeded", with `Retry-After` (whole
seconds, rounded up) and `retry-after-ms`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass

from redis.exceptions import RedisError

from kvrelay.core.keys import Keys
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.redis_options import AsyncRedis

logger = logging.getLogger(__name__)

WINDOW_MS = 60_000  # the per-minute limits' window
HOLD_GRACE_S = 60.0  # a unit lapses this long after its request's deadline
REFUSED_REQUESTS, REFUSED_TOKENS, TOO_LARGE, REFUSED_OPEN = 1, 2, 4, 8
_QUOTA_LUA = scripts.source("quota")


@dataclass(frozen=True, slots=True)
class Limits:
    """One API key's limits (0: none)."""

    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


@dataclass(frozen=True, slots=True)
class QuotaState:
    """What the quota script answered for one request: what refused it (bits, 0: admitted)
    and the key's counts after it (before it, when refused)."""

    limits: Limits
    asked: int  # the request's tokens: prompt + max_tokens of each choice
    refused: int
    requests: int  # counted in the current window
    requests_reset_ms: int  # until that window ends (0: none is open)
    tokens: int
    tokens_reset_ms: int
    open: int  # requests open now

    @property
    def admitted(self) -> bool:
        return self.refused == 0

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers of the key's per-minute limits (none without)."""
        out: dict[str, str] = {}
        for name, limit, used, reset_ms in (
            ("requests", self.limits.rpm, self.requests, self.requests_reset_ms),
            ("tokens", self.limits.tpm, self.tokens, self.tokens_reset_ms),
        ):
            if limit:
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(max(0, limit - used))
                out[f"x-ratelimit-reset-{name}"] = go_duration(reset_ms)
        return out

    def error(self, key_name: str, retry_after_s: int) -> RequestError:
        """The 429 of a refused request (`retry_after_s`: when a full concurrency limit is
        worth trying again; a unit frees when a request ends, which no one can foresee)."""
        who = f"key {key_name!r}" if key_name else "this key"
        waits: list[int] = []  # ms, of each limit that refused it
        limits = self.limits
        if self.refused & TOO_LARGE:
            message = (
                f"Request too large for {who} on tokens per min (TPM): Limit {limits.tpm}, "
                f"Requested {self.asked}. The input or output tokens must be reduced in order "
                "to run successfully."
            )
            return _rate_limited(message, "tokens", None)
        parts: list[str] = []
        kind = ""
        if self.refused & REFUSED_REQUESTS:
            kind = "requests"
            waits.append(self.requests_reset_ms)
            parts.append(
                f"requests per min (RPM): Limit {limits.rpm}, Used {self.requests}, Requested 1"
            )
        if self.refused & REFUSED_TOKENS:
            kind = kind or "tokens"
            waits.append(self.tokens_reset_ms)
            parts.append(
                f"tokens per min (TPM): Limit {limits.tpm}, Used {self.tokens}, "
                f"Requested {self.asked}"
            )
        if self.refused & REFUSED_OPEN:
            kind = kind or "requests"
            waits.append(retry_after_s * 1000)
            parts.append(f"concurrent requests: Limit {limits.max_concurrent}, Open {self.open}")
        wait_ms = max(waits)
        message = (
            f"Rate limit reached for {who} on {'; and on '.join(parts)}. "
            f"Please try again in {go_duration(wait_ms)}."
        )
        return _rate_limited(message, kind, wait_ms)


def _rate_limited(message: str, kind: str, wait_ms: int | None) -> RequestError:
    headers = {}
    if wait_ms is not None:
        headers = {"Retry-After": str(math.ceil(wait_ms / 1000)), "retry-after-ms": str(wait_ms)}
    return RequestError(message, 429, type=kind, code="rate_limit_exceeded", headers=headers)


def go_duration(ms: int) -> str:
    """`ms` as Go prints a duration (OpenAI's reset headers): "0s", "250ms", "1.5s", "6m0s",
    "1h0m0s"."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    text = f"{seconds}" + (f".{millis:03d}".rstrip("0") if millis else "") + "s"
    if hours or minutes:
        text = f"{minutes}m" + text
    if hours:
        text = f"{hours}h" + text
    return text


def new_unit(request_id: str) -> str:
    """The sorted-set member of one request's concurrency unit: unique even when two requests
    give the same X-Request-Id."""
    return f"{request_id}/{uuid.uuid4().hex[:16]}"


class Quotas:
    """The quota script and the giving back of units, for one ingress process."""

    def __init__(self, redis: AsyncRedis, keys: Keys, hold_s: float):
        self.redis, self.keys = redis, keys
        self.hold_ms = math.ceil(hold_s * 1000)  # a unit lapses this long after admission
        self._take = redis.register_script(_QUOTA_LUA)
        self._releasing: set[asyncio.Task] = set()

    async def take(self, key_id: str, limits: Limits, tokens: int, unit: str) -> QuotaState:
        """Check every limit of the key and, when none refuses, count the request, its
        `tokens` and (with a concurrency limit) hold `unit`."""
        keys = self.keys
        reply = await self._take(
            keys=[
                keys.quota_requests(key_id),
                keys.quota_tokens(key_id),
                keys.quota_open(key_id),
            ],
            args=[
                limits.rpm,
                limits.tpm,
                limits.max_concurrent,
                tokens,
                WINDOW_MS,
                unit,
                self.hold_ms,
            ],
        )
        refused, requests, req_ms, used, tok_ms, open_ = (int(v) for v in reply)
        return QuotaState(limits, tokens, refused, requests, req_ms, used, tok_ms, open_)

    async def release(self, key_id: str, unit: str) -> None:
        """Give back a request's unit (it lapses by itself when Redis cannot be reached)."""
        try:
            await self.redis.zrem(self.keys.quota_open(key_id), unit)
        except RedisError as exc:
            logger.warning("request %s: cannot give back its quota unit: %s", unit, exc)

    def release_soon(self, key_id: str, unit: str) -> None:
        """release() from synchronous code (a reply that ended), on the running loop."""
        task = asyncio.get_running_loop().create_task(self.release(key_id, unit))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def aclose(self) -> None:
        """Wait for the units being given back (at shutdown, before Redis is closed)."""
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=2.0)
