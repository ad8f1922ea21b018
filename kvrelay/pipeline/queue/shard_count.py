"""The one shard count of a stack: the first process writes it (shard 0's `shards` key, SET
NX); every process checks its own against it at start and refuses to run with another."""

from __future__ import annotations

from typing import Any

from kvrelay.core.config import ConfigError
from kvrelay.core.keys import Keys
from kvrelay.pipeline.queue.commands import Program, call, run_async, run_sync


class ShardCountError(ConfigError):
    """This process's shard count differs from the one its stack's Redis holds."""


def _checked(keys: Keys, stored: Any) -> int:
    found = int(stored) if stored not in (None, b"", "") else keys.shards
    if found != keys.shards:
        raise ShardCountError(
            f"this process has {keys.shards} pipeline shard(s) but the stack at this Redis "
            f"(prefix {keys.prefix!r}) runs {found}: set KVRELAY_SHARDS (or --shards) to {found} "
            f"for every process"
        )
    return found


def _check(keys: Keys) -> Program[int]:
    """Record this process's shard count when none is, else check it."""
    yield call("set", keys.shard_count, keys.shards, nx=True)
    return _checked(keys, (yield call("get", keys.shard_count)))


def check_shard_count_sync(r: Any, keys: Keys) -> int:
    """_check on a sync client (the workers)."""
    return run_sync(_check(keys), r)


async def check_shard_count(redis: Any, keys: Keys) -> int:
    """_check on an asyncio client (the ingress, the producer client)."""
    return await run_async(_check(keys), redis)


def stored_shard_count(r: Any, keys: Keys) -> int | None:
    """The shard count the stack's Redis holds (None before any process started), for the
    admin commands."""
    raw = r.get(keys.shard_count)
    return int(raw) if raw not in (None, b"", "") else None
