"""Whether the server expires hash fields (HSETEX: Valkey 9, Redis 8), probed once per process
and server: the progress fields get the record's time to live where it can, plain HSET (the
workers delete the field at the end) elsewhere."""

from __future__ import annotations

from typing import Any

from kvrelay.pipeline.queue import scripts

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


async def field_ttl(redis: Any) -> str:
    """The scripts' `ttl_fields` argument for this server, "1" or "0" (asyncio redis)."""
    server = _server(redis)
    flag = _FLAGS.get(server)
    if flag is None:
        flag = _FLAGS[server] = field_ttl_flag(await redis.eval(scripts.source("field_ttl"), 0))
    return flag


def field_ttl_sync(r: Any) -> str:
    """field_ttl() for sync redis-py (the admin CLI)."""
    server = _server(r)
    flag = _FLAGS.get(server)
    if flag is None:
        flag = _FLAGS[server] = field_ttl_flag(r.eval(scripts.source("field_ttl"), 0))
    return flag


def set_progress_args(key: str, request_id: str, value: bytes, ttl_s: int, flag: str) -> list:
    """The command writing a fresh progress field with the record's time to live."""
    if flag == "1":
        return ["HSETEX", key, "EX", ttl_s, "FIELDS", 1, request_id, value]
    return ["HSET", key, request_id, value]
