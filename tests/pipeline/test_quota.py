"""Per-key quotas on a real Valkey (queue/quota.py, lua/quota.lua): exact counts, windows on
the server's clock, nothing taken by a refused request, units that lapse, one slot each."""

from __future__ import annotations

import asyncio
import math

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from kvrelay.core.keys import Keys
from kvrelay.pipeline.queue.quota import (
    REFUSED_OPEN,
    REFUSED_REQUESTS,
    REFUSED_TOKENS,
    TOO_LARGE,
    WINDOW_MS,
    Limits,
    Quotas,
    QuotaState,
    go_duration,
)
from tests.pipeline.ingress_support import unique_prefix

pytestmark = pytest.mark.anyio

KEY = "0123456789abcdef"


@pytest.fixture
async def quotas(valkey_session):
    client = aioredis.Redis.from_url(valkey_session.url)
    q = Quotas(client, Keys(unique_prefix()), hold_s=30)
    yield q
    await client.aclose()


def test_go_durations():
    assert [go_duration(ms) for ms in (0, -5, 1, 999, 1000, 1500, 59_999, 60_000)] == [
        "0s", "0s", "1ms", "999ms", "1s", "1.5s", "59.999s", "1m0s",
    ]  # fmt: skip
    assert go_duration(360_000) == "6m0s"
    assert go_duration(86_400) == "1m26.4s"
    assert go_duration(3_600_000) == "1h0m0s" and go_duration(3_661_250) == "1h1m1.25s"


def test_quota_keys_share_one_slot_of_their_own():
    keys = Keys("kvrelay:", shards=4)
    names = [keys.quota_requests(KEY), keys.quota_tokens(KEY), keys.quota_open(KEY)]
    assert names == [
        "{kvrelay.quota.0123456789abcdef}:requests",
        "{kvrelay.quota.0123456789abcdef}:tokens",
        "{kvrelay.quota.0123456789abcdef}:open",
    ]
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert all(k.at(s).quota_open(KEY) == names[2] for k in [keys] for s in range(4))
    assert key_slot(Keys("kvrelay:").quota_open("fedcba9876543210").encode()) != key_slot(
        names[0].encode()
    )


async def test_requests_per_minute_exact_and_refusals_take_nothing(quotas):
    limits = Limits(rpm=3)
    states = [await quotas.take(KEY, limits, 10, f"u{i}") for i in range(5)]
    assert [s.refused for s in states] == [0, 0, 0, REFUSED_REQUESTS, REFUSED_REQUESTS]
    assert [s.requests for s in states] == [1, 2, 3, 3, 3]
    # the window opened with the first request, on the server's clock
    assert states[0].requests_reset_ms == WINDOW_MS
    assert all(0 < s.requests_reset_ms <= WINDOW_MS for s in states)
    assert [s.headers()["x-ratelimit-remaining-requests"] for s in states] == list("21000")
    assert states[0].headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "1m0s",
    }
    r = quotas.redis
    assert await r.get(quotas.keys.quota_requests(KEY)) == b"3"
    # no tokens limit: not counted, no open units without a concurrency limit
    assert await r.exists(quotas.keys.quota_tokens(KEY), quotas.keys.quota_open(KEY)) == 0


async def test_the_window_ends_at_its_expiry_and_the_retry_is_told_exactly(quotas):
    limits = Limits(rpm=1)
    await quotas.take(KEY, limits, 1, "a")
    r, name = quotas.redis, quotas.keys.quota_requests(KEY)
    await r.pexpire(name, 300)  # the window's end, 300 ms from now
    refused = await quotas.take(KEY, limits, 1, "b")
    left = refused.requests_reset_ms
    assert refused.refused == REFUSED_REQUESTS and 0 < left <= 300
    err = refused.error("alice", retry_after_s=1)
    assert err.status == 429 and err.headers == {"Retry-After": "1", "retry-after-ms": str(left)}
    assert err.body() == {
        "error": {
            "message": "Rate limit reached for key 'alice' on requests per min (RPM): Limit 1, "
            f"Used 1, Requested 1. Please try again in {left}ms.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    await asyncio.sleep(left / 1000 + 0.05)
    again = await quotas.take(KEY, limits, 1, "c")
    assert (again.refused, again.requests, again.requests_reset_ms) == (0, 1, WINDOW_MS)


async def test_tokens_per_minute(quotas):
    limits = Limits(tpm=100)
    first = await quotas.take(KEY, limits, 60, "a")
    assert (first.refused, first.tokens) == (0, 60)
    assert first.headers() == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "40",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    over = await quotas.take(KEY, limits, 41, "b")
    assert (over.refused, over.tokens) == (REFUSED_TOKENS, 60)
    err = over.error("", 1)
    assert err.type == "tokens" and err.code == "rate_limit_exceeded"
    assert err.message.startswith(
        "Rate limit reached for this key on tokens per min (TPM): Limit 100, Used 60, "
        "Requested 41. Please try again in "
    )
    wait = over.tokens_reset_ms
    assert err.headers == {"Retry-After": str(math.ceil(wait / 1000)), "retry-after-ms": str(wait)}
    assert 59_000 < wait <= WINDOW_MS
    exact = await quotas.take(KEY, limits, 40, "c")
    assert (exact.refused, exact.tokens, exact.headers()["x-ratelimit-remaining-tokens"]) == (
        0,
        100,
        "0",
    )
    # more than the limit itself: refused whatever was used, with no time that would help
    await quotas.redis.delete(quotas.keys.quota_tokens(KEY))
    huge = await quotas.take(KEY, limits, 101, "d")
    assert (huge.refused, huge.tokens, huge.tokens_reset_ms) == (TOO_LARGE, 0, 0)
    assert huge.headers()["x-ratelimit-reset-tokens"] == "0s"
    err = huge.error("bob", 1)
    assert err.headers == {} and err.type == "tokens"
    assert err.message == (
        "Request too large for key 'bob' on tokens per min (TPM): Limit 100, Requested 101. "
        "The input or output tokens must be reduced in order to run successfully."
    )


async def test_a_request_refused_by_one_limit_takes_from_none(quotas):
    limits = Limits(rpm=10, tpm=100, max_concurrent=5)
    await quotas.take(KEY, limits, 90, "a")
    refused = await quotas.take(KEY, limits, 20, "b")
    assert refused == QuotaState(limits, 20, REFUSED_TOKENS, 1, refused.requests_reset_ms, 90,
                                 refused.tokens_reset_ms, 1)  # fmt: skip
    r, keys = quotas.redis, quotas.keys
    assert await r.get(keys.quota_requests(KEY)) == b"1"
    assert await r.zrange(keys.quota_open(KEY), 0, -1) == [b"a"]


async def test_concurrency_units_released_and_lapsed(quotas):
    limits = Limits(max_concurrent=2)
    r, open_key = quotas.redis, quotas.keys.quota_open(KEY)
    assert [(await quotas.take(KEY, limits, 1, u)).open for u in "ab"] == [1, 2]
    full = await quotas.take(KEY, limits, 1, "c")
    assert (full.refused, full.open, full.headers()) == (REFUSED_OPEN, 2, {})
    err = full.error("carol", retry_after_s=2)
    assert err.type == "requests" and err.headers == {"Retry-After": "2", "retry-after-ms": "2000"}
    assert "on concurrent requests: Limit 2, Open 2" in err.message
    last = (await r.zrange(open_key, -1, -1, withscores=True))[0][1]
    # the key lives as long as its last unit
    assert await r.execute_command("PEXPIRETIME", open_key) == int(last)
    quotas.release_soon(KEY, "a")
    await quotas.aclose()
    assert await r.zrange(open_key, 0, -1) == [b"b"]
    assert (await quotas.take(KEY, limits, 1, "c")).open == 2
    # an ingress that died never gives "b" back: it lapses at its score
    await r.zadd(open_key, {"b": 1})
    assert (await quotas.take(KEY, limits, 1, "d")).open == 2
    assert sorted(await r.zrange(open_key, 0, -1)) == [b"c", b"d"]


async def test_several_limits_refusing_say_the_longest_wait(quotas):
    limits = Limits(rpm=1, tpm=10, max_concurrent=1)
    await quotas.take(KEY, limits, 5, "a")
    r, keys = quotas.redis, quotas.keys
    await r.pexpire(keys.quota_requests(KEY), 2500)
    await r.pexpire(keys.quota_tokens(KEY), 4200)
    refused = await quotas.take(KEY, limits, 6, "b")
    assert refused.refused == REFUSED_REQUESTS | REFUSED_TOKENS | REFUSED_OPEN
    err = refused.error("x", retry_after_s=1)
    assert err.type == "requests"
    wait = int(err.headers["retry-after-ms"])
    assert wait == refused.tokens_reset_ms and 4000 < wait <= 4200
    assert err.headers["Retry-After"] == "5"
    assert "requests per min (RPM)" in err.message and "; and on tokens per min" in err.message


async def test_quota_on_a_cluster(shared_cluster):
    client = RedisCluster.from_url(shared_cluster.url)
    try:
        q = Quotas(client, Keys("kvrelay:", shards=3), hold_s=5)
        limits = Limits(rpm=2, tpm=50, max_concurrent=1)
        first = await q.take(KEY, limits, 20, "u1")
        assert (first.refused, first.requests, first.tokens, first.open) == (0, 1, 20, 1)
        second = await q.take(KEY, limits, 20, "u2")
        assert second.refused == REFUSED_OPEN
        await q.release(KEY, "u1")
        third = await q.take(KEY, limits, 20, "u3")
        assert (third.refused, third.requests, third.tokens) == (0, 2, 40)
        assert (await q.take(KEY, Limits(rpm=2), 1, "u4")).refused == REFUSED_REQUESTS
    finally:
        await client.aclose()
