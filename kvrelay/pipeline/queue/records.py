"""Reading the `req:{id}` record through its one typed view (for the ingress and the client)."""

from __future__ import annotations

from typing import Any

from kvrelay.core.keys import Keys
from kvrelay.core.record import RequestRecord, decode_strings


async def read_record(redis: Any, keys: Keys, request_id: str) -> RequestRecord | None:
    """The typed `req:{id}`, or None when unknown or expired (asyncio redis client)."""
    return RequestRecord.decode(await redis.hgetall(keys.request(request_id)))


async def read_record_fields(redis: Any, keys: Keys, request_id: str) -> dict[str, str] | None:
    """`req:{id}` as stored (str -> str), or None when unknown or expired."""
    raw = await redis.hgetall(keys.request(request_id))
    return decode_strings(raw) if raw else None
