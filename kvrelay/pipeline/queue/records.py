"""Reading the `req:{id}` record as stored (the typed public view: choices_state.request_view)."""

from __future__ import annotations

from typing import Any

from kvrelay.core.keys import Keys
from kvrelay.core.record import decode_strings


async def read_record_fields(redis: Any, keys: Keys, request_id: str) -> dict[str, str] | None:
    """`req:{id}` as stored (str -> str), or None when unknown or expired."""
    raw = await redis.hgetall(keys.of(request_id).request(request_id))
    return decode_strings(raw) if raw else None
