"""Wire messages carried in Redis streams, encoded as MessagePack maps with a version field `v`.

New fields get defaults, unknown fields are ignored, and anything that does not decode or
validate raises MessageError (the consumer sends the entry to the DLQ with that reason).
Tensors never travel here: decode tasks name pages by their keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from kvrelay.core.enums import FinishReason
from kvrelay.core.errors import KvrelayError
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams

WIRE_VERSION = 1
FINISH_REASONS = tuple(FinishReason)

M = TypeVar("M", bound="Message")


class MessageError(KvrelayError, ValueError):
    """A stream entry that cannot be decoded or validated; never retried."""


@dataclass(slots=True)
class Message:
    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["v"] = WIRE_VERSION
        data["t"] = self.kind
        return data

    def encode(self) -> bytes:
        """MessagePack bytes; MessageError for values msgpack cannot carry (huge ints, bad str)."""
        try:
            return msgpack.packb(self.to_dict(), use_bin_type=True)
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
            raise MessageError(f"{self.kind} cannot be encoded: {exc}") from exc

    @classmethod
    def decode(cls: type[M], payload: bytes) -> M:
        """Decode and validate one payload; raise MessageError with the reason otherwise."""
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MessageError(f"payload is not MessagePack: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise MessageError(f"{cls.__name__}: payload is not a map")
        version = data.get("v")
        if not isinstance(version, int) or version < 1 or version > WIRE_VERSION:
            raise MessageError(f"{cls.__name__}: unsupported wire version {version!r}")
        if data.get("t", cls.kind) != cls.kind:
            raise MessageError(f"expected a {cls.kind} message, got {data.get('t')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            msg = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise MessageError(f"{cls.__name__}: {exc}") from exc
        msg.validate()
        return msg

    def validate(self) -> None:
        pass


def _check_ids(name: str, values: Any, allow_empty: bool = False) -> None:
    if not isinstance(values, list) or (not values and not allow_empty):
        raise MessageError(
            f"{name} must be a {'possibly empty ' if allow_empty else 'non-empty '}list"
        )
    if not all(isinstance(t, int) and t >= 0 for t in values):
        raise MessageError(f"{name} must hold non-negative integers")


def _check_str(name: str, value: Any, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise MessageError(f"{name} must be a {'' if allow_empty else 'non-empty '}string")


def _check_sampling(data: Any) -> None:
    if not isinstance(data, dict):
        raise MessageError("sampling must be a map")
    try:
        SamplingParams.from_dict(data).validate()
    except (InvalidSamplingParams, TypeError) as exc:
        raise MessageError(f"invalid sampling: {exc}") from exc


@dataclass(slots=True)
class PrefillTask(Message):
    """A request waiting for its prompt to be computed (stream:prefill)."""

    kind: ClassVar[str] = "prefill"
    request_id: str = ""
    model: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    cache_salt: str = ""
    arrival_time: float = 0.0  # unix seconds when ingress accepted it
    deadline: float | None = None  # unix seconds; past it the request finishes with "timeout"
    num_cached_tokens: int = 0  # prefix found in the store at routing time (usage report)
    detokenize: bool = True

    def validate(self) -> None:
        _check_str("request_id", self.request_id)
        _check_str("model", self.model, allow_empty=True)
        _check_ids("prompt_token_ids", self.prompt_token_ids)
        _check_sampling(self.sampling)
        _check_str("cache_salt", self.cache_salt, allow_empty=True)

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)


@dataclass(slots=True)
class DecodeTask(Message):
    """A request ready to generate (stream:decode): its prompt pages are in the store.

    `output_token_ids` are tokens already emitted (the prefill worker's first token); the decode
    worker loads the pages covering prompt + output from the store and recomputes only the tail.
    """

    kind: ClassVar[str] = "decode"
    request_id: str = ""
    model: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    cache_salt: str = ""
    arrival_time: float = 0.0
    deadline: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from cache (usage report)
    num_stored_pages: int = 0  # full pages of the prompt the prefill worker put in the store
    store_node: str = ""  # node holding those pages ("" = look up in the directory)
    prefilled: bool = False  # False when ingress routed straight to decode (decode prefills)
    first_token_time: float | None = None
    detokenize: bool = True

    def validate(self) -> None:
        _check_str("request_id", self.request_id)
        _check_ids("prompt_token_ids", self.prompt_token_ids)
        _check_ids("output_token_ids", self.output_token_ids, allow_empty=True)
        _check_sampling(self.sampling)

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)


@dataclass(slots=True)
class TokenChunk(Message):
    """Tokens appended to out:{request_id}; `index` is the position of the first token.

    The final chunk has `finish_reason` set and `usage` filled (prompt_tokens,
    completion_tokens, cached_tokens); it may carry no tokens.
    """

    kind: ClassVar[str] = "chunk"
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    # one entry per token: {"logprob": float, "top": [[token_id, logprob], ...]}
    logprobs: list[dict[str, Any]] | None = None
    error: str | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id

    def validate(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise MessageError("index must be a non-negative integer")
        _check_ids("token_ids", self.token_ids, allow_empty=True)
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise MessageError(f"unknown finish_reason {self.finish_reason!r}")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
