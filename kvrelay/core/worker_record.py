"""The `worker:{name}` heartbeat hash as one typed record: every reader and writer goes through it.

Field names are `WorkerField`'s; each field's type is declared once, on `WorkerRecord`. The
heartbeat writes `encode(HEARTBEAT_FIELDS)` (the `beat.lua` script adds `draining`, mirroring
the admin's `drain`, which only `kvrelay drain` writes). Readers `decode` a whole HGETALL reply,
or `WorkerRecord.partial` one HGET reply.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvrelay.core.enums import Stage, WorkerField
from kvrelay.core.record import as_str, field_parser, parse_float, parse_int


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A typed `worker:{name}` hash.

    A field that is absent or empty has its default (None for the numbers a table shows blank
    when unknown); so has a number that does not parse. A role this version does not know
    stays a string. `drain`/`draining` are flags: set unless empty or "0" (as `beat.lua`
    reads them).
    """

    name: str = ""
    role: Stage | str = ""
    host: str = ""
    pid: int | None = None
    consumer: str = ""  # its consumer name in the stream groups
    updated: float | None = None  # unix seconds of the last heartbeat
    load: int | None = None  # stream entries it owns
    drain: bool = False  # set by `kvrelay drain`: asks it to take no new work
    draining: bool = False  # published by the worker once it saw `drain`
    model: str = ""
    fingerprint: str = ""
    metrics_port: int | None = None  # None when it serves no metrics
    max_num_seqs: int | None = None
    kernel_isa: str = ""
    kv_dtype: str = ""
    attention: str = ""  # attention precision, resolved ("fp32", "bf16"; "" from older workers)
    speculation: str = ""  # a Speculation, resolved ("" for engines without it)
    running: int | None = None  # requests in its batch
    waiting: int | None = None  # admitted, not yet in the batch
    tokens_per_s: float | None = None
    startup_s: float | None = None  # seconds from its process's start to its engine ready
    # what decode() found, in the hash's order (known and unknown names), and the values of
    # the fields this version does not know (a newer worker's): status shows them as stored
    present: tuple[str, ...] = field(default=(), compare=False, repr=False)
    extra: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> WorkerRecord | None:
        """From an HGETALL reply (bytes or str); None for an empty reply (no such worker).
        Never raises on a value: a malformed one is its field's default."""
        if not raw:
            return None
        values: dict[str, Any] = {}
        present: list[str] = []
        extra: dict[str, str] = {}
        for key, value in raw.items():
            name, text = as_str(key), as_str(value)
            present.append(name)
            if name in _PARSERS:
                values[name] = _PARSERS[name](text) if text else _DEFAULTS[name]
            else:
                extra[name] = text
        return cls(**values, present=tuple(present), extra=extra)

    @classmethod
    def partial(cls, name: WorkerField, value: Any) -> WorkerRecord:
        """One field from an HGET reply (None: missing), the others defaults."""
        return cls.decode({name: value}) or cls()

    def encode(self, only: tuple[WorkerField, ...] | None = None) -> dict[str, str]:
        """HSET mapping (all fields, or the named ones), in WorkerField order; None is ""."""
        return {str(name): self._text(name) for name in (only or tuple(WorkerField))}

    def _text(self, name: WorkerField) -> str:
        value = getattr(self, name)
        if value is None:
            return ""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return FLOAT_FORMATS.get(name, "{}").format(value)
        return str(value)

    @property
    def stopped(self) -> bool:
        """Draining (acknowledged) or asked to drain: it takes no new entry."""
        return self.draining or self.drain

    def status(self) -> dict[str, Any]:
        """The fields the hash holds, in its order, as JSON values (`kvrelay status`): numbers
        (None when empty or malformed), flags as 0/1, the rest strings; unknown ones as stored."""
        out: dict[str, Any] = {}
        for name in self.present:
            if name not in _PARSERS:
                out[name] = self.extra.get(name, "")
                continue
            value = getattr(self, name)
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, str):
                value = str(value)  # a Stage: its string
            out[name] = value
        return out


# how the heartbeat writes its floats: milliseconds, a tenth of a token
FLOAT_FORMATS = {WorkerField.UPDATED: "{:.3f}", WorkerField.TOKENS_PER_S: "{:.1f}"}
# what a heartbeat writes: not `drain` (the admin's) nor `draining` (beat.lua's)
HEARTBEAT_FIELDS = tuple(
    f for f in WorkerField if f not in (WorkerField.DRAIN, WorkerField.DRAINING)
)


def _flag(text: str) -> bool:
    return text not in ("", "0")


_HINTS = typing.get_type_hints(WorkerRecord)
_PARSERS = {
    str(f): field_parser(_HINTS[f], {int: parse_int, float: parse_float, bool: _flag, str: str})
    for f in WorkerField
}
_DEFAULTS = {f.name: f.default for f in fields(WorkerRecord) if f.name in _PARSERS}
assert set(_PARSERS) == set(_DEFAULTS), "WorkerRecord and WorkerField name the same fields"
