"""The store node protocol: msgspec Structs encoded as MessagePack maps.

A request is one Struct per op, tagged by `op` (`{"op": "get", "id": 7, "keys": [...], ...}`);
the node decodes every request with one `Decoder` over their union, so types, key sizes and the
key count are checked in C before a handler runs. A request that does not decode gets an error
reply saying why (`decode_request` raises StoreError with the id it could recover); the node
never crashes on input.

A reply is a `Reply` (`id`, `ok`, and `error` / `kind` when not ok) whose subclass per op adds
typed fields, all with defaults: an error reply decodes as any of them, so the client decodes
every reply once, with the decoder of the reply type it expects.

Store peers speak their own session protocol (`transport/session.py`); the fetch request a
transport unpacked is checked as a `Fetch` (`decode_fetch`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, get_args

import msgspec

from kvrelay.kvstore.errors import IncompatiblePageError, StoreError

MAX_KEYS = 4096
KEY_BYTES = 16

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Slots = list[int]

KEYS_ERROR = f"keys must be a list of at most {MAX_KEYS} {KEY_BYTES}-byte page keys"
SLOTS_ERROR = "slots must be a list of slot numbers"


# -- requests -------------------------------------------------------------------------------
class Request(msgspec.Struct, kw_only=True, tag_field="op", omit_defaults=True):
    """What every request carries: its id (echoed in the reply) and `noreply`."""

    id: int = 0
    noreply: bool = False  # fire-and-forget: the node answers nothing (release)


class Paged(Request, kw_only=True):
    """A request about pages of one model: the node refuses another fingerprint or page size."""

    fp: str | None = None
    page_bytes: int | None = None
    keys: Keys = msgspec.field(default_factory=list)

    def check(self, fingerprint: str | None, page_bytes: int) -> list[bytes]:
        """The request's keys, once its fingerprint and page size match; IncompatiblePageError."""
        fp = self.fp
        if fingerprint is not None and fp is not None and fp != fingerprint:
            raise IncompatiblePageError(
                f"model fingerprint mismatch: this store holds pages of {fingerprint!r}, "
                f"request is for {fp!r}"
            )
        pb = self.page_bytes
        if pb is not None and pb != page_bytes:
            raise IncompatiblePageError(
                f"page size mismatch: this store holds {page_bytes}-byte pages, request has {pb}"
            )
        return self.keys


class Hello(Paged, tag="hello", kw_only=True):
    """Check fingerprint and page size; the reply names the arena to map."""


class Put(Paged, tag="put", kw_only=True):
    """Reserve a slot per new key (-1: stored already, or no room)."""


class Commit(Paged, tag="commit", kw_only=True):
    """Publish the written slots of a put (one per key)."""

    slots: Slots = msgspec.field(default_factory=list)


class Abort(Paged, tag="abort", kw_only=True):
    """Free the reserved slots of a put that was not written."""

    slots: Slots = msgspec.field(default_factory=list)


class Get(Paged, tag="get", kw_only=True):
    """Pin the longest available prefix of `keys` (from peers too, when `remote`)."""

    remote: bool = True


class Release(Request, tag="release", kw_only=True):
    """Unpin slots a get pinned."""

    slots: Slots = msgspec.field(default_factory=list)


class Contains(Paged, tag="contains", kw_only=True):
    """How many leading keys the store holds (here, or on a peer when `remote`)."""

    remote: bool = True


class Stats(Request, tag="stats", kw_only=True):
    """Page counts, counters and addresses of the node."""


class Ls(Request, tag="ls", kw_only=True):
    """Keys per tier, least recently used first."""

    limit: int = 1000


class Evict(Request, tag="evict", kw_only=True):
    """Drop every unpinned page of one tier."""

    tier: str = "host"


class Demote(Paged, tag="demote", kw_only=True):
    """Make these pages the arena's first to evict (no sequence's window reads them any more:
    a sliding-window layer group's pages behind its window)."""


class Retain(Paged, tag="retain", kw_only=True):
    """Keep these pages for a session until `ttl_s` from now (a worker sends it, one-way, when
    a request of the session finishes; a later one only extends the TTL)."""

    session: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ttl_s: Annotated[float, msgspec.Meta(ge=0)]


class Prefetch(Paged, tag="prefetch", kw_only=True):
    """Bring the leading pages of `keys` into the arena ahead of the request that will read
    them: from disk, and from peers when `remote`."""

    remote: bool = False


class Fetch(Paged, tag="fetch", kw_only=True):
    """A peer's fetch (store-to-store session, not the local socket)."""


NodeRequest = (
    Hello
    | Put
    | Commit
    | Abort
    | Get
    | Release
    | Contains
    | Stats
    | Ls
    | Evict
    | Demote
    | Retain
    | Prefetch
)
OPS = sorted(str(c.__struct_config__.tag) for c in get_args(NodeRequest))


# -- replies --------------------------------------------------------------------------------
class Reply(msgspec.Struct, kw_only=True):
    """Every reply: `ok`, or `error` and the StoreError subclass name in `kind`.

    Every field goes on the wire (no `omit_defaults`): a reply read as a plain map still says
    `ok`."""

    id: int | None = None
    ok: bool = False
    error: str = ""
    kind: str = ""


class HelloReply(Reply, kw_only=True):
    node_id: str = ""
    arena: str = ""  # the arena file to map
    num_slots: int = 0
    page_bytes: int = 0
    fingerprint: str | None = None
    remote: bool = False  # whether the node fetches from peers
    gen: int | None = None  # the arena's generation: remap when it changes


class SlotsReply(Reply, kw_only=True):
    """put: a slot per key (-1 to skip); get: the pinned slots of the available prefix."""

    slots: Slots = msgspec.field(default_factory=list)
    gen: int | None = None


class CommitReply(Reply, kw_only=True):
    errors: list[str | None] = msgspec.field(default_factory=list)  # per key: None or why


class CountReply(Reply, kw_only=True):
    n: int = 0  # contains: prefix length; evict: pages dropped


class StatsReply(Reply, kw_only=True):
    node_id: str = ""
    pages: dict[str, int] = msgspec.field(default_factory=dict)
    page_bytes: int = 0
    counters: dict[str, dict[str, int | float]] = msgspec.field(default_factory=dict)
    addresses: dict[str, str] = msgspec.field(default_factory=dict)


class LsReply(Reply, kw_only=True):
    tiers: dict[str, list[str]] = msgspec.field(default_factory=dict)  # hex keys, LRU first


_ENCODER = msgspec.msgpack.Encoder()
_REQUESTS: msgspec.msgpack.Decoder[NodeRequest] = msgspec.msgpack.Decoder(NodeRequest)
_REPLIES: dict[type, msgspec.msgpack.Decoder[Any]] = {}


class _Envelope(msgspec.Struct):
    """What an undecodable request may still tell: who to answer, and whether to."""

    id: Any = None
    op: Any = None
    noreply: Any = False


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


class BadRequest(StoreError):
    """A request that does not decode; carries what is known of it to address the reply."""

    def __init__(self, message: str, req_id: int | None = None, noreply: bool = False):
        super().__init__(message)
        self.req_id, self.noreply = req_id, noreply


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def _why(exc: msgspec.ValidationError, op: object) -> str:
    """The meaning of a validation error, in the node's words."""
    text = str(exc)
    if text.endswith("`$.op`") or "missing required field `op`" in text:
        return f"unknown op {op!r}; known: {OPS}"
    if "`$.keys" in text:
        return f"{KEYS_ERROR} ({text})"
    if "`$.slots" in text:
        return f"{SLOTS_ERROR} ({text})"
    return (
        f"malformed {op} request: {text}" if isinstance(op, str) else f"malformed request: {text}"
    )


def decode_request(body: bytes) -> NodeRequest:
    """One request off the local socket; BadRequest (a StoreError) says what is wrong."""
    try:
        return _REQUESTS.decode(body)
    except msgspec.ValidationError as exc:
        try:
            env = _ENVELOPE.decode(body)
        except msgspec.MsgspecError:
            raise BadRequest(f"malformed request: {exc}") from None
        req_id = env.id if type(env.id) is int else None
        raise BadRequest(_why(exc, env.op), req_id, env.noreply is True) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed request: {exc}") from None


def decode_fetch(req: dict) -> Fetch:
    """A peer's fetch request (the map a transport unpacked); StoreError says what is wrong."""
    op = req.get("op")
    if op != "fetch":  # a lone tagged Struct would take a map without its tag
        raise StoreError(f"unknown transfer op {op!r}")
    try:
        return msgspec.convert(req, Fetch)
    except msgspec.ValidationError as exc:
        raise StoreError(_why(exc, op)) from None


R = TypeVar("R", bound=Reply)


def decode_reply(body: bytes, kind: type[R]) -> R:
    """A reply of `kind` (or an error reply, which decodes as any kind); StoreError."""
    decoder = _REPLIES.get(kind)
    if decoder is None:
        decoder = _REPLIES[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise StoreError(f"malformed reply from the store node: {exc}") from None
