"""The req:{id} record: one set of field names (Lua fills them in from Python), decode, encode."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvrelay
from kvrelay.core import record as rec
from kvrelay.core.dead_letter import DlqField
from kvrelay.core.enums import FinishReason, RequestStatus, Stage
from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import MESSAGE_FIELD
from kvrelay.core.messages import PrefillTask
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.core.usage import UsageField
from kvrelay.pipeline.queue import scripts

LITERAL = re.compile(r"'([^'\\]*)'|\"([^\"\\]*)\"")


def _raw_scripts() -> dict[str, str]:
    lua = resources.files("kvrelay.pipeline.queue") / "lua"
    return {p.name: p.read_text() for p in lua.iterdir() if p.name.endswith(".lua")}


def test_every_script_loads_filled_in():
    expected = "admit attach beat cancel claim dead_letter field_ttl live ordered own owner"
    expected += " progress prune quota ran refill release response_delete response_save"
    expected += " step strikes submit submit_choices usage"
    assert scripts.names() == expected.split()
    for name in scripts.names():
        text = scripts.source(name)
        assert "${" not in text and "redis.call(" in text, name
        assert scripts.source(name) is text  # filled in once per process
    fenced = scripts.source("owner") + scripts.source("progress") + scripts.source("release")
    assert scripts.fenced("release") == fenced


def test_scripts_spell_no_name_python_defines():
    python_names = set(rec.FIELDS) | {str(v) for v in (*RequestStatus, *FinishReason, *Stage)}
    python_names.add(MESSAGE_FIELD.decode())
    dlq = {name for name in vars(DlqField) if name.isupper()}
    python_names |= {getattr(DlqField, name) for name in dlq}
    used: set[str] = set()
    for name, text in _raw_scripts().items():
        for single, double in LITERAL.findall(text):
            assert (single or double) not in python_names, (name, single or double)
        used |= set(scripts.PLACEHOLDER.findall(text))
    # the fields the fenced scripts maintain, the status a dead letter sets, the entry field
    maintained = {"EMITTED", "COMPLETION_TOKENS", "STATUS", "FINISH_REASON", "ERROR", "UPDATED"}
    claims = {
        "CLAIM_ENTRY",
        "CLAIM_EMITTED",
        "CLAIM_DELIVERY",
        "CLAIM_STRIKES",
        "CLAIM_SEEN",
        "CLAIM_RAN",
        "MESSAGE_FIELD",
    }
    dead_letter = {"STATUS.FAILED", "FINISH_REASON.ERROR"} | {f"DLQ.{name}" for name in dlq}
    submit = {"SUBMISSION_ID"}  # how the submit script knows a retry of its own submission
    ended = {"STATUS.FINISHED", "STATUS.CANCELLED"}  # admission leaves an ended request alone
    heartbeat = {"WORKER.DRAIN", "WORKER.DRAINING"}  # the beat mirrors the admin's drain flag
    # the step script counts an ended request's usage from its record (lua/usage.lua)
    usage = {"PROMPT_TOKENS", "CACHED_TOKENS", "ACCOUNT", "PER_PROMPT", "MODEL"}
    usage |= {f"USAGE.{field.name}" for field in UsageField}
    assert used == maintained | claims | dead_letter | submit | ended | heartbeat | usage
    package = Path(kvrelay.__file__).parent
    inline = [str(p) for p in package.rglob("*.py") if "redis.call(" in p.read_text()]
    assert inline == []  # every script lives in lua/, loaded through the one loader


def test_placeholders_become_quoted_python_values():
    assert {v for k, v in scripts.NAMES.items() if "." not in k} == set(rec.FIELDS) | {"m"}
    assert scripts.fill("${DLQ.REASON}, ${DLQ.ENTRY_ID}") == "'reason', 'id'"
    text = "redis.call('HSET', KEYS[1], ${STATUS}, ${STATUS.FAILED}, ${STAGE}, ${STAGE.DECODE})"
    filled = "redis.call('HSET', KEYS[1], 'status', 'failed', 'stage', 'decode')"
    assert scripts.fill(text) == filled
    assert scripts.fill("${FINISH_REASON.TIMEOUT} ${MESSAGE_FIELD}") == "'timeout' 'm'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("return ${NOPE}", "x.lua: unknown placeholder ${NOPE}"),
        ("return ${emitted}", "x.lua: unknown placeholder ${emitted}"),
        ("return ${STATUS.DONE}", "x.lua: unknown placeholder ${STATUS.DONE}"),
        ("return ${EMITTED", "x.lua: unterminated placeholder at '${EMITTED'"),
    ],
)
def test_an_unknown_placeholder_raises(text, message):
    with pytest.raises(scripts.ScriptError) as info:
        scripts.fill(text, "x.lua")
    assert str(info.value) == message
    assert isinstance(info.value, KvrelayError) and isinstance(info.value, ValueError)


def test_as_str():
    assert (as_str(b"a\xff"), as_str("b"), as_str(None), as_str(3)) == ("a\ufffd", "b", "", "3")


def test_field_types_are_declared_once_on_the_dataclass():
    names = {v for k, v in vars(rec).items() if k.isupper() and isinstance(v, str)}
    assert names == set(rec.FIELDS) == {f.name for f in fields(RequestRecord)}
    kinds = {
        "int": rec.INT_FIELDS, "float": rec.FLOAT_FIELDS, "json": rec.JSON_FIELDS,
        "private": rec.PRIVATE_FIELDS,
    }  # fmt: skip
    assert kinds == {
        "int": {"prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens",
                "accepted_tokens", "emitted", "attach", "claim_emitted", "claim_delivery",
                "claim_strikes", "claim_seen", "claim_ran", "num_choices", "per_prompt"},
        "float": {"created", "updated", "started", "deadline"},
        "json": {"ingress"},
        "private": {"ingress", "key_id", "attach", "submission_id", "num_choices", "parent",
                    "account", "per_prompt"},
    }  # fmt: skip


def test_decode_types_fields():
    raw = {
        b"status": b"decoding", b"stage": b"decode", b"owner": b"w1", b"created": b"1.5",
        b"deadline": b"", b"prompt_tokens": b"12", b"emitted": b"3", b"attach": b"x",
        b"ingress": b'{"api": "chat", "stream": true}', b"unknown": b"kept out",
        b"started": b"nan", b"error": b"",
    }  # fmt: skip
    got = RequestRecord.decode(raw)
    assert got is not None
    assert got.status is RequestStatus.DECODING and got.stage is Stage.DECODE
    assert (got.owner, got.created, got.deadline, got.prompt_tokens) == ("w1", 1.5, None, 12)
    # absent, empty, or not of the field's type (JSON has no nan): None, never 0 or ""
    assert (got.emitted, got.attach, got.completion_tokens) == (3, None, None)
    assert (got.started, got.error, got.finish_reason) == (None, None, None)
    assert got.ingress == {"api": "chat", "stream": True}
    assert not got.ended
    assert RequestRecord.decode({}) is None
    odd = RequestRecord.decode({"status": "weird"})
    assert odd is not None and odd.status == "weird" and not odd.ended


def test_encode_selected_fields():
    record = RequestRecord(status=RequestStatus.QUEUED, stage=Stage.PREFILL, emitted=0)
    assert record.encode((rec.STATUS, rec.STAGE, rec.DEADLINE, rec.EMITTED, rec.ERROR)) == {
        "status": "queued", "stage": "prefill", "deadline": "", "emitted": 0, "error": "",
    }  # fmt: skip


def test_public_view_has_json_types_and_null_for_what_is_absent():
    """What GET /v1/requests/{id} and the client's status() show, from the hash as stored."""
    stored = {
        "status": "finished", "stage": "decode", "owner": "w1", "model": "m",
        "created": "1700000000.250000", "updated": "1700000001.500000", "deadline": "",
        "prompt_tokens": "31", "completion_tokens": "8", "cached_tokens": "16", "emitted": "8",
        "draft_tokens": "12", "accepted_tokens": "7",
        "finish_reason": "length", "error": "", "source": "client", "user": "",
        "ingress": "{}", "key_id": "k", "attach": "2", "submission_id": "ab12",
        "claim_entry": "1-0", "claim_emitted": "3", "claim_delivery": "2", "claim_strikes": "1",
        "claim_seen": "4", "claim_ran": "3",
    }  # fmt: skip
    record = RequestRecord.decode(stored)
    assert record is not None
    public = record.public()
    assert public == {
        "status": "finished", "stage": "decode", "owner": "w1", "model": "m",
        "created": 1700000000.25, "updated": 1700000001.5, "started": None, "deadline": None,
        "prompt_tokens": 31, "completion_tokens": 8, "cached_tokens": 16, "draft_tokens": 12,
        "accepted_tokens": 7, "finish_reason": "length", "error": None, "emitted": 8,
        "source": "client", "user": None, "claim_entry": "1-0", "claim_emitted": 3,
        "claim_delivery": 2, "claim_strikes": 1, "claim_seen": 4, "claim_ran": 3,
    }  # fmt: skip
    assert list(public) == list(rec.PUBLIC_FIELDS)
    assert type(public["status"]) is str  # the enum's plain string
    assert json.loads(json.dumps(public, allow_nan=False)) == public


def test_round_trip_through_a_real_hash(r):
    record = RequestRecord(
        status=RequestStatus.FAILED, stage=Stage.DECODE, model="m", created=1700000000.25,
        prompt_tokens=5, completion_tokens=2, finish_reason=FinishReason.TIMEOUT,
        error="deadline", ingress={"api": "completions"},
    )  # fmt: skip
    r.hset("req:x", mapping=record.encode())
    back = RequestRecord.decode(r.hgetall("req:x"))
    assert back == record and back.ended


def test_encode_writes_times_with_the_decimals_asked():
    record = RequestRecord(created=1700000000.25, updated=1700000001, deadline=None)
    names = (rec.CREATED, rec.UPDATED, rec.DEADLINE)
    assert record.encode(names, places={rec.CREATED: 6, rec.UPDATED: 6, rec.DEADLINE: 3}) == {
        "created": "1700000000.250000", "updated": "1700000001.000000", "deadline": "",
    }  # fmt: skip
    # without places a time is the number itself (redis-py writes repr(float))
    assert record.encode((rec.CREATED,)) == {"created": 1700000000.25}


def test_changes_are_the_fields_set_in_field_order():
    """A writer's update: what it set, "" and 0 included (a clear is a set), None left out."""
    update = RequestRecord(
        owner="", status=RequestStatus.DECODING, emitted=0, started=1.5, updated=1.5,
        ingress={"api": "chat"},
    )  # fmt: skip
    got = update.changes(places={rec.UPDATED: rec.MILLIS})
    assert got == {
        "status": "decoding", "owner": "", "updated": "1.500", "started": 1.5, "emitted": 0,
        "ingress": '{"api": "chat"}',
    }  # fmt: skip
    assert list(got) == ["status", "owner", "updated", "started", "emitted", "ingress"]
    assert type(got["status"]) is str  # the enum's plain string
    assert RequestRecord().changes() == {}


def test_decode_fields_types_an_hmget_reply():
    names = (rec.STATUS, rec.EMITTED, rec.DEADLINE, rec.MODEL)
    got = RequestRecord.decode_fields(names, [b"finished", b"7", None, b""])
    assert (got.status, got.emitted, got.deadline, got.model) == (
        RequestStatus.FINISHED, 7, None, None,
    )  # fmt: skip
    assert got.owner is None  # not read
    assert RequestRecord.decode_fields((rec.EMITTED,), (None,)) == RequestRecord()  # no record
    with pytest.raises(ValueError):
        RequestRecord.decode_fields((rec.EMITTED,), ())


def test_writers_keep_the_wire_values(monkeypatch):
    """The submission's and the workers' writes go through RequestRecord with the exact
    strings they wrote before (the Lua scripts and other readers depend on them)."""
    from kvrelay.pipeline.queue import submit
    from kvrelay.workers.base import speculation_record

    # the module's clock alone: time.time itself stays real for every other thread
    monkeypatch.setattr(submit, "time", SimpleNamespace(time=lambda: 1700000001.5))
    task = PrefillTask(
        request_id="r", model="m", prompt_token_ids=[1, 2], arrival_time=1700000000.25,
        deadline=1700000060.0,
    )  # fmt: skip
    items = submit._record_items(task, "prefill", 2, 1)
    assert dict(zip(items[::2], items[1::2], strict=True)) == {
        "status": "queued", "stage": "prefill", "model": "m", "created": "1700000000.250000",
        "updated": "1700000001.500000", "prompt_tokens": 2, "completion_tokens": 0,
        "cached_tokens": 1, "deadline": "1700000060.000",
    }  # fmt: skip
    task.deadline = None
    items = submit._record_items(task, "prefill", 2, 1)
    assert dict(zip(items[::2], items[1::2], strict=True))["deadline"] == ""
    assert speculation_record({}).changes() == {}
    spec = speculation_record({"num_draft_tokens": 4, "num_accepted_tokens": None})
    assert spec.changes() == {"draft_tokens": 4, "accepted_tokens": 0}
