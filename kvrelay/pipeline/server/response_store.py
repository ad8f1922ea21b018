"""Stored Responses API answers (`store: true`), for GET /v1/responses/{id} and
`previous_response_id`: one hash `resp:{response_id}` per response, expiring with the request
record (`record_ttl_s`).

Fields: `response` (the response object as JSON: in progress from submission, final once the
ingress delivered its last token), `messages` (the conversation it answered, as chat messages:
the earlier turns and its input, without its instructions, which a later turn does not
inherit; function calls and their outputs as chat's `tool_calls` and `tool` messages),
`request_id`, `key_id` (the API key that created it; other keys see nothing), `session` (the
conversation's first response id, or its prompt_cache_key or user: the session whose pages
the store retains; written with the first copy, kept by the final one).

DELETE /v1/responses/{id} leaves a tombstone until the hash would have expired: `deleted` and
`key_id` only. Nothing writes over it (the final object of a response deleted in progress,
a reattached client's copy), so a deleted response stays deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvrelay.core.keys import Keys
from kvrelay.core.record import as_str
from kvrelay.pipeline.openai.responses_api import output_messages
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.redis_options import AsyncRedis

RESPONSE, MESSAGES, REQUEST_ID, KEY_ID = "response", "messages", "request_id", "key_id"
SESSION = "session"
DELETED = "deleted"


@dataclass(slots=True)
class StoredResponse:
    """One stored answer."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    request_id: str
    session: str = ""

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))

    def conversation(self) -> list[dict[str, Any]]:
        """The turns a follow-up continues: the messages answered, then the answer itself
        (its text and its function calls, as a chat assistant message's `tool_calls`)."""
        return [*self.messages, *output_messages(self.response.get("output") or [])]


class ResponseStore:
    """Reads and writes `resp:{id}` hashes."""

    def __init__(self, redis: AsyncRedis, keys: Keys, ttl_s: int):
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s

    async def save(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        request_id: str,
        key_id: str,
        session: str | None = None,
    ) -> None:
        """Write (or overwrite) the stored answer and restart its expiry; a deleted one stays
        deleted. `session` is written when given (the first copy)."""
        key = self.keys.of(response["id"]).response(response["id"])
        values = [
            RESPONSE,
            json.dumps(response, ensure_ascii=False),
            MESSAGES,
            json.dumps(messages, ensure_ascii=False),
            REQUEST_ID,
            request_id,
            KEY_ID,
            key_id,
            *((SESSION, session) if session else ()),
        ]
        await self.redis.eval(scripts.source("response_save"), 1, key, DELETED, self.ttl_s, *values)

    async def delete(self, response_id: str, key_id: str) -> bool:
        """Delete the stored answer; False when `key_id` has none by that id."""
        key = self.keys.of(response_id).response(response_id)
        script = scripts.source("response_delete")
        return bool(await self.redis.eval(script, 1, key, DELETED, KEY_ID, key_id))

    async def load(self, response_id: str, key_id: str) -> StoredResponse | None:
        """The stored answer, or None (unknown, expired, not stored, or another key's)."""
        raw = await self.redis.hgetall(self.keys.of(response_id).response(response_id))
        found = {as_str(k): as_str(v) for k, v in raw.items()}
        if not found or found.get(KEY_ID, "") != key_id or DELETED in found:
            return None
        try:
            response, messages = json.loads(found[RESPONSE]), json.loads(found[MESSAGES])
        except (KeyError, ValueError):
            return None
        return StoredResponse(response, messages, found.get(REQUEST_ID, ""), found.get(SESSION, ""))
