"""Reading and poking the queue plane's state in tests the way its readers and writers do."""

from __future__ import annotations

import time

import redis

from kvrelay.core.keys import MESSAGE_FIELD, Keys, shard_of
from kvrelay.core.messages import TokenChunk, decode_chunks, unframe
from kvrelay.pipeline.queue import choices_state
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.queue.streams import Streams


def emitted_chunks(r: redis.Redis, keys: Keys, request_id: str) -> list[TokenChunk]:
    """Every chunk emitted so far: out:{id}'s entries, then the tail (on the request's shard)."""
    return Streams(r, keys.of(request_id), "reader").history(request_id)


def feed_chunks(message: bytes) -> dict[str, TokenChunk]:
    """A feed message's chunks by request id (framed id, framed chunk, ...)."""
    frames = unframe(message)
    return {
        k.decode(): TokenChunk.decode(v) for k, v in zip(frames[::2], frames[1::2], strict=True)
    }


class FeedListener:
    """A subscriber to output feed channels, as an `OutputFeed` is (sync, for tests): what
    workers publish while it listens, in order."""

    def __init__(self, r: redis.Redis, *channels: str):
        self.pubsub = r.pubsub()
        self.pubsub.ssubscribe(*channels)
        confirmed = 0
        deadline = time.monotonic() + 10
        while confirmed < len(channels):
            assert time.monotonic() < deadline, "no subscription confirmation"
            message = self.pubsub.get_message(timeout=1)
            confirmed += bool(message and message["type"] == "ssubscribe")

    def messages(self, wait_s: float = 0.2) -> list[bytes]:
        """Every message received so far (waiting up to `wait_s` for each next one)."""
        out = []
        while (message := self.pubsub.get_message(timeout=wait_s)) is not None:
            if message["type"] == "smessage":
                out.append(message["data"])
        return out

    def close(self) -> None:
        self.pubsub.close()


def progress(r: redis.Redis, keys: Keys, request_id: str) -> Progress | None:
    return Progress.parse(r.hget(keys.of(request_id).progress, request_id))


def set_cancelled(r: redis.Redis, keys: Keys, request_id: str) -> None:
    """Set a request's cancel flag and tell its owner (the ingress's cancel script); a request
    without progress gets a new one, cancelled."""
    if choices_state.cancel_sync(r, keys, [request_id]):
        return

    def flag(pipe: redis.client.Pipeline) -> None:
        prog = Progress.parse(pipe.hget(keys.progress, request_id)) or Progress()
        prog.cancelled = True
        pipe.multi()
        pipe.hset(keys.progress, request_id, prog.encode())

    r.transaction(flag, keys.progress)


class ValkeyClock:
    """Valkey's own clock (TIME, in ms) read before and after some writes (`with
    ValkeyClock(r) as clock: ...`, or `start()` and `stop()`): a key or hash field those
    writes gave `ttl_s` to live expires within `clock.window(ttl_s)`, however long the writes
    took."""

    def __init__(self, r: redis.Redis):
        self.r = r
        self.before = self.after = 0

    def now_ms(self) -> int:
        seconds, micros = self.r.time()
        return seconds * 1000 + micros // 1000

    def start(self) -> ValkeyClock:
        self.before = self.now_ms()
        return self

    def stop(self) -> None:
        self.after = self.now_ms()

    def __enter__(self) -> ValkeyClock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def window(self, ttl_s: int) -> range:
        """The expiry times (unix ms) of something given `ttl_s` between the two readings."""
        return range(self.before + ttl_s * 1000, self.after + ttl_s * 1000 + 1)


def expires_at(r: redis.Redis, key: str, field: str | None = None) -> int:
    """When `key` (or its hash `field`) expires, in unix ms (-1: never, -2: no such key)."""
    if field is None:
        return int(r.pexpiretime(key))
    return int(r.execute_command("HPEXPIRETIME", key, "FIELDS", 1, field)[0])


def final_chunks(
    r: redis.Redis, keys: Keys, request_id: str, timeout: float = 120
) -> list[TokenChunk]:
    """Every chunk of the request, from out:{id} on its shard, once its final chunk is there
    (what there is when `timeout` passes first)."""
    key = keys.of(request_id).out(request_id)
    deadline = time.monotonic() + timeout
    while True:
        got = [c for _, f in r.xrange(key) for c in decode_chunks(f[MESSAGE_FIELD])]
        if (got and got[-1].finished) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def tokens_of(got: list[TokenChunk]) -> list[int]:
    """The token ids of chunks whose indices run on without a gap or an overlap."""
    expect = 0
    for c in got:
        assert c.index == expect, "chunk indices must be contiguous"
        expect += len(c.token_ids)
    return [t for c in got for t in c.token_ids]


def ids_on_every_shard(stem: str, shards: int = 3) -> list[str]:
    """One request id per shard (`{stem}-{i}`), shard 0 first."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < shards:
        found.setdefault(shard_of(f"{stem}-{i}", shards), f"{stem}-{i}")
        i += 1
    return [found[k] for k in range(shards)]
