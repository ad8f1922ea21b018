"""The dead-letter stream for the admin CLI: list, show, replay (refusing poison), purge.

Each pipeline shard has its own `dlq` (an entry stays with its request's shard); these read
and change every shard's, an entry found by its id in whichever holds it."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, cast

import redis

from kvrelay.core.dead_letter import DeadLetter
from kvrelay.core.enums import RequestStatus
from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask, MessageError, PrefillTask
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.pipeline.queue.field_ttl import field_ttl_sync, set_progress_args
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.replies import StreamEntry

logger = logging.getLogger(__name__)

# The reason workers.reader gives an entry struck out by strikes.lua (docs/reliability.md):
# MAX_DELIVERIES of its holders died running it before it made progress.
POISON_REASON = re.compile(
    r"delivered \d+ times, \d+ times its holder died running it without progress"
)


# the progress's time to live when the record has none (the submit scripts' default)
DEFAULT_RECORD_TTL_S = 86400


class NotReplayable(KvrelayError, ValueError):
    """A DLQ entry that cannot go back on a stream (no payload, unknown stream)."""


class ReplayRefused(KvrelayError, ValueError):
    """A DLQ entry that would fail again (poison, or a payload that is no task) without force."""


@dataclass(slots=True)
class Replayed:
    """What a replay did: the entry, its request, where it went and why it had failed."""

    dlq_id: str
    new_id: str
    stream: str
    request_id: str
    reason: str
    kind: str  # poison | invalid | other
    forced: bool

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _task(payload: bytes, stream: str, keys: Keys) -> PrefillTask | DecodeTask | None:
    where = keys.stream_pipeline(stream)  # a model pipeline's streams too
    cls = DecodeTask if where is not None and where[0] == DECODE_GROUP else PrefillTask
    try:
        return cls.decode(payload)
    except MessageError:
        return None


def kind_of(reason: str, payload: bytes, stream: str, keys: Keys) -> str:
    """`poison` (struck out by strikes), `invalid` (the payload is no task), else `other`."""
    if POISON_REASON.search(reason):
        return "poison"
    return "invalid" if _task(payload, stream, keys) is None else "other"


SHARD_SEP = "@"  # `<entry id>@<shard>`: a DLQ entry's id once there are several shards


class AmbiguousEntry(KvrelayError, ValueError):
    """An entry id without its shard that several shards' DLQs hold (ids are per stream)."""


def dlq_ref(entry_id: str, shard: Keys) -> str:
    """A DLQ entry as `dlq ls` shows it and `show`/`replay` take it: its stream entry id, with
    `@<shard>` when there are several shards (two shards' DLQs can hold the same entry id)."""
    return entry_id if shard.shards == 1 else f"{entry_id}{SHARD_SEP}{shard.shard}"


def _id_order(letter: DeadLetter) -> tuple[int, int, int]:
    entry_id, _, shard = letter.dlq_id.partition(SHARD_SEP)
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0), int(shard or 0)


def entries(r: redis.Redis, keys: Keys, limit: int = 100) -> list[DeadLetter]:
    """Oldest-first DLQ entries of every shard (ids `dlq_ref`)."""
    out: list[DeadLetter] = []
    for shard in keys.all():
        rows = cast("list[StreamEntry]", r.xrange(shard.dlq, count=limit))
        for eid, fields in rows:
            letter = DeadLetter.decode(eid, fields)
            out.append(replace(letter, dlq_id=dlq_ref(letter.dlq_id, shard)))
    return sorted(out, key=_id_order)[:limit] if keys.shards > 1 else out


def _read(r: redis.Redis, keys: Keys, dlq_id: str) -> tuple[DeadLetter, Keys] | None:
    """The entry (its stream entry id in `dlq_id`) and the keys of the shard whose DLQ holds
    it: the shard `dlq_id` names (`<entry id>@<shard>`), else the one shard that holds such
    an entry (AmbiguousEntry when several do)."""
    entry_id, sep, shard_text = dlq_id.partition(SHARD_SEP)
    if sep:
        shard = int(shard_text)
        if not 0 <= shard < keys.shards:
            return None
        candidates = [keys.at(shard)]
    else:
        candidates = keys.all()
    found: list[tuple[DeadLetter, Keys]] = []
    for shard_keys in candidates:
        rows = cast("list[StreamEntry]", r.xrange(shard_keys.dlq, min=entry_id, max=entry_id))
        if rows:
            found.append((DeadLetter.decode(*rows[0]), shard_keys))
    if len(found) > 1:
        where = ", ".join(dlq_ref(entry_id, k) for _, k in found)
        raise AmbiguousEntry(f"DLQ entry {entry_id} is on several shards: name one ({where})")
    return found[0] if found else None


def entry(r: redis.Redis, keys: Keys, dlq_id: str) -> dict[str, Any] | None:
    """One DLQ entry's JSON view with its payload decoded when it is a valid task, and its kind."""
    found = _read(r, keys, dlq_id)
    if found is None:
        return None
    letter, keys = found
    out = replace(letter, dlq_id=dlq_ref(letter.dlq_id, keys)).public()
    for cls in (PrefillTask, DecodeTask):
        try:
            out["task"] = cls.decode(letter.payload).to_dict()
            break
        except MessageError:
            continue
    else:
        out["payload_hex"] = letter.payload[:512].hex()
    out["kind"] = kind_of(letter.reason, letter.payload, letter.stream, keys)
    return out


def replay(r: redis.Redis, keys: Keys, dlq_id: str, force: bool = False) -> Replayed | None:
    """Put a dead-lettered entry back on its stream as a fresh request; None if no such entry.

    Poison (it killed every holder) and payloads that are no task would only come back here:
    both are refused (`ReplayRefused`) unless `force`.
    """
    found = _read(r, keys, dlq_id)
    if found is None:
        return None
    letter, keys = found  # its shard: the request's keys and streams are there
    stream = letter.stream or keys.prefill_stream
    if keys.stream_pipeline(stream) is None:  # any model pipeline's work stream
        raise NotReplayable(f"DLQ entry {dlq_id} names an unknown stream {stream!r}")
    payload, reason = letter.payload, letter.reason
    if not payload:  # the entry arrived without `m`: nothing to run again
        raise NotReplayable(f"DLQ entry {dlq_id} has no payload to replay (purge it instead)")
    kind = kind_of(reason, payload, stream, keys)
    if kind != "other" and not force:
        why = (
            "was dead-lettered as poison (it killed or wedged every worker that took it)"
            if kind == "poison"
            else "holds a payload that is not a valid task (it would be dead-lettered again)"
        )
        raise ReplayRefused(f"DLQ entry {dlq_id} {why}: {reason}; replay it with --force")
    task = _task(payload, stream, keys)
    request_id = letter.request_id or (task.request_id if task else "")
    flag = field_ttl_sync(r) if request_id else "0"
    record_ttl = r.ttl(keys.request(request_id)) if request_id else -1
    pipe = r.pipeline(transaction=True)
    if request_id:
        # the error chunk ended the old output; a replay starts a fresh one, with a fresh
        # progress (nothing emitted, no owner, not cancelled; readers attach again)
        pipe.delete(keys.out(request_id))
        ttl_s = record_ttl if record_ttl > 0 else DEFAULT_RECORD_TTL_S
        pipe.execute_command(
            *set_progress_args(keys.progress, request_id, new_progress(), ttl_s, flag)
        )
        replayed = RequestRecord(status=RequestStatus.QUEUED, emitted=0, error="", finish_reason="")
        pipe.hset(
            keys.request(request_id),
            mapping=replayed.changes(),  # type: ignore[arg-type]  # redis-py: invariant keys
        )
    pipe.xadd(stream, {MESSAGE_FIELD: payload})
    pipe.xdel(keys.dlq, letter.dlq_id)
    new_id = as_str(pipe.execute()[-2])
    logger.info("replayed DLQ entry %s (request %s) as %s", dlq_id, request_id or "?", new_id)
    return Replayed(dlq_id, new_id, stream, request_id, reason, kind, kind != "other")


def purge(r: redis.Redis, keys: Keys) -> int:
    """Delete every DLQ entry (of every shard); returns how many there were."""
    total = 0
    for shard in keys.all():
        pipe = r.pipeline(transaction=True)
        pipe.xlen(shard.dlq)
        pipe.delete(shard.dlq)
        total += int(pipe.execute()[0])
    return total
