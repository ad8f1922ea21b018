"""The `req:{id}` request record (a Redis hash): its field names and one typed view of it.

The constants are the one definition of the names: every Python reader and writer uses them,
and the Lua scripts under `kvrelay/pipeline/queue/lua/` name them by placeholder (`${EMITTED}`),
filled in from here by `kvrelay.pipeline.queue.scripts` when a script is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvrelay.core.enums import RequestStatus, Stage

STATUS = "status"
STAGE = "stage"
OWNER = "owner"
MODEL = "model"
CREATED = "created"
UPDATED = "updated"
STARTED = "started"
DEADLINE = "deadline"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
CACHED_TOKENS = "cached_tokens"
FINISH_REASON = "finish_reason"
ERROR = "error"
EMITTED = "emitted"
SOURCE = "source"
INGRESS = "ingress"
USER = "user"
KEY_ID = "key_id"
ATTACH = "attach"
CLAIM_ENTRY = "claim_entry"
CLAIM_EMITTED = "claim_emitted"
CLAIM_DELIVERY = "claim_delivery"

INT_FIELDS = frozenset(
    {
        PROMPT_TOKENS,
        COMPLETION_TOKENS,
        CACHED_TOKENS,
        EMITTED,
        ATTACH,
        CLAIM_EMITTED,
        CLAIM_DELIVERY,
    }
)
FLOAT_FIELDS = frozenset({CREATED, UPDATED, STARTED, DEADLINE})
JSON_FIELDS = frozenset({INGRESS})
FIELDS = frozenset(
    {STATUS, STAGE, OWNER, MODEL, SOURCE, USER, KEY_ID, FINISH_REASON, ERROR, CLAIM_ENTRY}
    | INT_FIELDS
    | FLOAT_FIELDS
    | JSON_FIELDS
)


def as_str(value: Any) -> str:
    """A Redis reply value as text: bytes decoded (bad UTF-8 replaced), None as ""."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else str(value)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def _float(text: str) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


@dataclass(slots=True)
class RequestRecord:
    """A typed `req:{id}`; unknown statuses/stages stay strings, numbers missing read as 0/None."""

    status: RequestStatus | str = ""
    stage: Stage | str = ""
    owner: str = ""
    model: str = ""
    created: float | None = None
    updated: float | None = None
    started: float | None = None
    deadline: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    emitted: int = 0
    source: str = ""
    ingress: dict[str, Any] | None = None
    user: str = ""
    key_id: str = ""
    attach: int = 0
    claim_entry: str = ""
    claim_emitted: int = 0
    claim_delivery: int = 0

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> RequestRecord | None:
        """From an HGETALL reply (bytes or str); None for an empty reply (no such record)."""
        if not raw:
            return None
        text = {as_str(k): as_str(v) for k, v in raw.items()}
        values: dict[str, Any] = {}
        for name in FIELDS:
            if name not in text:
                continue
            value = text[name]
            if name in INT_FIELDS:
                values[name] = _int(value)
            elif name in FLOAT_FIELDS:
                values[name] = _float(value)
            elif name in JSON_FIELDS:
                values[name] = _json(value)
            else:
                values[name] = value
        for name, enum in ((STATUS, RequestStatus), (STAGE, Stage)):
            if values.get(name) in enum._value2member_map_:
                values[name] = enum(values[name])
        return cls(**values)

    def encode(self, only: tuple[str, ...] | None = None) -> dict[str, str | int | float]:
        """HSET mapping (all fields, or the named ones); None floats become ""."""
        names = only or tuple(f.name for f in fields(self))
        out: dict[str, str | int | float] = {}
        for name in names:
            value = getattr(self, name)
            if name in JSON_FIELDS:
                out[name] = "" if value is None else json.dumps(value)
            elif value is None:
                out[name] = ""
            else:
                out[name] = str(value) if isinstance(value, str) else value
        return out

    @property
    def ended(self) -> bool:
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )


def _json(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def decode_strings(raw: Mapping[Any, Any]) -> dict[str, str]:
    """An HGETALL reply as str -> str (for callers that show the record as it is stored)."""
    return {as_str(k): as_str(v) for k, v in raw.items()}
