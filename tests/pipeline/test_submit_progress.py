"""The submit scripts write each request's progress (naming the feed that follows it, with the
record's time to live where the server expires hash fields), keep their guarantees, and the
ingress names its own feed; lua/cancel.lua flags running requests only."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue import choices_state, scripts
from kvrelay.pipeline.queue.field_ttl import field_ttl, field_ttl_sync
from kvrelay.pipeline.queue.progress import Progress, new_progress
from tests.pipeline.ingress_support import MODEL, http
from tests.queue_state import ValkeyClock, expires_at

KEYS = Keys("sp:")
SUBMIT = scripts.ordered("submit")
SUBMIT_CHOICES = scripts.ordered("submit_choices")
FCFS = ["", 0, "", 0, 0]  # the ordering items: at the stream's end


def _submit(r, rid: str, submission: str, ttl_fields: str, bound: int = 0, feed: str = "f1"):
    keys = [
        KEYS.request(rid),
        KEYS.prefill_stream,
        KEYS.prefill_stream,
        KEYS.decode_stream,
        KEYS.progress,
    ]
    args = [100, b"task", bound, PREFILL_GROUP, DECODE_GROUP, submission, rid,
            new_progress(feed), ttl_fields, *FCFS, "status", "queued"]  # fmt: skip
    return r.eval(SUBMIT, len(keys), *keys, *args)


def _field_expiry(r, rid: str) -> int:
    return expires_at(r, KEYS.progress, rid)


def test_the_probe_finds_field_expiry_on_valkey_9(r):
    assert field_ttl_sync(r) == "1"


def test_submit_writes_the_progress_with_the_record_ttl(r):
    with ValkeyClock(r) as clock:
        entry = _submit(r, "a", "s1", "1")
    assert r.xrange(KEYS.prefill_stream) == [(entry, {MESSAGE_FIELD: b"task"})]
    assert Progress.parse(r.hget(KEYS.progress, "a")) == Progress(feeds=["f1"])
    # the record's 100 s, the progress field's too
    assert _field_expiry(r, "a") == expires_at(r, KEYS.request("a"))
    assert _field_expiry(r, "a") in clock.window(100)
    # a server without field expiry: plain HSET (the workers delete the field at the end)
    _submit(r, "b", "s2", "0", feed="")
    assert r.hget(KEYS.progress, "b") == new_progress() and _field_expiry(r, "b") == -1


def test_submit_keeps_its_guarantees(r):
    first = _submit(r, "a", "s1", "1")
    assert _submit(r, "a", "s1", "1") == b"s1"  # a retry of the same submission: queued once
    assert _submit(r, "a", "s2", "1") is None  # another submission of the id: refused
    assert r.xlen(KEYS.prefill_stream) == 1 and r.xrange(KEYS.prefill_stream)[0][0] == first
    # the bound: the stream has no group yet, so everything in it waits
    assert _submit(r, "c", "s3", "1", bound=1) == 1
    assert r.hget(KEYS.progress, "c") is None and not r.exists(KEYS.request("c"))
    assert _submit(r, "c", "s3", "1", bound=2) is not None  # room for one more


def test_submit_with_a_bound_and_no_streams_yet(r):
    assert _submit(r, "a", "s1", "1", bound=1) is not None  # no stream: nothing waits


def test_submit_choices_writes_every_choice_progress(r):
    keys = [KEYS.request("p"), KEYS.prefill_stream, KEYS.decode_stream, KEYS.progress,
            KEYS.request("p.0"), KEYS.request("p.1")]  # fmt: skip
    args = [100, 0, PREFILL_GROUP, DECODE_GROUP, "s1", 2, new_progress("f9"), "1", *FCFS,
            2, "status", "queued",
            "p", "p.0", b"t0", 2, "status", "queued",
            "d", "p.1", b"t1", 2, "status", "queued"]  # fmt: skip
    with ValkeyClock(r) as clock:
        assert r.eval(SUBMIT_CHOICES, len(keys), *keys, *args) is not None
    assert r.hmget(KEYS.progress, ["p", "p.0", "p.1"]) == [None, new_progress("f9"),
                                                           new_progress("f9")]  # fmt: skip
    assert _field_expiry(r, "p.1") in clock.window(100)
    assert [e[1][MESSAGE_FIELD] for e in r.xrange(KEYS.prefill_stream)] == [b"t0"]
    assert [e[1][MESSAGE_FIELD] for e in r.xrange(KEYS.decode_stream)] == [b"t1"]


def test_cancel_flags_running_requests_only_keeping_the_ttl(r):
    _submit(r, "a", "s1", "1")
    expiry = _field_expiry(r, "a")
    ids = choices_state.cancel_sync(r, KEYS, ["a", "gone"])
    assert ids == ["a"]
    assert Progress.parse(r.hget(KEYS.progress, "a")) == Progress(cancelled=True, feeds=["f1"])
    assert _field_expiry(r, "a") == expiry > 0  # KEEPTTL
    assert r.hget(KEYS.progress, "gone") is None


@pytest.mark.anyio
async def test_a_posted_request_names_the_ingress_feed(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ing = app.state.ingress
    assert await field_ttl(ing.redis) == "1"
    async with http(app) as client:
        post = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi"},
                headers={"X-Request-Id": "nf-1"},
            )  # fmt: skip
        )
        taken = await role.take()
        progress = Progress.parse(await ing.redis.hget(ing.keys.progress, "nf-1"))
        assert progress == Progress(feeds=[ing.feed.reader_id])
        await role.emit("nf-1", TokenChunk(0, [19556], "Hello", finish_reason="stop"))
        await role.finish(taken)
        resp = await post
    assert resp.json()["choices"][0]["text"] == "Hello"
    assert list(ing.feed._subs) == []  # the reply's subscription ended with it
