"""Admin CLI of a 3-shard stack on a real Valkey: the shard count from Redis, status per shard,
requests and dead letters found on their shard, drain on every shard a worker serves."""

from __future__ import annotations

import json
import time

from kvrelay.cli.main import main
from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk
from kvrelay.pipeline.queue.progress import Progress, tail_entry
from kvrelay.pipeline.queue.streams import Streams
from tests.queue_state import ids_on_every_shard

PREFIX = "adms:"
KEYS = Keys(PREFIX, shards=3)


def cli(capsys, valkey, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--redis-url", valkey.url, "--key-prefix", PREFIX])
    out, err = capsys.readouterr()
    return code, out, err


def worker(r, keys: Keys, name: str, role: str) -> None:
    fields = {"name": name, "role": role, "pid": 7, "updated": time.time(), "load": 1}
    r.hset(keys.worker(name), mapping=fields)
    r.expire(keys.worker(name), 30)


def seed(r) -> dict[int, Streams]:
    r.set(KEYS.shard_count, 3)  # what the stack's processes wrote: the CLI reads it
    streams = {}
    for shard in KEYS.all():
        s = streams[shard.shard] = Streams(r, shard, "w1")
        s.ensure_group(shard.prefill_stream, PREFILL_GROUP)
        worker(r, shard, "decode-0", "decode")  # beats on every shard
    worker(r, KEYS.at(2), "prefill-2", "prefill")  # serves shard 2 only
    for shard, count in ((1, 2), (2, 1)):
        keys = KEYS.at(shard)
        for i in range(count):
            rid = ids_on_every_shard(f"t{i}")[shard]
            task = PrefillTask(request_id=rid, prompt_token_ids=[1, 2], sampling={})
            r.xadd(keys.prefill_stream, {MESSAGE_FIELD: task.encode()})
    return streams


def test_status_shows_each_shards_load_and_each_worker_once(r, valkey_session, capsys):
    seed(r)
    code, out, _ = cli(capsys, valkey_session, "status", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["shards"] == 3
    assert sorted(w["name"] for w in data["workers"]) == ["decode-0", "prefill-2"]
    rows = [(s["shard"], s["stage"], s["length"], s["lag"]) for s in data["streams"]]
    assert rows == [
        (0, "prefill", 0, 0), (0, "decode", 0, None),
        (1, "prefill", 2, 2), (1, "decode", 0, None),
        (2, "prefill", 1, 1), (2, "decode", 0, None),
    ]  # fmt: skip
    code, out, _ = cli(capsys, valkey_session, "status")
    assert code == 0 and "{adms.1}:stream:prefill" in out and "{adms.2}:stream:prefill" in out


def test_requests_and_dead_letters_are_found_on_their_shard(r, valkey_session, capsys):
    streams = seed(r)
    rid = ids_on_every_shard("run")[1]
    one = KEYS.at(1)
    r.hset(one.request(rid), mapping={"status": "decoding", "prompt_tokens": 2})
    r.hset(one.progress, rid, Progress(emitted=2, owner="w/1-0").encode())
    r.hset(one.tail("w"), 1, tail_entry([(rid, TokenChunk(0, [5, 6], text="hi").encode())]))
    code, out, _ = cli(capsys, valkey_session, "requests", "show", rid, "--json")
    data = json.loads(out)
    assert (code, data["status"], data["output_text"], data["emitted"]) == (0, "decoding", "hi", 2)
    assert cli(capsys, valkey_session, "requests", "cancel", rid)[0] == 0
    assert Progress.parse(r.hget(one.progress, rid)).cancelled
    # a dead letter on shards 1 and 2 each
    reasons = {}
    for shard in (1, 2):
        keys, s = KEYS.at(shard), streams[shard]
        [entry] = s.read(keys.prefill_stream, PREFILL_GROUP, 1, None)
        task = PrefillTask.decode(entry.payload)
        s.dead_letter(keys.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload,
                      f"boom {shard}", task.request_id)  # fmt: skip
        reasons[shard] = (f"boom {shard}", task.request_id)
    code, out, _ = cli(capsys, valkey_session, "dlq", "ls", "--json")
    rows = json.loads(out)
    assert sorted((row["reason"], row["request_id"]) for row in rows) == sorted(reasons.values())
    # with several shards an entry's id names its shard (two DLQs can hold the same entry id)
    assert sorted(row["dlq_id"].rpartition("@")[2] for row in rows) == ["1", "2"]
    two = next(row for row in rows if row["reason"] == "boom 2")
    code, out, _ = cli(capsys, valkey_session, "dlq", "show", two["dlq_id"], "--json")
    assert json.loads(out)["task"]["request_id"] == reasons[2][1]
    code, out, _ = cli(capsys, valkey_session, "dlq", "replay", two["dlq_id"])
    assert code == 0 and out.startswith(f"replayed {two['dlq_id']} (request {reasons[2][1]}) to ")
    # back on its own shard's stream, a fresh progress there
    [replayed] = streams[2].read(KEYS.at(2).prefill_stream, PREFILL_GROUP, 5, None)
    assert PrefillTask.decode(replayed.payload).request_id == reasons[2][1]
    assert r.hget(KEYS.at(2).request(reasons[2][1]), "status") == b"queued"
    assert [r.xlen(k.dlq) for k in KEYS.all()] == [0, 1, 0]
    code, out, _ = cli(capsys, valkey_session, "dlq", "purge", "--yes")
    assert out.strip() == "purged 1 entry" and [r.xlen(k.dlq) for k in KEYS.all()] == [0, 0, 0]


def test_drain_flags_the_worker_on_every_shard_it_serves(r, valkey_session, capsys):
    seed(r)
    code, _, _ = cli(capsys, valkey_session, "drain", "decode-0", "--wait-s", "0")
    assert code == 0
    assert [r.hget(k.worker("decode-0"), "drain") for k in KEYS.all()] == [b"1"] * 3
    assert [r.exists(k.worker("prefill-2")) for k in KEYS.all()] == [0, 0, 1]


def test_an_entry_id_two_shards_share_must_name_its_shard(r, valkey_session, capsys):
    seed(r)
    for shard in (1, 2):  # the same stream entry id in two shards' DLQs
        fields = {"payload": b"", "reason": f"boom {shard}", "request_id": f"x{shard}"}
        r.xadd(KEYS.at(shard).dlq, fields, id="1700000000000-0")
    code, out, err = cli(capsys, valkey_session, "dlq", "show", "1700000000000-0", "--json")
    assert (code, out) == (2, "")
    assert "DLQ entry 1700000000000-0 is on several shards: name one" in err
    assert "(1700000000000-0@1, 1700000000000-0@2)" in err
    code, out, _ = cli(capsys, valkey_session, "dlq", "show", "1700000000000-0@2", "--json")
    assert (code, json.loads(out)["reason"], json.loads(out)["dlq_id"]) == (
        0, "boom 2", "1700000000000-0@2",
    )  # fmt: skip
    code, _, _ = cli(capsys, valkey_session, "dlq", "show", "1700000000000-0@0", "--json")
    assert code != 0  # shard 0 holds no such entry
