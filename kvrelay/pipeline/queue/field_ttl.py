"""Whether the server expires hash fields (HSETEX: Valkey 9, Redis 8), probed once per process
and server: the progress fields get the record's time to live where it can, plain HSET (the
workers delete the field at the end) elsewhere."""

from __future__ import annotations

from typing import Any

from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.commands import Program, call, run_async, run_sync

_FLAGS: dict[tuple[Any, ...], str] = {}  # server -> "1" | "0"


def field_ttl_flag(reply: object) -> str:
    """The scripts' `ttl_fields` argument from the reply of `lua/field_ttl.lua`: "1" or "0"."""
    return "1" if reply in (1, b"1", "1") else "0"


def _server(client: Any) -> tuple[Any, ...]:
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a cluster client: one answer per client object (its nodes run alike)
        return ("client", id(client))
    kwargs = pool.connection_kwargs
    return (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db"))


def _probe(client: Any) -> Program[str]:
    """The scripts' `ttl_fields` argument for this client's server, "1" or "0" (asked once)."""
    server = _server(client)
    flag = _FLAGS.get(server)
    if flag is None:
        reply = yield call("eval", scripts.source("field_ttl"), 0)
        flag = _FLAGS[server] = field_ttl_flag(reply)
    return flag


async def field_ttl(redis: Any) -> str:
    """_probe on an asyncio client."""
    return await run_async(_probe(redis), redis)


def field_ttl_sync(r: Any) -> str:
    """_probe on a sync client (the workers, the admin CLI)."""
    return run_sync(_probe(r), r)


def set_progress_args(key: str, request_id: str, value: bytes, ttl_s: int, flag: str) -> list:
    """The command writing a fresh progress field with the record's time to live."""
    if flag == "1":
        return ["HSETEX", key, "EX", ttl_s, "FIELDS", 1, request_id, value]
    return ["HSET", key, request_id, value]
