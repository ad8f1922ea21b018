"""Admin CLI on a real Valkey: status, requests show/cancel, dlq ls/show/replay/purge, drain."""

from __future__ import annotations

import json
import time

import pytest
import redis

from kvrelay.pipeline.cli import main
from kvrelay.pipeline.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.pipeline.messages import PrefillTask, TokenChunk
from kvrelay.pipeline.streams import Streams

KEYS = Keys("adm:")


@pytest.fixture
def r(valkey_session):
    client = redis.Redis.from_url(valkey_session.url)
    client.flushdb()
    yield client
    client.close()


def cli(capsys, valkey, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--redis-url", valkey.url, "--key-prefix", "adm:"])
    out, err = capsys.readouterr()
    return code, out, err


def seed(r) -> Streams:
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.ensure_group(KEYS.decode_stream, DECODE_GROUP)
    for i in range(3):
        task = PrefillTask(request_id=f"q{i}", prompt_token_ids=[1, 2], sampling={})
        r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    s.read(KEYS.prefill_stream, PREFILL_GROUP, 2, None)
    r.hset(
        KEYS.worker("decode-0"),
        mapping={"name": "decode-0", "role": "decode", "pid": 7, "updated": time.time(), "load": 2},
    )
    r.expire(KEYS.worker("decode-0"), 30)
    r.hset(KEYS.request("q0"), mapping={"status": "decoding", "prompt_tokens": 2})
    r.hset(KEYS.request("q1"), mapping={"status": "finished"})
    r.xadd(KEYS.out("q0"), {MESSAGE_FIELD: TokenChunk(0, [5, 6], text="hi").encode()})
    return s


def test_status_json(r, valkey_session, capsys):
    seed(r)
    code, out, _ = cli(capsys, valkey_session, "status", "--json")
    assert code == 0
    data = json.loads(out)
    assert [w["name"] for w in data["workers"]] == ["decode-0"]
    assert data["workers"][0]["load"] == "2" and 0 < data["workers"][0]["ttl_s"] <= 30
    prefill, decode = data["streams"]
    assert (prefill["length"], prefill["pending"], prefill["lag"], prefill["consumers"]) == (
        3,
        2,
        1,
        1,
    )
    assert (decode["length"], decode["pending"]) == (0, 0)
    assert data["dlq"] == 0 and data["requests_in_flight"] == 1
    assert data["requests"] == {"decoding": 1, "finished": 1}
    code, out, _ = cli(capsys, valkey_session, "status")
    assert code == 0 and "decode-0" in out and "DLQ entries: 0" in out


def test_requests_show_and_cancel(r, valkey_session, capsys):
    seed(r)
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "q0")
    data = json.loads(out)
    assert (data["status"], data["output_tokens"], data["output_text"]) == ("decoding", 2, "hi")
    assert data["finished"] is False and data["cancel_requested"] is False
    assert cli(capsys, valkey_session, "requests", "cancel", "q0")[0] == 0
    assert r.get(KEYS.cancel("q0")) == b"1"
    code, _, err = cli(capsys, valkey_session, "requests", "cancel", "nope")
    assert code == 1 and "no request 'nope'" in err


def test_dlq_ls_show_replay_purge(r, valkey_session, capsys):
    s = seed(r)
    entries = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)
    [entry] = entries  # q2
    s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload, "boom", "q2")
    code, out, _ = cli(capsys, valkey_session, "dlq", "ls", "--json")
    [row] = json.loads(out)
    assert (row["reason"], row["request_id"]) == ("boom", "q2")
    code, out, _ = cli(capsys, valkey_session, "dlq", "show", row["dlq_id"])
    shown = json.loads(out)
    assert shown["task"]["request_id"] == "q2" and shown["task"]["prompt_token_ids"] == [1, 2]
    assert r.xlen(KEYS.out("q2")) == 1  # the error chunk
    code, out, _ = cli(capsys, valkey_session, "dlq", "replay", row["dlq_id"])
    assert code == 0 and out.startswith(f"replayed {row['dlq_id']} as ")
    assert r.xlen(KEYS.dlq) == 0 and not r.exists(KEYS.out("q2"))
    assert r.hget(KEYS.request("q2"), "status") == b"queued"
    [replayed] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)
    assert PrefillTask.decode(replayed.payload).request_id == "q2"
    r.xadd(KEYS.dlq, {MESSAGE_FIELD: b"x", "reason": "r"})
    assert cli(capsys, valkey_session, "dlq", "purge")[0] == 2
    code, out, _ = cli(capsys, valkey_session, "dlq", "purge", "--yes")
    assert out.strip() == "purged 1 entries" and r.xlen(KEYS.dlq) == 0


def test_drain_and_undo(r, valkey_session, capsys):
    seed(r)
    assert cli(capsys, valkey_session, "drain", "decode-0")[0] == 0
    assert r.hget(KEYS.worker("decode-0"), "drain") == b"1"
    assert cli(capsys, valkey_session, "drain", "decode-0", "--undo")[0] == 0
    assert r.hget(KEYS.worker("decode-0"), "drain") == b"0"
    code, _, err = cli(capsys, valkey_session, "drain", "ghost")
    assert code == 1 and "no live worker 'ghost'" in err


def test_store_line_shows_every_tier_even_before_lookups():
    from kvrelay.pipeline.cli_admin import _store_line

    stats = {
        "node_id": "n0",
        "pages": {"host": 3, "host_slots": 8, "disk": 1, "disk_capacity": 100},
        "counters": {"hits": {"host": 3.0}, "misses": {"host": 1.0, "disk": 1.0}},
    }
    assert _store_line(stats) == (
        "store n0: host 3/8 pages, disk 1/100 pages, host hit rate 75% (3/4), "
        "disk hit rate 0% (0/1), remote hit rate - (0/0)"
    )
    assert _store_line({"error": "no node"}) == "store: unavailable (no node)"
