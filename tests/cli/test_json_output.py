"""`--json` output of the admin commands: numbers are numbers and an absent value is null, in
`status`, `requests show`, `dlq ls|show|replay` (Redis keeps every field as text)."""

from __future__ import annotations

import json
import time

from kvrelay.cli.main import main
from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask
from kvrelay.pipeline.queue import streams as streams_module
from kvrelay.pipeline.queue.streams import Streams

KEYS = Keys("js:")


def cli(capsys, valkey, *argv: str, err: str = "") -> tuple[int, object]:
    capsys.readouterr()
    code = main([*argv, "--redis-url", valkey.url, "--key-prefix", "js:", "--json"])
    out, printed = capsys.readouterr()
    assert printed == err
    return code, json.loads(out)


def dead_letters(r) -> tuple[str, str]:
    """A DLQ entry of request p1 (a valid task) and one of a payload naming no request."""
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.ensure_group(KEYS.decode_stream, DECODE_GROUP)
    task = PrefillTask(request_id="p1", prompt_token_ids=[1, 2], sampling={})
    r.hset(KEYS.request("p1"), mapping={"status": "queued", "emitted": 0})
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    known = s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload,
                          "rejected by the engine", "p1")  # fmt: skip
    r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: b"\x81\xa1v\x63"})
    [entry] = s.read(KEYS.decode_stream, DECODE_GROUP, 1, None)
    unknown = s.dead_letter(KEYS.decode_stream, DECODE_GROUP, entry.entry_id, entry.payload, "bad")
    return known, unknown


def test_dlq_json_has_numbers_and_nulls(r, valkey_session, capsys, fake_clock):
    fake_clock.install(streams_module)  # the dead-letter time is the clock's, rounded to ms
    fake_clock.sleep(4.5678)
    known, unknown = dead_letters(r)
    code, rows = cli(capsys, valkey_session, "dlq", "ls")
    # before: "time": "1795550384.802" (a string) and "request_id": "" for the unknown request
    assert code == 0 and [(row["dlq_id"], row["request_id"]) for row in rows] == [
        (known, "p1"), (unknown, None)]  # fmt: skip
    assert [row["time"] for row in rows] == [round(fake_clock.time(), 3)] * 2
    assert set(rows[1]) == {"dlq_id", "reason", "stream", "id", "consumer", "request_id", "time"}
    code, entry = cli(capsys, valkey_session, "dlq", "show", unknown)
    assert (entry["request_id"], entry["time"], entry["kind"]) == (None, rows[1]["time"], "invalid")
    warning = f"kvrelay dlq: warning: replaying invalid entry {unknown} (--force): bad\n"
    code, report = cli(capsys, valkey_session, "dlq", "replay", unknown, "--force", err=warning)
    [done] = report["replayed"]
    assert (done["request_id"], done["dlq_id"], done["forced"]) == (None, unknown, True)


def test_requests_show_json_gives_null_for_empty_fields(r, valkey_session, capsys):
    r.hset(KEYS.request("q1"), mapping={"status": "decoding", "finish_reason": "", "error": "",
                                        "emitted": "2", "created": "1700000000.5"})  # fmt: skip
    code, data = cli(capsys, valkey_session, "requests", "show", "q1")
    # before: "finish_reason": "", "error": ""
    assert code == 0
    assert (data["status"], data["finish_reason"], data["error"]) == ("decoding", None, None)
    assert (data["emitted"], data["created"], data["output_text"]) == (2, 1700000000.5, "")


def test_status_json_gives_null_for_fields_a_worker_left_empty(r, valkey_session, capsys):
    r.hset(KEYS.worker("w1"), mapping={"name": "w1", "role": "decode", "updated": time.time(),
                                       "pid": "42", "metrics_port": "", "store_node": "",
                                       "tokens_per_s": "1.5"})  # fmt: skip
    code, data = cli(capsys, valkey_session, "status")
    [w] = data["workers"]
    assert code == 0
    assert (w["name"], w["pid"], w["tokens_per_s"]) == ("w1", 42, 1.5)
    assert (w["metrics_port"], w["store_node"], w["metrics"]) == (None, None, None)
    assert isinstance(data["time"], float) and data["dlq"] == 0
