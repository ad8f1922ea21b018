"""The `models` hash entry and the dead-letter entry as typed records (issue 24)."""

from __future__ import annotations

import json

from kvrelay.core.dead_letter import DeadLetter
from kvrelay.core.keys import MESSAGE_FIELD
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.sampling import GenerationDefaults


def test_published_model_round_trips_and_types_its_fields():
    entry = PublishedModel(
        fingerprint="f" * 32,
        page_size=16,
        max_model_len=8192,
        vocab_size=49152,
        files="d1",
        generation_defaults=GenerationDefaults(temperature=0.2, max_tokens=512),
    ).stamped(1700000000.12345)
    text = entry.encode()
    assert json.loads(text) == {
        "fingerprint": "f" * 32,
        "page_size": 16,
        "max_model_len": 8192,
        "vocab_size": 49152,
        "files": "d1",
        "generation_defaults": {"temperature": 0.2, "max_tokens": 512},
        "published": 1700000000.123,
    }
    assert PublishedModel.decode(text.encode()) == entry
    # absent or mistyped values are None; a bad defaults object is dropped, not fatal
    odd = '{"page_size": "16", "files": 3, "published": true, "generation_defaults": {"top_p": 5}}'
    assert PublishedModel.decode(odd) == PublishedModel()
    assert PublishedModel.decode("[1]") is None and PublishedModel.decode("{") is None
    assert json.loads(PublishedModel(page_size=16).encode()) == {"page_size": 16}
    assert entry.stale(1700000000.123 + 11, 10) and not entry.stale(1700000000.123 + 9, 10)
    assert not PublishedModel().stale(1e12, 10)  # unstamped: a worker from before the stamp
    # --served-model-name's other names: a JSON list, only strings kept
    aliased = PublishedModel(page_size=16, aliases=("a", "b"))
    assert json.loads(aliased.encode()) == {"page_size": 16, "aliases": ["a", "b"]}
    assert PublishedModel.decode(aliased.encode()) == aliased
    assert PublishedModel.decode('{"aliases": ["a", 3, ""]}') == PublishedModel(aliases=("a",))
    assert PublishedModel.decode('{"aliases": "a"}') == PublishedModel()


def test_dead_letter_decodes_xrange_entries_and_encodes_as_the_script_writes():
    letter = DeadLetter(
        dlq_id="5-0",
        payload=b"\x81\xa1v\x01",
        reason="bad",
        stream="{p}:stream:prefill",
        entry_id="1-0",
        consumer="c1",
        request_id="r1",
        time=1700000000.5,
    )
    fields = letter.encode()
    assert list(fields) == [MESSAGE_FIELD, "reason", "stream", "id", "consumer", "request_id",
                            "time"]  # fmt: skip
    assert fields["time"] == "1700000000.500"
    stored = {k if isinstance(k, bytes) else k.encode(): v if isinstance(v, bytes) else v.encode()
              for k, v in fields.items()}  # fmt: skip
    assert DeadLetter.decode(b"5-0", stored) == letter
    assert letter.public() == {
        "dlq_id": "5-0",
        "reason": "bad",
        "stream": "{p}:stream:prefill",
        "id": "1-0",
        "consumer": "c1",
        "request_id": "r1",
        "time": 1700000000.5,
    }
    # not written by kvrelay: missing fields empty, a bad time None, unknown fields kept
    other = DeadLetter.decode("6-0", {b"reason": b"r", b"time": b"soon", b"note": b"x"})
    assert (other.payload, other.reason, other.time, other.request_id) == (b"", "r", None, "")
    assert other.public()["note"] == "x" and other.public()["request_id"] is None
