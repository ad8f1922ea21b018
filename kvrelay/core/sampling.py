"""Sampling parameters shared by the wire messages, the ingress and the engine (torch-free)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvrelay.core.config import ConfigError
from kvrelay.core.errors import KvrelayError
from kvrelay.core.structured import InvalidStructuredOutput, StructuredOutput

# Integer fields travel as MessagePack int64 (seed: signed 64-bit, like vLLM's torch.long bound)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


MAX_STOP = 16  # stop strings per request
MAX_LOGPROBS = 20  # alternatives per token
STOP_RULE = f"stop must be at most {MAX_STOP} non-empty strings"
MIN_TOKENS_RULE = "min_tokens must not exceed max_tokens"
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI bounds it
LOGIT_BIAS_RULE = (
    f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
)


@dataclass(frozen=True, slots=True)
class Bound:
    """The values a sampling field may take, and how a refusal of another value reads."""

    low: float
    high: float | None = None
    low_open: bool = False  # (low, ...] instead of [low, ...]
    rule: str = ""  # after "<name> must be", e.g. "in [0, 100]"
    kind: type = float  # a float field prints a refused 500 as "500.0"

    @classmethod
    def of(cls, meta: msgspec.Meta, kind: type) -> Bound:
        """The range a field's msgspec Meta declares, worded from it (or by its `rule` extra)."""
        low_open = meta.gt is not None
        low = meta.gt if low_open else meta.ge
        assert low is not None, "a sampling field's range has a lower end"
        high = meta.le
        rule = (meta.extra or {}).get("rule")
        if rule is None:
            ends = "(" if low_open else "["
            rule = f"at least {low:g}" if high is None else f"in {ends}{low:g}, {high:g}]"
        return cls(low, high, low_open, rule, kind)

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def message(self, name: str, value: Any) -> str:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        shown = float(value) if self.kind is float and number else value
        return f"{name} must be {self.rule}, got {shown}"


# Each sampling field's range is declared once, as msgspec constraints on its SamplingParams
# field: msgspec checks them when a task is decoded, and BOUNDS (read from them, below the class)
# is what SamplingParams.validate, the generation defaults and the OpenAI request models check.
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# -1: vLLM's "disabled" (normalized to 0)
TopK = Annotated[int, msgspec.Meta(ge=-1, extra={"rule": "0 (disabled) or positive"})]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=10.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # presence and frequency
MinTokens = Annotated[int, msgspec.Meta(ge=0, extra={"rule": ">= 0"})]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
Stop = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=MAX_STOP)
]
Bias = Annotated[float, msgspec.Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class InvalidSamplingParams(KvrelayError, ValueError):
    """A sampling value is out of range; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request. `max_tokens=None` means up to the context limit."""

    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # 0 = disabled
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: Stop = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    seed: int | None = None
    logprobs: Logprobs | None = None  # None: no logprobs; n >= 0: chosen token plus top-n
    # None: none; n >= 0: each prompt token's logprob plus top-n (computed, never cached)
    prompt_logprobs: Logprobs | None = None
    skip_special_tokens: bool = True
    # token id -> added to its logit before penalties and temperature (vLLM's order)
    logit_bias: dict[int, Bias] = field(default_factory=dict)
    # structured output (json schema, regex, choice, grammar, json_object): see core/structured
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):  # from_dict / a wire map built by hand
            self.structured = StructuredOutput.from_dict(self.structured)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise InvalidSamplingParams for values no request can use; return self."""
        self._check_int64()
        if self.max_tokens is not None and not isinstance(self.max_tokens, int):
            message = BOUNDS["max_tokens"].message("max_tokens", self.max_tokens)
            raise InvalidSamplingParams(message, "max_tokens")
        for name, bound in BOUNDS.items():
            value = getattr(self, name, None)
            if value is not None and not bound.holds(value):
                raise InvalidSamplingParams(bound.message(name, value), name)
        return self._rules(vocab_size)

    def check_rules(self, vocab_size: int | None = None) -> SamplingParams:
        """The checks beyond each field's type and range (which a decoded task has passed):
        integers within int64, stop strings, seed, the output constraint, logit_bias,
        min_tokens against max_tokens and the vocabulary; normalizes; returns self."""
        self._check_int64()
        return self._rules(vocab_size)

    def _rules(self, vocab_size: int | None) -> SamplingParams:
        """check_rules() after the int64 check (validate() has made it before the ranges)."""

        def bad(msg: str, param: str) -> None:
            raise InvalidSamplingParams(msg, param)

        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            bad(STOP_RULE, "stop")
        if not all(encodes_utf8(s) for s in self.stop):
            bad("stop strings must be valid Unicode (no lone UTF-16 surrogates)", "stop")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed must be an integer", "seed")
        if self.structured is not None:
            try:
                StructuredOutput.from_dict(self.structured).check()
            except InvalidStructuredOutput as exc:
                bad(str(exc), "structured")
        if not valid_logit_bias(self.logit_bias):
            bad(LOGIT_BIAS_RULE, "logit_bias")
        self.normalize()
        self.check_fit(vocab_size)
        return self

    def _check_int64(self) -> None:
        """Integers travel as MessagePack int64."""
        for name in ("max_tokens", "top_k", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                message = f"{name} must be between {INT64_MIN} and {INT64_MAX}"
                raise InvalidSamplingParams(message, name)

    def normalize(self) -> SamplingParams:
        """Spell a valid request one way: top_k -1 (vLLM's "disabled") becomes 0."""
        if self.top_k == -1:
            self.top_k = 0
        return self

    def check_fit(self, vocab_size: int | None) -> None:
        """The checks that need the final max_tokens and the model's vocabulary."""
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(MIN_TOKENS_RULE, "min_tokens")
        self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise InvalidSamplingParams for stop or logit_bias ids outside [0, vocab_size)."""
        for tok in self.stop_token_ids:
            if (
                not isinstance(tok, int)
                or not 0 <= tok <= INT64_MAX
                or (vocab_size is not None and tok >= vocab_size)
            ):
                raise InvalidSamplingParams(
                    f"stop_token_ids has an invalid token id {tok!r}", "stop_token_ids"
                )
        outside = sorted(
            tok
            for tok in self.logit_bias
            if tok < 0 or (vocab_size is not None and tok >= vocab_size)
        )
        if outside:  # vLLM's wording
            raise InvalidSamplingParams(
                f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                "logit_bias",
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


def _bounds() -> dict[str, Bound]:
    """Field name -> its range, from the msgspec Meta its type carries, in field order."""
    out: dict[str, Bound] = {}
    for name, hint in typing.get_type_hints(SamplingParams, include_extras=True).items():
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
        for kind in typing.get_args(hint) if optional else [hint]:
            if typing.get_origin(kind) is Annotated:
                base, *extras = typing.get_args(kind)
                for meta in extras:
                    if isinstance(meta, msgspec.Meta) and (meta.ge, meta.gt) != (None, None):
                        out[name] = Bound.of(meta, base)  # a range (not a length)
    return out


# The ranges of SamplingParams' fields (what its Meta declares): validate() and the OpenAI
# request models check them, in these words.
BOUNDS = _bounds()


def refusal(name: str, value: Any) -> str | None:
    """How a value outside the constraints its field declares is refused (None: no such
    field): in validate()'s words, which are the ingress's."""
    if name in BOUNDS:
        return BOUNDS[name].message(name, value)
    return {"stop": STOP_RULE, "logit_bias": LOGIT_BIAS_RULE}.get(name)


def encodes_utf8(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (UTF-8 cannot encode it)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_logit_bias(bias: Any) -> bool:
    """A map of int64 token ids to finite numbers within +-MAX_LOGIT_BIAS (the vocabulary is
    checked by `check_vocab`)."""
    if not isinstance(bias, dict):
        return False
    for tok, value in bias.items():
        if isinstance(tok, bool) or not isinstance(tok, int) or not INT64_MIN <= tok <= INT64_MAX:
            return False
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            return False
    return True


def derive_seed(request_id: str) -> int:
    """The seed used when a request gives none: stable for a request id, so resumes match."""
    return (
        int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1
    )


def effective_seed(params: SamplingParams, request_id: str) -> int:
    return params.seed if params.seed is not None else derive_seed(request_id)


def choice_seed(params: SamplingParams, request_id: str, choice: int) -> int:
    """The seed of choice `choice` of a request asking for several (n, best_of): choice 0 uses
    the request's own seed, so it is what n=1 gives; the others a seed derived from it."""
    seed = effective_seed(params, request_id)
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# The request fields a model may ship defaults for (Hugging Face `generation_config.json`, GGUF
# `general.sampling.*`) and an operator may override (`--override-generation-config`), as vLLM's
# `--generation-config auto` does. A field no layer sets keeps its SamplingParams default
# (OpenAI's: temperature 1, top_p 1; max_tokens: up to the context left).
GENERATION_DEFAULT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
)
_DEFAULT_ALIASES = {"max_new_tokens": "max_tokens"}  # generation_config.json's spelling
_INT_DEFAULTS = frozenset({"top_k", "max_tokens"})
_KNOWN_KEYS = ", ".join([*GENERATION_DEFAULT_FIELDS, *_DEFAULT_ALIASES])


def _default_value(name: str, value: Any, key: str) -> float | int:
    """`value` checked for field `name` (given as `key`), in the request fields' ranges."""
    if name in _INT_DEFAULTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidSamplingParams(f"{key} must be an integer, got {value!r}", key)
    elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidSamplingParams(f"{key} must be a number, got {value!r}", key)
    else:
        value = float(value)
    bound = BOUNDS[name]
    if not bound.holds(value):
        raise InvalidSamplingParams(bound.message(key, value), key)
    return 0 if name == "top_k" and value == -1 else value  # -1: vLLM's "disabled"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """One layer of defaults for the fields a request leaves out; None: this layer sets none.

    Layers stack: the request's own fields > the operator's override > the model's defaults >
    the SamplingParams defaults (`over`, `apply`).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def parse(cls, data: Any, *, strict: bool = True) -> GenerationDefaults:
        """From a JSON object (`max_new_tokens` is `max_tokens`); InvalidSamplingParams names a
        bad value, or (strict) an unknown key. Not strict: other keys are ignored (a model's
        generation_config.json holds token ids and more)."""
        if not isinstance(data, Mapping):
            raise InvalidSamplingParams(f"must be a JSON object, got {data!r}", "")
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = _DEFAULT_ALIASES.get(key, key)
            if name not in GENERATION_DEFAULT_FIELDS:
                if strict:
                    raise InvalidSamplingParams(f"unknown key {key!r} (known: {_KNOWN_KEYS})", key)
                continue
            if value is None:
                continue
            if name in values:
                raise InvalidSamplingParams(f"{key} and {name} both given", key)
            values[name] = _default_value(name, value, key)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | None) -> GenerationDefaults:
        """An operator's override: a JSON object text ('' or None: no override)."""
        if text is None or not text.strip():
            return cls()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidSamplingParams(f"not valid JSON ({exc})", "") from None
        return cls.parse(data)

    def over(self, base: GenerationDefaults) -> GenerationDefaults:
        """This layer on top of `base`: its set fields win."""
        mine = self.to_dict()
        return dataclasses.replace(base, **mine) if mine else base

    def to_dict(self) -> dict[str, Any]:
        """The fields this layer sets."""
        return {
            name: value
            for name in GENERATION_DEFAULT_FIELDS
            if (value := getattr(self, name)) is not None
        }

    def effective(self) -> dict[str, Any]:
        """Every field as a request that sets none of them gets it (max_tokens None: up to the
        context left, capped by the server's max_tokens limit)."""
        base = SamplingParams()
        return {
            name: getattr(base, name) if (value := getattr(self, name)) is None else value
            for name in GENERATION_DEFAULT_FIELDS
        }

    def apply(self, params: SamplingParams, fields_set: Collection[str]) -> SamplingParams:
        """`params` with this layer's values in the sampling fields not in `fields_set` (those
        the request gave). max_tokens is left alone: its default caps the context left, which
        only the length check knows."""
        updates = {
            name: value
            for name, value in self.to_dict().items()
            if name != "max_tokens" and name not in fields_set
        }
        return dataclasses.replace(params, **updates) if updates else params


def generation_override(value: str | Mapping[str, Any] | None) -> GenerationDefaults:
    """The `override_generation_config` setting (ingress, workers) parsed: JSON text, or a
    table of a config file; ConfigError if bad."""
    try:
        if value is None or isinstance(value, str):
            return GenerationDefaults.from_json(value)
        return GenerationDefaults.parse(value)
    except InvalidSamplingParams as exc:
        raise ConfigError(f"override_generation_config: {exc}") from None
