"""Reading the usage counters the step script keeps (`core.usage`, `lua/usage.lua`): every
shard's hour hashes of a time range (`kvrelay usage`) or its total hash (the ingress's
/metrics), summed per account. One command program each, for the sync and asyncio clients."""

from __future__ import annotations

from typing import Any

from kvrelay.core.keys import Keys
from kvrelay.core.usage import PERIOD_S, Usage, merge, parse_hash, period_start
from kvrelay.pipeline.queue.commands import Program, batch, call, run_async, run_sync

Accounts = dict[tuple[str, str, str], Usage]


def hours(since: float, until: float) -> list[int]:
    """The starts of the hours whose hashes cover [since, until): from the hour `since` falls
    in to the last that starts before `until` (usage is kept per hour, so a range is
    widened to whole hours)."""
    return list(range(period_start(since), int(until), PERIOD_S)) if until > since else []


def _read(names: list[str]) -> Program[Accounts]:
    if not names:
        return {}
    replies = yield batch([call("hgetall", name) for name in names])
    return merge(parse_hash(raw) for raw in replies)


def _period_names(keys: Keys, since: float, until: float) -> list[str]:
    return [shard.usage(start) for shard in keys.all() for start in hours(since, until)]


def read_period(r: Any, keys: Keys, since: float, until: float) -> Accounts:
    """Every shard's counts of the hours covering [since, until), per account (sync)."""
    return run_sync(_read(_period_names(keys, since, until)), r)


def read_total_sync(r: Any, keys: Keys) -> Accounts:
    """Every shard's counts since it began, per account (sync)."""
    return run_sync(_read([shard.usage_total for shard in keys.all()]), r)


async def read_total(redis: Any, keys: Keys) -> Accounts:
    """Every shard's counts since it began, per account (asyncio: the ingress's /metrics)."""
    return await run_async(_read([shard.usage_total for shard in keys.all()]), redis)
