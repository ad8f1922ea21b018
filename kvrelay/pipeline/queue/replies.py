"""The shapes of the Redis replies the queue reads, for `typing.cast`.

redis-py types each reply for every client setting: `bytes | str` (decode_responses) and both
RESP2 and RESP3 shapes. kvrelay's clients (core.redis_client, queue.redis_options) are binary
and speak RESP2, so a reply is always the narrower shape named here.
"""

from __future__ import annotations

Fields = dict[bytes, bytes]  # a stream entry's fields; HGETALL
StreamEntry = tuple[bytes, Fields]  # (entry id, fields): XRANGE rows
StreamReply = list[tuple[bytes, list[StreamEntry]]]  # XREAD / XREADGROUP: (stream, entries)
