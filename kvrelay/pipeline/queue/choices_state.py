"""The state of a request answered by several choices (n, best_of, a list of prompts).

Its parent record req:{id} holds the request (model, prompt tokens, options, how many choices)
but not how far it has got: workers only ever write the choices' records req:{id}.{k}. Every
reader (GET /v1/requests/{id}, the producer client's status(), `kvrelay requests show`) and
every canceller combines and flags them the one way defined here; the combining is pure, the
reads are command programs (`commands.py`) run by the async (ingress, client) and the sync
(admin CLI) clients.
"""

from __future__ import annotations

import copy
from typing import Any

from kvrelay.core import record as fields
from kvrelay.core.enums import OPEN_STATUSES, FinishReason, RequestStatus
from kvrelay.core.keys import Keys
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.commands import Program, batch, call, run_async, run_sync
from kvrelay.pipeline.queue.field_ttl import field_ttl, field_ttl_sync
from kvrelay.pipeline.queue.progress import Progress

# the parent's fields that come from its choices; the others are the parent's own
COMBINED_FIELDS = (
    "status",
    "completion_tokens",
    "draft_tokens",
    "accepted_tokens",
    "emitted",
    "started",
    "updated",
    "finish_reason",
    "error",
)
_CANCEL_LUA = scripts.with_progress("cancel")
LIVE_LUA = scripts.with_progress("live")  # progress values with `emitted` counted to the tail
# how far a request has got, for the status of a parent whose choices are not all done
_PROGRESS = (RequestStatus.QUEUED, RequestStatus.PREFILLING, RequestStatus.DECODING)


def choice_id(request_id: str, choice: int) -> str:
    """The request id of choice `choice` of a request that asks for several."""
    return f"{request_id}.{choice}"


def cancel_ids(request_id: str, count: int) -> list[str]:
    """The ids a cancel flags: the request's, then each of its `count` choices'."""
    return [request_id, *(choice_id(request_id, k) for k in range(count))]


def combined_status(records: list[RequestRecord]) -> str:
    """One status for the request: while any choice is open, the furthest an open one has got;
    then failed if any failed, else cancelled if any was, else finished."""
    statuses = [r.status for r in records]
    open_ = [s for s in statuses if s in OPEN_STATUSES]
    if open_:
        return str(max(open_, key=lambda s: _PROGRESS.index(s) if s in _PROGRESS else 0))
    for status in (RequestStatus.FAILED, RequestStatus.CANCELLED):
        if status in statuses:
            return str(status)
    return str(RequestStatus.FINISHED)


def combine(parent: RequestRecord, records: list[RequestRecord]) -> RequestRecord:
    """The parent record with COMBINED_FIELDS from its choices: the status above, the summed
    completion tokens, draft and accepted tokens and emitted, the first start, the last
    update, and (once all ended) the first choice's finish reason; the first error."""
    out = copy.copy(parent)
    out.status = combined_status(records)
    out.completion_tokens = sum(r.completion_tokens or 0 for r in records)
    for name in ("draft_tokens", "accepted_tokens"):
        counts = [getattr(r, name) for r in records if getattr(r, name) is not None]
        setattr(out, name, sum(counts) if counts else None)
    emitted = [r.emitted for r in records if r.emitted is not None]
    out.emitted = sum(emitted) if emitted else None
    started = [r.started for r in records if r.started is not None]
    out.started = min(started) if started else None
    updated = [r.updated for r in records if r.updated is not None]
    out.updated = max([*updated, parent.updated or 0.0]) or None
    out.finish_reason = (
        records[0].finish_reason if records and all(r.ended for r in records) else None
    )
    errors = [r.error for r in records if r.error]
    out.error = errors[0] if errors else None
    return out


def choices_view(request_id: str, records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Each choice's public view, with its id `{id}.{k}`."""
    return [{"id": choice_id(request_id, k), **r.public()} for k, r in enumerate(records)]


def public_view(request_id: str, parent: RequestRecord, records: list[RequestRecord]) -> dict:
    """What clients see of a request of several choices: the combined parent's public fields
    and `choices`."""
    return {**combine(parent, records).public(), "choices": choices_view(request_id, records)}


def _count(value: Any) -> int:
    """A stored num_choices as an int (absent, empty or not a number: 0)."""
    text = as_str(value)
    return int(text) if text.isdigit() else 0


def live(record: RequestRecord, raw_progress: bytes | None) -> RequestRecord:
    """The record with the request's live token count: while it runs, its live progress
    (`LIVE_LUA`: counted to the end of its tail) says how many tokens went out (the record's
    `emitted` is written only at flushes and at the end)."""
    progress = Progress.parse(raw_progress)
    if progress is not None:
        record.emitted = record.completion_tokens = progress.emitted
    return record


def _decode(raw: list[Any], progress: list[Any]) -> list[RequestRecord]:
    return [
        live(RequestRecord.decode(r) or RequestRecord(), p)  # expired: empty
        for r, p in zip(raw, progress, strict=True)
    ]


def _read_choices(keys: Keys, request_id: str, count: int) -> Program[list[RequestRecord]]:
    """The records of the request's `count` choices, live (an expired one is empty)."""
    if count == 0:
        return []
    ids = [choice_id(request_id, k) for k in range(count)]
    shard = keys.of(request_id)  # a request's choices live on its shard
    reads = [call("hgetall", shard.request(one)) for one in ids]
    *raw, progress = yield batch([*reads, call("eval", LIVE_LUA, 1, shard.progress, *ids)])
    return _decode(raw, progress)


async def read_choices(redis: Any, keys: Keys, request_id: str, count: int) -> list[RequestRecord]:
    """_read_choices on an asyncio client (the ingress, the producer client)."""
    return await run_async(_read_choices(keys, request_id, count), redis)


def read_choices_sync(r: Any, keys: Keys, request_id: str, count: int) -> list[RequestRecord]:
    """_read_choices on a sync client (the admin CLI)."""
    return run_sync(_read_choices(keys, request_id, count), r)


async def request_view(redis: Any, keys: Keys, request_id: str) -> dict[str, Any] | None:
    """The public view of req:{id} (combined from its choices when it has several; live); None
    when unknown or expired (asyncio redis)."""
    shard = keys.of(request_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(shard.request(request_id))
        pipe.eval(LIVE_LUA, 1, shard.progress, request_id)
        raw, [progress] = await pipe.execute()
    parent = RequestRecord.decode(raw)
    if parent is None:
        return None
    if count := parent.num_choices or 0:
        return public_view(request_id, parent, await read_choices(redis, keys, request_id, count))
    return live(parent, progress).public()


async def cancel(redis: Any, keys: Keys, request_id: str) -> list[str]:
    """Set the cancel flag in the progress of the request and, for a request of several
    choices, of each choice (asyncio redis; lua/cancel.lua); the ids flagged (those still
    running: an ended request has no progress)."""
    keys = keys.of(request_id)
    count = await redis.hget(keys.request(request_id), fields.NUM_CHOICES)
    ids = cancel_ids(request_id, _count(count))
    flag = await field_ttl(redis)
    flagged = await redis.eval(_CANCEL_LUA, 1, keys.progress, flag, *ids)
    return [as_str(one) for one in flagged]


def cancel_sync(r: Any, keys: Keys, ids: list[str]) -> list[str]:
    """cancel() of the given ids for sync redis-py (the admin CLI)."""
    if not ids:
        return []
    shard = keys.of(ids[0])  # a request and its choices share a shard
    flagged = r.eval(_CANCEL_LUA, 1, shard.progress, field_ttl_sync(r), *ids)
    return [as_str(one) for one in flagged]


def _flagged(values: list[Any]) -> bool:
    return any((p := Progress.parse(v)) is not None and p.cancelled for v in values)


def _cancel_requested(keys: Keys, request_id: str, count: int) -> Program[bool]:
    """Whether the progress of the request (or of one of its `count` choices) carries the
    cancel flag; False once none has progress (ended)."""
    progress = keys.of(request_id).progress
    return _flagged((yield call("hmget", progress, cancel_ids(request_id, count))))


async def cancel_requested(redis: Any, keys: Keys, request_id: str, count: int = 0) -> bool:
    """_cancel_requested on an asyncio client."""
    return await run_async(_cancel_requested(keys, request_id, count), redis)


def cancel_requested_sync(r: Any, keys: Keys, request_id: str, count: int = 0) -> bool:
    """_cancel_requested on a sync client (the admin CLI)."""
    return run_sync(_cancel_requested(keys, request_id, count), r)


# how a request that a cancel reached ends: cancelled (a DELETE, a client gone), or failed with
# finish_reason timeout (a deadline)
_CANCEL_ENDS = (FinishReason.CANCELLED, FinishReason.TIMEOUT)


def cancel_ended(view: dict[str, Any]) -> bool:
    """Whether a request's public view (GET /v1/requests/{id}, `requests show`) says a cancel
    ended it, or one of its choices: the flag is gone with its progress once it ended, its end
    still tells."""
    views = view.get("choices") or [view]
    return any(
        v.get(fields.STATUS) == RequestStatus.CANCELLED
        or v.get(fields.FINISH_REASON) in _CANCEL_ENDS
        for v in views
    )
