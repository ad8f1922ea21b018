"""OutputFeed: one reader per process dispatching each request's chunks from its feed channel,
history read on attach, gaps refilled, made-up finals, deadlines and a lost subscription
(workers are simulated by tests/pipeline/queue_sim.py, writing prog/out/tails and publishing
feed messages as the design says)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, RequestStatus
from kvrelay.core.keys import Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue import subscription as subscription_module
from kvrelay.pipeline.queue.feed import OutputFeed
from kvrelay.pipeline.queue.output import OutputExpired, OutputTimeout, RequestNotFound
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.queue.redis_options import async_redis
from tests.pipeline.queue_sim import emit, step, submit

KEYS = Keys("of:")


def _c(index: int, ids: list[int], text: str = "", finish: str | None = None) -> TokenChunk:
    return TokenChunk(index=index, token_ids=ids, text=text, finish_reason=finish)


def _view(chunks: list[TokenChunk]) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in chunks]


async def _collect(agen, got: list[TokenChunk]) -> None:
    async for chunk in agen:
        got.append(chunk)


async def _until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def _first_chunk_read(r, feed: OutputFeed, rid: str, got: list[TokenChunk]):
    """Submit `rid` naming the feed, emit its first chunk and wait until the reader (the task
    returned, collecting into `got`) has it."""
    sub = await feed.subscribe(rid)
    submit(r, KEYS, rid, feed.reader_id)
    reader = asyncio.create_task(_collect(sub.chunks(submitted=True), got))
    emit(r, KEYS, rid, _c(0, [1], "a"))
    await _until(lambda: len(got) == 1)
    return reader


def _run(url: str, scenario, **options) -> None:
    async def main() -> None:
        client = async_redis(url, 16)
        feed = OutputFeed(client, KEYS, block_ms=100, **options)
        try:
            await scenario(feed)
        finally:
            await feed.stop()
            await client.aclose()

    asyncio.run(main())


def test_one_feed_entry_reaches_several_requests_and_two_subscribers_of_one(r, valkey_session):
    got: dict[str, list[TokenChunk]] = {"a": [], "b": [], "b2": []}

    feed_id: list[str] = []

    async def scenario(feed: OutputFeed) -> None:
        feed_id.append(feed.reader_id)
        sub_a, sub_b, sub_b2 = [await feed.subscribe(rid) for rid in ("a", "b", "b")]
        submit(r, KEYS, "a", feed.reader_id)
        submit(r, KEYS, "b", feed.reader_id)
        readers = [
            asyncio.create_task(_collect(sub.chunks(submitted=True), got[name]))
            for sub, name in ((sub_a, "a"), (sub_b, "b"), (sub_b2, "b2"))
        ]
        step(r, KEYS, {"a": _c(0, [1], "x"), "b": _c(0, [7, 8], "yz")})
        emit(r, KEYS, "a", _c(1, [2], "w", FinishReason.STOP))
        emit(r, KEYS, "b", _c(2, [9], "v", FinishReason.LENGTH))
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert feed._subs == {}  # every subscription ended with its reading

    _run(valkey_session.url, scenario)
    assert _view(got["a"]) == [(0, [1], "x", None), (1, [2], "w", "stop")]
    assert _view(got["b"]) == [(0, [7, 8], "yz", None), (2, [9], "v", "length")]
    assert _view(got["b2"]) == _view(got["b"])
    assert r.exists(KEYS.feed(feed_id[0])) == 0  # a channel: nothing is stored


def test_attach_reads_history_and_tail_then_live_without_loss_or_repeat(r, valkey_session):
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "h")
        emit(r, KEYS, "h", _c(0, [1, 2], "ab"), flush=True)  # in out:{id}
        emit(r, KEYS, "h", _c(2, [3], "c"))  # in the tail
        reader = asyncio.create_task(_collect(feed.chunks("h"), got))
        await _until(lambda: len(got) == 2)
        progress = Progress.parse(r.hget(KEYS.progress, "h"))
        assert progress is not None and progress.feeds == [feed.reader_id]  # attached
        emit(r, KEYS, "h", _c(3, [4], "d"))
        emit(r, KEYS, "h", _c(4, [5], "e", FinishReason.STOP))
        await asyncio.wait_for(reader, 10)

    _run(valkey_session.url, scenario)
    assert _view(got) == [
        (0, [1, 2], "ab", None),
        (2, [3], "c", None),
        (3, [4], "d", None),
        (4, [5], "e", "stop"),
    ]


def test_attach_keeps_the_newest_feeds(r, valkey_session):
    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "m", "f1")
        progress = Progress.parse(r.hget(KEYS.progress, "m"))
        progress.feeds = ["f1", "f2", "f3", "f4"]
        r.hset(KEYS.progress, "m", progress.encode())
        sub = await feed.subscribe("m")
        history, runs = await sub.attach()
        sub.close()
        assert (history, runs) == ([], 0)

    _run(valkey_session.url, scenario)
    progress = Progress.parse(r.hget(KEYS.progress, "m"))
    assert progress.feeds[:3] == ["f2", "f3", "f4"] and len(progress.feeds) == 4


def test_a_chunk_whose_message_was_lost_is_refilled_from_the_history(r, valkey_session):
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        reader = await _first_chunk_read(r, feed, "g", got)
        emit(r, KEYS, "g", _c(1, [2], "b"), publish=False)  # its message reached no one
        emit(r, KEYS, "g", _c(2, [3], "c", FinishReason.STOP))
        await asyncio.wait_for(reader, 10)

    _run(valkey_session.url, scenario)
    assert _view(got) == [(0, [1], "a", None), (1, [2], "b", None), (2, [3], "c", "stop")]


def test_a_failed_record_without_a_final_chunk_gets_a_made_up_one(r, valkey_session):
    got: list[TokenChunk] = []
    got_live: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "f")
        emit(r, KEYS, "f", _c(0, [1, 2], "ab"), flush=True)
        r.hset(KEYS.request("f"), mapping={rec.STATUS: RequestStatus.FAILED, rec.ERROR: "boom"})
        r.hdel(KEYS.progress, "f")
        await asyncio.wait_for(_collect(feed.chunks("f"), got), 10)
        # a reader following it live notices once the request stays quiet
        sub = await feed.subscribe("f2")
        submit(r, KEYS, "f2", feed.reader_id)
        reader = asyncio.create_task(_collect(sub.chunks(submitted=True), got_live))
        emit(r, KEYS, "f2", _c(0, [5], "e"))
        await _until(lambda: len(got_live) == 1)
        r.hset(KEYS.request("f2"), mapping={rec.STATUS: RequestStatus.CANCELLED})
        await asyncio.wait_for(reader, 10)

    _run(valkey_session.url, scenario, quiet_s=0.2)
    assert _view(got) == [(0, [1, 2], "ab", None), (2, [], "", "error")]
    assert got[-1].error == "boom"
    assert _view(got_live) == [(0, [5], "e", None), (1, [], "", "cancelled")]
    assert got_live[-1].error is None


def test_start_index_cuts_the_chunk_it_falls_in(r, valkey_session):
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "s")
        emit(r, KEYS, "s", _c(0, [1, 2, 3], "abc"), flush=True)
        emit(r, KEYS, "s", _c(3, [4], "d", FinishReason.STOP))
        retext = lambda ids: "".join(chr(ord("a") + i - 1) for i in ids)  # noqa: E731
        await asyncio.wait_for(_collect(feed.chunks("s", start_index=2, retext=retext), got), 10)

    _run(valkey_session.url, scenario)
    assert _view(got) == [(2, [3], "c", None), (3, [4], "d", "stop")]


def test_a_chunk_overlapping_tokens_already_read_is_cut_where_they_end(r, valkey_session):
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "o")
        emit(r, KEYS, "o", _c(0, [1, 2, 3], "abc"), flush=True)
        # split differently from the chunk already read: tokens 1..4 again, then the end
        emit(r, KEYS, "o", _c(1, [2, 3, 4, 5], "bcde"))
        emit(r, KEYS, "o", _c(5, [6], "f", FinishReason.STOP))
        retext = lambda ids: "".join(chr(ord("a") + i - 1) for i in ids)  # noqa: E731
        await asyncio.wait_for(_collect(feed.chunks("o", retext=retext), got), 10)

    _run(valkey_session.url, scenario)
    # each token once, at its own index
    assert _view(got) == [(0, [1, 2, 3], "abc", None), (3, [4, 5], "de", None),
                          (5, [6], "f", "stop")]  # fmt: skip


def test_the_deadline_ends_the_reading(r, valkey_session, fake_clock):
    fake_clock.install(subscription_module)  # the reader's clock moves only as it waits
    deadline = fake_clock.time() + 0.25

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "d")
        with pytest.raises(OutputTimeout):
            await asyncio.wait_for(_collect(feed.chunks("d", deadline=deadline), []), 10)

    _run(valkey_session.url, scenario)
    assert fake_clock.slept == [0.25]  # one wait, up to the deadline (not the quiet time's 3 s)


def test_a_wall_clock_step_past_the_deadline_does_not_end_the_reading(
    r, valkey_session, fake_clock
):
    """The deadline is timed on the monotonic clock: the wall clock set 60 s ahead while a
    reply with 30 s left is read (a VM's clock corrected) ends nothing early."""
    fake_clock.install(subscription_module)
    deadline = fake_clock.time() + 30.0
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        submit(r, KEYS, "w")
        emit(r, KEYS, "w", _c(0, [1], "a"))
        async for chunk in feed.chunks("w", deadline=deadline):
            got.append(chunk)
            if len(got) == 1:
                fake_clock.step_wall(60.0)
                emit(r, KEYS, "w", _c(1, [2], "b", FinishReason.STOP))

    _run(valkey_session.url, scenario)
    assert _view(got) == [(0, [1], "a", None), (1, [2], "b", "stop")]
    assert sum(fake_clock.slept) < 30.0


def test_unknown_and_expired_requests(r, valkey_session):
    async def scenario(feed: OutputFeed) -> None:
        with pytest.raises(RequestNotFound):
            await asyncio.wait_for(_collect(feed.chunks("nope"), []), 10)
        r.hset(KEYS.request("old"), mapping={rec.STATUS: RequestStatus.FINISHED, rec.EMITTED: 3})
        with pytest.raises(OutputExpired):
            await asyncio.wait_for(_collect(feed.chunks("old"), []), 10)

    _run(valkey_session.url, scenario)


def test_a_dropped_subscription_is_made_again_and_its_requests_attached_again(r, valkey_session):
    """The server drops the reader's connection (CLIENT KILL): what is published before it
    subscribes again reaches no one, so every subscription reads its history again."""
    got: list[TokenChunk] = []

    async def scenario(feed: OutputFeed) -> None:
        reader = await _first_chunk_read(r, feed, "v", got)
        assert r.client_kill_filter(_type="pubsub") == 1
        emit(r, KEYS, "v", _c(1, [2], "b"))  # published to no one
        await _until(lambda: len(got) == 2)
        await _until(lambda: _subscribers(r, feed) == 1)
        emit(r, KEYS, "v", _c(2, [3], "c", FinishReason.STOP))
        await asyncio.wait_for(reader, 10)

    _run(valkey_session.url, scenario)
    assert _view(got) == [(0, [1], "a", None), (1, [2], "b", None), (2, [3], "c", "stop")]


def _subscribers(r, feed: OutputFeed) -> int:
    [(_, count)] = r.pubsub_shardnumsub(feed.channel)
    return count


def test_start_subscribes_and_stop_drops_the_subscription(r, valkey_session):
    async def scenario(feed: OutputFeed) -> None:
        await feed.start()
        assert _subscribers(r, feed) == 1  # confirmed before start returns
        await feed.stop()
        await _until(lambda: _subscribers(r, feed) == 0)
        assert r.exists(feed.channel) == 0  # a channel, never a key

    _run(valkey_session.url, scenario)


def test_a_reader_attaching_between_steps_gets_the_chunk_it_missed_from_the_tail(r, valkey_session):
    """A real worker (Streams.step) learns the reader's feed one step late: the chunk laid out
    before then is only in the tail; the reader sees a gap at the next chunk and refills it."""
    from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP
    from kvrelay.core.messages import PrefillTask, frame
    from kvrelay.pipeline.queue.streams import StepWrite, Streams, WriteMode

    got: list[TokenChunk] = []
    worker = Streams(r, KEYS, "w-late")
    worker.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    worker.beat(KEYS.worker("w-late"), {"name": "w-late"}, 10)
    submit(r, KEYS, "late")
    task = PrefillTask(request_id="late", prompt_token_ids=[1], sampling={})
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = worker.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    [found] = worker.admit([(entry.entry_id, "late", 0, {})])
    feeds = {"late": found.feeds}
    numbers = iter(range(1, 100))
    acked = 0

    def step(chunk: TokenChunk, mode: WriteMode = WriteMode.EMIT, **extra) -> None:
        nonlocal acked
        write = StepWrite(entry.entry_id, "late", chunk, mode, **extra)
        res = worker.step(
            KEYS.prefill_stream, PREFILL_GROUP, KEYS.decode_stream, [write], feeds,
            next(numbers), acked,
        )  # fmt: skip
        acked = res.num_control
        feeds.update(res.feeds)

    async def scenario(feed: OutputFeed) -> None:
        step(_c(0, [1], "a"))
        reader = asyncio.create_task(_collect(feed.chunks("late"), got))
        await _until(lambda: len(got) == 1)  # from the tail, at the attach
        assert feeds == {"late": []}  # the worker has not heard of the reader yet
        step(_c(1, [2], "b"))  # laid out without the feed: only in the tail
        assert feeds == {"late": [feed.reader_id]}  # ... and that step's reply told it
        step(_c(2, [3], "c"))  # on the feed: a gap, refilled from the tail
        await _until(lambda: len(got) == 3)
        history = b"".join(frame(_c(i, [i + 1], "abc"[i]).encode()) for i in range(3))
        last = _c(3, [4], "d", FinishReason.STOP)
        step(last, WriteMode.DONE, history=history + frame(last.encode()))
        await asyncio.wait_for(reader, 10)

    _run(valkey_session.url, scenario)
    assert _view(got) == [
        (0, [1], "a", None),
        (1, [2], "b", None),
        (2, [3], "c", None),
        (3, [4], "d", "stop"),
    ]
