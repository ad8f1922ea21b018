"""A request's progress: the one field per request of the `prog` hash, written at submission,
admission, flushes, hand-offs and the end (docs/internals.md "Queue plane"). The chunks a
request emitted since its last flush (its tail) are in its owner's `tail:{consumer}` hash: one
field per worker step, the step's chunks of every request in one `tail_entry`.

The value is five lines:

    <emitted>\n<hist>\n<cancel>\n<feeds>\n<owner>

- `emitted`: tokens emitted at the last flush (the chunks of the tail come on top: readers
  walk it, `lua/live.lua`);
- `hist`: how many of them `out:{id}` holds; the others are the request's tail, in the step
  fields of its owner's `tail:{consumer}` hash, moved to `out:{id}` by the owner's next flush,
  or when the request changes hands (admission by another consumer, release);
- `cancel`: "1" once the request was cancelled (read at admission; the owner is told through
  its control list);
- `feeds`: the output readers (ingress processes, producer clients) following the request,
  comma-separated: each step's chunks go to `feed:{reader}` of every one;
- `owner`: `<consumer>/<entry id>` of the worker holding the request's stream entry ("" while
  it waits in a stream): where cancels and feed changes are sent (the fence is per worker).

The Lua side parses the same layout (`lua/progress.lua`, which also walks a tail); this module
is its Python twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.messages import frame

SEP = b"\n"
FEED_SEP = ","
MAX_FEEDS = 4  # readers following one request at once (the newest kept)


@dataclass(slots=True)
class Progress:
    emitted: int = 0
    hist: int = 0
    cancelled: bool = False
    feeds: list[str] = field(default_factory=list)
    owner: str = ""

    @classmethod
    def parse(cls, raw: bytes | None) -> Progress | None:
        """The progress stored in `raw` (an HGET reply); None for a missing field."""
        if raw is None:
            return None
        parts = raw.split(SEP)
        if len(parts) != 5:
            raise ValueError(f"malformed progress value {raw[:60]!r}")
        emitted, hist, cancel, feeds, owner = parts
        return cls(
            emitted=int(emitted),
            hist=int(hist),
            cancelled=cancel == b"1",
            feeds=[f for f in feeds.decode().split(FEED_SEP) if f],
            owner=owner.decode(),
        )

    def encode(self) -> bytes:
        head = [
            str(self.emitted).encode(),
            str(self.hist).encode(),
            b"1" if self.cancelled else b"0",
            FEED_SEP.join(self.feeds).encode(),
            self.owner.encode(),
        ]
        return SEP.join(head)


def new_progress(feed: str = "") -> bytes:
    """The value the submit scripts write for a request just queued."""
    return Progress(feeds=[feed] if feed else []).encode()


def feed_item(request_id: str, payload: bytes) -> bytes:
    """One request's chunk in a feed message: its framed id and its framed chunk payload (a
    feed message is a run of these; `OutputFeed` unframes it)."""
    return frame(request_id.encode()) + frame(payload)


def tail_entry(chunks: list[tuple[str, bytes]]) -> bytes:
    """One step's field of a worker's tail hash: the (request id, chunk payload) pairs that
    joined tails in that step, as a framed header of lines `\n<request id> <offset> <length>`
    then the payloads, so the Lua side finds one request's chunk with one plain search of the
    header (request ids have no space or newline: `submit.valid_request_id`)."""
    header, offset = [], 0
    for request_id, payload in chunks:
        header.append(f"\n{request_id} {offset} {len(payload)}".encode())
        offset += len(payload)
    return frame(b"".join(header)) + b"".join(payload for _, payload in chunks)


def owner_of(consumer: str, entry_id: str) -> str:
    """The `owner` value of a consumer holding a stream entry."""
    return f"{consumer}/{entry_id}"
