"""The req:{id} record: one set of field names (Python and Lua), typed decode and encode."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, RequestStatus, Stage
from kvrelay.core.record import RequestRecord, as_str

HASH_CALL = re.compile(r"redis\.call\('(HSET|HGET|HMGET|HSETNX|HINCRBY)',\s*KEYS\[\d\],([^)]*)\)")


def _lua_sources() -> dict[str, str]:
    lua = resources.files("kvrelay.pipeline.queue") / "lua"
    return {p.name: p.read_text() for p in lua.iterdir() if p.name.endswith(".lua")}


def test_lua_scripts_use_the_record_field_names():
    values = {str(v) for v in (*RequestStatus, *FinishReason, *Stage)}
    seen: set[str] = set()
    for name, text in _lua_sources().items():
        for _cmd, args in HASH_CALL.findall(text):
            for literal in re.findall(r"'([^']*)'", args):
                assert literal in rec.FIELDS or literal in values, (name, literal)
                seen.add(literal)
    # the fields the fenced scripts maintain, and the status a dead letter sets
    maintained = {rec.EMITTED, rec.COMPLETION_TOKENS, rec.STATUS, rec.FINISH_REASON, rec.ERROR,
                  rec.UPDATED, rec.CLAIM_ENTRY, rec.CLAIM_EMITTED, rec.CLAIM_DELIVERY}  # fmt: skip
    assert maintained <= seen
    assert {RequestStatus.FAILED, FinishReason.ERROR} <= seen


def test_as_str():
    assert (as_str(b"a\xff"), as_str("b"), as_str(None), as_str(3)) == ("a\ufffd", "b", "", "3")


def test_decode_types_fields():
    raw = {
        b"status": b"decoding", b"stage": b"decode", b"owner": b"w1", b"created": b"1.5",
        b"deadline": b"", b"prompt_tokens": b"12", b"emitted": b"3", b"attach": b"x",
        b"ingress": b'{"api": "chat", "stream": true}', b"unknown": b"kept out",
    }  # fmt: skip
    got = RequestRecord.decode(raw)
    assert got is not None
    assert got.status is RequestStatus.DECODING and got.stage is Stage.DECODE
    assert (got.owner, got.created, got.deadline, got.prompt_tokens) == ("w1", 1.5, None, 12)
    assert (got.emitted, got.attach, got.completion_tokens) == (3, 0, 0)
    assert got.ingress == {"api": "chat", "stream": True}
    assert not got.ended
    assert RequestRecord.decode({}) is None
    odd = RequestRecord.decode({"status": "weird"})
    assert odd is not None and odd.status == "weird" and not odd.ended


def test_encode_selected_fields():
    record = RequestRecord(status=RequestStatus.QUEUED, stage=Stage.PREFILL, deadline=None)
    assert record.encode((rec.STATUS, rec.STAGE, rec.DEADLINE, rec.EMITTED)) == {
        "status": "queued", "stage": "prefill", "deadline": "", "emitted": 0,
    }  # fmt: skip


@pytest.fixture
def r(valkey_session):
    client = redis.Redis.from_url(valkey_session.url)
    client.flushdb()
    yield client
    client.close()


def test_round_trip_through_a_real_hash(r):
    record = RequestRecord(
        status=RequestStatus.FAILED, stage=Stage.DECODE, model="m", created=1700000000.25,
        prompt_tokens=5, completion_tokens=2, finish_reason=FinishReason.TIMEOUT,
        error="deadline", ingress={"api": "completions"},
    )  # fmt: skip
    r.hset("req:x", mapping=record.encode())
    back = RequestRecord.decode(r.hgetall("req:x"))
    assert back == record and back.ended
