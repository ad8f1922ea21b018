"""Wire messages carried in Redis streams: msgspec Structs encoded as MessagePack maps.

Each map carries `t` (the kind) and `v` (the wire version). One `decode()` checks types and
ranges; new fields get defaults, unknown fields are ignored (entries written by older code carry
fields since removed), and anything that does not decode or validate raises MessageError (the
consumer sends the entry to the DLQ with that reason). Tensors never travel here: decode tasks
name pages by their keys.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from kvrelay.core.enums import FinishReason, Stage
from kvrelay.core.errors import KvrelayError
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams, refusal

WIRE_VERSION = 1
FINISH_REASONS = tuple(FinishReason)

M = TypeVar("M", bound="Message")

# A token id on the wire; the vocabulary bound is checked by the engine, which knows it.
TokenId = Annotated[int, msgspec.Meta(ge=0)]
TokenIds = list[TokenId]
NonEmptyTokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Version = Annotated[int, msgspec.Meta(ge=1, le=WIRE_VERSION)]

_ENCODER = msgspec.msgpack.Encoder()
# msgspec's refusal of a sampling value outside the constraints its field declares (a range,
# a length: core.sampling), at the field or in it (`$.sampling.stop[3]`)
_SAMPLING_RANGE = re.compile(
    r"Expected `\w+` (?:of length )?[<>]=? \S+ - at `\$\.sampling\.(\w+)(?:\[[^`]*\])?`$"
)


class MessageError(KvrelayError, ValueError):
    """A stream entry that cannot be decoded or validated; never retried."""


class Message(msgspec.Struct, kw_only=True, tag_field="t"):
    """Base of the wire messages; `kind` is the `t` tag."""

    kind: ClassVar[str] = ""
    v: Version = WIRE_VERSION
    _decoders: ClassVar[dict[type, msgspec.msgpack.Decoder]] = {}

    def to_dict(self) -> dict[str, Any]:
        """The message as plain builtins (what `encode()` writes)."""
        return msgspec.to_builtins(self)

    def encode(self) -> bytes:
        """MessagePack bytes; MessageError for values msgpack cannot carry (huge ints, bad str)."""
        try:
            return _ENCODER.encode(self)
        except OverflowError as exc:
            raise MessageError(
                f"{self.kind} cannot be encoded: Integer value out of range"
            ) from exc
        except (UnicodeEncodeError, TypeError, ValueError) as exc:
            raise MessageError(f"{self.kind} cannot be encoded: {exc}") from exc

    @classmethod
    def decode(cls: type[M], payload: bytes) -> M:
        """Decode and validate one payload; raise MessageError with the reason otherwise."""
        decoder = cls._decoders.get(cls)
        if decoder is None:
            decoder = cls._decoders[cls] = msgspec.msgpack.Decoder(cls)
        try:
            msg = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            refused = _SAMPLING_RANGE.search(str(exc))
            if refused is not None:  # in the words the ingress uses
                message = refusal(refused[1], _raw_sampling(payload).get(refused[1]))
                if message is not None:
                    raise MessageError(f"invalid sampling: {message}") from exc
            what = "unsupported wire version: " if str(exc).endswith("at `$.v`") else ""
            raise MessageError(f"{cls.__name__}: {what}{exc}") from exc
        except msgspec.DecodeError as exc:
            raise MessageError(f"payload is not MessagePack: {exc}") from exc
        msg.check()
        return msg

    def check(self) -> None:
        """Checks beyond types and ranges, made once when a payload is decoded."""


def _raw_sampling(payload: bytes) -> dict[Any, Any]:
    """The `sampling` map of a task payload, untyped (to word a refusal)."""
    data = msgspec.msgpack.decode(payload)
    sampling = data.get("sampling") if isinstance(data, dict) else None
    return sampling if isinstance(sampling, dict) else {}


MAX_SESSION_CHARS = 256
MAX_LORA_CHARS = 128  # a LoRA adapter's name (workers.model.lora.MAX_NAME_LEN)
PRIORITY_BOUND = 1 << 20  # a task's priority lies within +-this
MAX_TENANT_CHARS = 256
MAX_RETENTION_S = 366 * 86400  # the wire's bound; store nodes cut it to their own maximum


class Retention(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A request's session, whose pages the store keeps `ttl_s` seconds after the request ends
    (`prompt_cache_key`, `user`, a Responses chain; `prompt_cache_retention`)."""

    session: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_CHARS)]
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_RETENTION_S)]


class _Task(Message, kw_only=True):
    """What both task kinds share: typed sampling, validated once when decoded (msgspec checks
    each field's type and declared range; `check` the rules across fields)."""

    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    retention: Retention | None = None  # None: no session's pages are retained
    # lower first (vLLM's meaning): queue reads, admission, and preemption victims (highest
    # value first); the ingress bounds it per API key
    priority: Annotated[int, msgspec.Meta(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)] = 0
    # fair shares: tenants are served by weighted tokens (prompt + generated)
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_CHARS)] = ""
    weight: Annotated[float, msgspec.Meta(gt=0, le=1e6)] = 1.0
    # the model's LoRA adapter that serves it ("": the base model); a worker without it
    # dead-letters the task
    lora: Annotated[str, msgspec.Meta(max_length=MAX_LORA_CHARS)] = ""

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):  # built by hand from a dict (checked when decoded)
            self.sampling = SamplingParams.from_dict(self.sampling)

    def check(self) -> None:
        try:
            self.sampling.check_rules()
        except (InvalidSamplingParams, TypeError) as exc:
            raise MessageError(f"invalid sampling: {exc}") from exc


class PrefillTask(_Task, tag=Stage.PREFILL.value, kw_only=True):
    """A request waiting for its prompt to be computed (stream:prefill)."""

    kind: ClassVar[str] = Stage.PREFILL.value
    request_id: NonEmptyStr
    model: str = ""
    prompt_token_ids: NonEmptyTokenIds
    cache_salt: str = ""
    arrival_time: float = 0.0  # unix seconds when the producer accepted it
    deadline: float | None = None  # unix seconds; past it the request finishes with "timeout"
    num_cached_tokens: int = 0  # prefix found in the store at routing time (usage report)
    detokenize: bool = True


class DecodeTask(_Task, tag=Stage.DECODE.value, kw_only=True):
    """A request ready to generate (stream:decode): its prompt pages are in the store.

    `output_token_ids` are tokens already emitted (the prefill worker's first token); the decode
    worker loads the pages covering prompt + output from the store and recomputes only the tail.
    """

    kind: ClassVar[str] = Stage.DECODE.value
    request_id: NonEmptyStr
    model: str = ""
    prompt_token_ids: NonEmptyTokenIds
    output_token_ids: TokenIds = msgspec.field(default_factory=list)
    cache_salt: str = ""
    arrival_time: float = 0.0
    deadline: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from cache (usage report)
    num_stored_pages: int = 0  # full pages of the prompt the prefill worker put in the store
    prefilled: bool = False  # False when ingress routed straight to decode (decode prefills)
    detokenize: bool = True


class TokenChunk(Message, tag="chunk", omit_defaults=True):
    """Tokens appended to out:{request_id}; `index` is the position of the first token.

    The final chunk has `finish_reason` set and `usage` filled (prompt_tokens,
    completion_tokens, cached_tokens); it may carry no tokens.

    Fields at their defaults are left out of the payload (a one-token chunk is ~50 bytes, not
    ~125: Valkey stores it in a tail, a feed and out:{id}, and its AOF writes each): a missing
    field is its default, `v` included (1 while WIRE_VERSION is 1; a version that changes
    chunks must keep reading a missing `v` as 1).
    """

    kind: ClassVar[str] = "chunk"
    index: Annotated[int, msgspec.Meta(ge=0)] = 0
    token_ids: TokenIds = msgspec.field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: dict[str, int] | None = None
    # one entry per token: {"logprob": float, "top": [[token_id, logprob], ...]}
    logprobs: list[dict[str, Any]] | None = None
    # chunk 0 of a request with prompt_logprobs: one entry per prompt token,
    # {"token_id", "logprob", "rank", "top": [[token_id, logprob], ...]} (the first token's
    # logprob and rank are None: nothing precedes it)
    prompt_logprobs: list[dict[str, Any]] | None = None
    error: str | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Task = PrefillTask | DecodeTask


def frame(payload: bytes) -> bytes:
    """One payload with its 4-byte big-endian length in front (`unframe` reads a run of them).

    `out:{id}` entries and the tail of a request's progress hold chunks framed like this; the
    Lua scripts frame with `struct.pack('>I4', #payload)`."""
    return len(payload).to_bytes(4, "big") + payload


def unframe(data: bytes) -> list[bytes]:
    """The payloads of a run of frames; MessageError for a truncated run."""
    out: list[bytes] = []
    at = 0
    while at < len(data):
        if at + 4 > len(data):
            raise MessageError("truncated frame header")
        size = int.from_bytes(data[at : at + 4], "big")
        at += 4
        if at + size > len(data):
            raise MessageError("truncated frame")
        out.append(data[at : at + size])
        at += size
    return out


def decode_chunks(data: bytes) -> list[TokenChunk]:
    """The TokenChunks of a run of frames (an out:{id} entry, a progress tail)."""
    return [TokenChunk.decode(p) for p in unframe(data)]
