"""The `req:{id}` request record (a Redis hash): its field names and one typed view of it.

The constants are the one definition of the names: every Python reader and writer uses them,
and the Lua scripts under `kvrelay/pipeline/queue/lua/` name them by placeholder (`${EMITTED}`),
filled in from here by `kvrelay.pipeline.queue.scripts` when a script is loaded. Each field's
type is declared once, on `RequestRecord`; the sets of numeric fields are derived from it.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Callable, Mapping, Sequence
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
# speculative decoding on the worker that finished it: draft tokens verified, and accepted
DRAFT_TOKENS = "draft_tokens"
ACCEPTED_TOKENS = "accepted_tokens"
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
CLAIM_STRIKES = "claim_strikes"
CLAIM_SEEN = "claim_seen"
CLAIM_RAN = "claim_ran"
# a random id per submission: the submit script recognises its own retry by it
SUBMISSION_ID = "submission_id"
# a request answered by several choices (n, best_of, a list of prompts): the parent record
# holds how many, each choice's own record `{id}.{k}` names its parent
NUM_CHOICES = "num_choices"
PARENT = "parent"
# usage accounting (`core.usage`): who the request's usage counts to, JSON [API key name,
# tenant, model asked], written by the ingress; a choice's: how many choices its request has
# per prompt (choice k counts its prompt's tokens when k is a multiple, the request when 0)
ACCOUNT = "account"
PER_PROMPT = "per_prompt"

# HSET values of the record, as the writers hand them to redis-py or to a script's ARGV
Encoded = dict[str, str | int | float]
# the decimals the Python writers stamp a time with (the workers' and the step's: milliseconds)
MILLIS = 3


def as_str(value: Any) -> str:
    """A Redis reply value as text: bytes decoded (bad UTF-8 replaced), None as ""."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else str(value)


@dataclass(slots=True)
class RequestRecord:
    """A typed `req:{id}`: counts are ints, times unix seconds (floats), `ingress` an object.

    A field that is absent, empty or not of its type is None; a status or stage this version
    does not know stays a string.
    """

    status: RequestStatus | str | None = None
    stage: Stage | str | None = None
    owner: str | None = None
    model: str | None = None
    created: float | None = None
    updated: float | None = None
    started: float | None = None
    deadline: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    emitted: int | None = None
    source: str | None = None
    ingress: dict[str, Any] | None = None
    user: str | None = None
    key_id: str | None = None
    attach: int | None = None
    claim_entry: str | None = None
    claim_emitted: int | None = None
    claim_delivery: int | None = None
    claim_strikes: int | None = None  # holders that died running it since its last progress
    claim_seen: int | None = None  # the delivery the last claim counted its strikes at
    claim_ran: int | None = None  # the last delivery whose holder began running it as a suspect
    submission_id: str | None = None
    num_choices: int | None = None
    parent: str | None = None
    account: str | None = None
    per_prompt: int | None = None

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> RequestRecord | None:
        """From an HGETALL reply (bytes or str); None for an empty reply (no such record)."""
        if not raw:
            return None
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name, text = as_str(key), as_str(value)
            if name in _PARSERS:  # other fields (a newer version's) are left out
                values[name] = _PARSERS[name](text) if text else None
        return cls(**values)

    @classmethod
    def decode_fields(cls, names: Sequence[str], values: Sequence[Any]) -> RequestRecord:
        """From the reply of an HMGET of `names` (an HGET: one name, its value in a list): the
        fields read, typed; the others (and what the record lacks) None."""
        raw = {name: value for name, value in zip(names, values, strict=True) if value is not None}
        return cls.decode(raw) or cls()

    def encode(
        self, only: tuple[str, ...] | None = None, places: Mapping[str, int] | None = None
    ) -> Encoded:
        """HSET mapping (all fields, or the named ones); None becomes "". A float field named
        in `places` is written with that many decimals (`f"{value:.3f}"`), others as they are."""
        return {name: self._value(name, places) for name in only or FIELD_ORDER}

    def changes(self, places: Mapping[str, int] | None = None) -> Encoded:
        """HSET mapping of the fields this record sets (those not None, "" and 0 included), in
        field order: a writer's update, `RequestRecord(status=..., owner="").changes()`."""
        names = tuple(name for name in FIELD_ORDER if getattr(self, name) is not None)
        return {name: self._value(name, places) for name in names}

    def _value(self, name: str, places: Mapping[str, int] | None) -> str | int | float:
        value = getattr(self, name)
        if value is None:
            return ""
        if name in JSON_FIELDS:
            return json.dumps(value)
        if isinstance(value, str):
            return str(value)  # an enum: its value
        if places and name in places and isinstance(value, float | int):
            return f"{value:.{places[name]}f}"
        return typing.cast("int | float", value)

    def public(self) -> dict[str, Any]:
        """The fields clients see (GET /v1/requests/{id}, the producer client's status()):
        every one of PUBLIC_FIELDS, as JSON types, None for what the record lacks."""
        out: dict[str, Any] = {}
        for name in PUBLIC_FIELDS:
            value = getattr(self, name)
            out[name] = str(value) if isinstance(value, str) else value  # an enum: its string
        return out

    @property
    def ended(self) -> bool:
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )


def parse_int(text: str) -> int | None:
    """A stored integer; None when it does not parse (a reader never raises on a value)."""
    try:
        return int(text)
    except ValueError:
        return None


def parse_float(text: str) -> float | None:
    """A stored finite float; None when it does not parse or is nan/inf (JSON has neither)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # JSON has no nan or inf


def _json(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_enum(enum: type[RequestStatus] | type[Stage]) -> Callable[[str], Any]:
    """A parser to the enum's member, or the text itself for a value this version lacks."""

    def parse(text: str) -> Any:
        return enum(text) if text in enum._value2member_map_ else text

    return parse


def field_parser(hint: Any, parsers: Mapping[Any, Callable[[str], Any]]) -> Callable[[str], Any]:
    """The text -> value function of a stored field, from its declared type (None left out):
    a `RequestStatus` or `Stage` through parse_enum, another type through `parsers`."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind in (RequestStatus, Stage):
        return parse_enum(kind)
    return parsers[kind]


_HINTS = typing.get_type_hints(RequestRecord)
FIELD_ORDER = tuple(f.name for f in fields(RequestRecord))
_PARSERS = {
    name: field_parser(_HINTS[name], {int: parse_int, float: parse_float, dict: _json, str: str})
    for name in FIELD_ORDER
}
FIELDS = frozenset(FIELD_ORDER)
INT_FIELDS = frozenset(n for n, p in _PARSERS.items() if p is parse_int)
FLOAT_FIELDS = frozenset(n for n, p in _PARSERS.items() if p is parse_float)
JSON_FIELDS = frozenset(n for n, p in _PARSERS.items() if p is _json)
# what only the ingress and the step script read (delivery options, the owning API key, attach
# count, the submission's own id, the fan-out links, the usage account): never shown as such
# to clients
PRIVATE_FIELDS = frozenset(
    {INGRESS, KEY_ID, ATTACH, SUBMISSION_ID, NUM_CHOICES, PARENT, ACCOUNT, PER_PROMPT}
)
PUBLIC_FIELDS = tuple(name for name in FIELD_ORDER if name not in PRIVATE_FIELDS)


def decode_strings(raw: Mapping[Any, Any]) -> dict[str, str]:
    """An HGETALL reply as str -> str (for callers that show the record as it is stored)."""
    return {as_str(k): as_str(v) for k, v in raw.items()}
