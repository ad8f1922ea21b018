"""One dead-letter (`dlq` stream) entry as a typed record: every reader and writer goes through it.

`lua/dead_letter.lua` writes the entries (its `${DLQ.REASON}`-style placeholders are `DlqField`'s
values); `kvrelay.pipeline.queue.dlq` reads them with `DeadLetter.decode` for `kvrelay dlq`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.keys import MESSAGE_FIELD
from kvrelay.core.record import as_str, parse_float


class DlqField:
    """The fields of a dead-letter entry besides MESSAGE_FIELD (the payload, copied as it was)."""

    REASON = "reason"
    STREAM = "stream"  # the work stream it was taken from
    ENTRY_ID = "id"  # its entry id there
    CONSUMER = "consumer"
    REQUEST_ID = "request_id"  # "" when the payload did not say
    TIME = "time"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A typed DLQ entry; a field that is absent is empty (`time`: None, also when malformed)."""

    dlq_id: str = ""  # its id in the dlq stream (the entry's, not a field)
    payload: bytes = b""  # the original entry's payload, byte for byte
    reason: str = ""
    stream: str = ""
    entry_id: str = ""
    consumer: str = ""
    request_id: str = ""
    time: float | None = None  # unix seconds
    # fields this version does not know, as stored
    extra: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def decode(cls, dlq_id: Any, raw: Mapping[Any, Any]) -> DeadLetter:
        """From an XRANGE entry (id and fields, bytes or str). Never raises on a value."""
        values: dict[str, Any] = {}
        extra: dict[str, str] = {}
        payload = b""
        for key, value in raw.items():
            name = as_str(key)
            if name == MESSAGE_FIELD.decode():
                payload = value if isinstance(value, bytes) else as_str(value).encode()
            elif name in _ATTRS:
                values[_ATTRS[name]] = as_str(value)
            else:
                extra[name] = as_str(value)
        when = values.pop("time", "")
        return cls(
            as_str(dlq_id), payload, **values, time=parse_float(when) if when else None, extra=extra
        )

    def encode(self) -> dict[bytes | str, bytes | str]:
        """The XADD mapping, as `dead_letter.lua` writes it (the payload first)."""
        out: dict[bytes | str, bytes | str] = {MESSAGE_FIELD: self.payload}
        for name, attr in _ATTRS.items():
            value = getattr(self, attr)
            out[name] = "" if value is None else f"{value:.3f}" if attr == "time" else value
        return out

    def public(self) -> dict[str, Any]:
        """The JSON view (`kvrelay dlq ls/show`): the DLQ id, then every field under its stored
        name, empty ones None; unknown fields as stored."""
        out: dict[str, Any] = {"dlq_id": self.dlq_id}
        for name, attr in _ATTRS.items():
            value = getattr(self, attr)
            out[name] = None if value == "" else value
        return {**out, **self.extra}


# stored name -> attribute, in the order dead_letter.lua writes them
_ATTRS = {
    DlqField.REASON: "reason",
    DlqField.STREAM: "stream",
    DlqField.ENTRY_ID: "entry_id",
    DlqField.CONSUMER: "consumer",
    DlqField.REQUEST_ID: "request_id",
    DlqField.TIME: "time",
}
FIELDS = frozenset(_ATTRS)
