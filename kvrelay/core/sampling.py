"""Sampling parameters shared by the wire messages, the ingress and the engine (torch-free)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.errors import KvrelayError

# Integer fields travel as MessagePack int64 (seed: signed 64-bit, like vLLM's torch.long bound)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InvalidSamplingParams(KvrelayError, ValueError):
    """A sampling value is out of range; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request. `max_tokens=None` means up to the context limit."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token plus top-n
    skip_special_tokens: bool = True

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise InvalidSamplingParams for values no request can use; return self."""

        def bad(msg: str, param: str) -> None:
            raise InvalidSamplingParams(msg, param)

        for name in ("max_tokens", "top_k", "min_tokens", "seed", "logprobs"):
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                bad(f"{name} must be between {INT64_MIN} and {INT64_MAX}", name)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0 or (self.top_k == -1):
            if self.top_k != -1:
                bad(f"top_k must be 0 (disabled) or positive, got {self.top_k}", "top_k")
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2], got {value}", name)
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens must not exceed max_tokens", "min_tokens")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be at most 16 non-empty strings", "stop")
        if not all(encodes_utf8(s) for s in self.stop):
            bad("stop strings must be valid Unicode (no lone UTF-16 surrogates)", "stop")
        self.check_vocab(vocab_size)
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed must be an integer", "seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        return self

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise InvalidSamplingParams for a stop token id outside [0, vocab_size)."""
        for tok in self.stop_token_ids:
            if (
                not isinstance(tok, int)
                or not 0 <= tok <= INT64_MAX
                or (vocab_size is not None and tok >= vocab_size)
            ):
                raise InvalidSamplingParams(
                    f"stop_token_ids has an invalid token id {tok!r}", "stop_token_ids"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a dict, ignoring unknown keys (forward compatibility)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def encodes_utf8(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (UTF-8 cannot encode it)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def derive_seed(request_id: str) -> int:
    """The seed used when a request gives none: stable for a request id, so resumes match."""
    return (
        int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1
    )


def effective_seed(params: SamplingParams, request_id: str) -> int:
    return params.seed if params.seed is not None else derive_seed(request_id)
