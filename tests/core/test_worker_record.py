"""The `worker:{name}` hash's typed record: decode/encode round trip, old and malformed hashes."""

from __future__ import annotations

from kvrelay.core.enums import Stage, WorkerField
from kvrelay.core.worker_record import HEARTBEAT_FIELDS, WorkerRecord

FULL = WorkerRecord(
    name="decode-0",
    role=Stage.DECODE,
    host="h1",
    pid=42,
    consumer="decode-0.1",
    updated=1700000000.125,
    load=3,
    drain=True,
    draining=True,
    model="m",
    fingerprint="fp",
    metrics_port=9100,
    max_num_seqs=64,
    kernel_isa="avx512",
    kv_dtype="bfloat16",
    attention="bf16",
    speculation="ngram",
    running=2,
    waiting=1,
    tokens_per_s=12.5,
)


def test_round_trip_as_redis_returns_it():
    encoded = FULL.encode()
    assert list(encoded) == [str(f) for f in WorkerField]
    assert encoded[WorkerField.UPDATED] == "1700000000.125"
    assert encoded[WorkerField.TOKENS_PER_S] == "12.5"
    assert (encoded[WorkerField.DRAIN], encoded[WorkerField.PID]) == ("1", "42")
    raw = {k.encode(): v.encode() for k, v in encoded.items()}  # bytes, as HGETALL gives
    decoded = WorkerRecord.decode(raw)
    assert decoded == FULL
    assert decoded is not None and decoded.role is Stage.DECODE


def test_heartbeat_fields_leave_the_flags_to_admin_and_lua():
    encoded = WorkerRecord(name="w").encode(HEARTBEAT_FIELDS)
    assert WorkerField.DRAIN not in encoded and WorkerField.DRAINING not in encoded
    assert encoded[WorkerField.NAME] == "w" and encoded[WorkerField.METRICS_PORT] == ""


def test_missing_fields_take_defaults():
    assert WorkerRecord.decode({}) is None
    old = WorkerRecord.decode({b"role": b"prefill", b"model": b"m"})
    assert old == WorkerRecord(role=Stage.PREFILL, model="m")
    assert old is not None
    assert (old.pid, old.load, old.running, old.metrics_port, old.updated) == (None,) * 5
    assert (old.drain, old.draining, old.stopped) == (False, False, False)


def test_malformed_values_never_raise():
    record = WorkerRecord.decode(
        {
            "pid": "x",
            "load": "1.5",
            "updated": "nan",
            "tokens_per_s": "fast",
            "metrics_port": "",
            "role": "verifier",  # a role this version does not know
            "draining": "0",
            "drain": "yes",
            "newer_field": "v",
        }
    )
    assert record is not None
    assert (record.pid, record.load, record.updated, record.tokens_per_s) == (None,) * 4
    assert record.metrics_port is None and record.role == "verifier"
    assert (record.draining, record.drain, record.stopped) == (False, True, True)
    assert record.extra == {"newer_field": "v"}


def test_status_keeps_the_hash_fields_and_order():
    raw = {"name": "w", "pid": "7", "draining": "1", "metrics_port": "", "x": "y", "role": "decode"}
    record = WorkerRecord.decode(raw)
    assert record is not None
    status = record.status()
    assert status == {
        "name": "w",
        "pid": 7,
        "draining": 1,
        "metrics_port": None,
        "x": "y",
        "role": "decode",
    }
    assert list(status) == list(raw) and type(status["role"]) is str


def test_partial_reads_one_hget_reply():
    assert WorkerRecord.partial(WorkerField.PID, b"12").pid == 12
    assert WorkerRecord.partial(WorkerField.PID, None).pid is None
    assert WorkerRecord.partial(WorkerField.DRAINING, b"1").draining is True
    assert WorkerRecord.partial(WorkerField.CONSUMER, b"c1").consumer == "c1"
