"""The OpenAI request bodies this server accepts, as pydantic models: their one definition.

Each field states its type, its range (core.sampling.BOUNDS) and how its errors read (a `Says`;
validators raise `fail`/`refuse`). `protocol.py` validates every body through these models and
`/openapi.json` is built from them. Null counts as absent. Fields are declared in the order
they are checked: the first failing one is the error the client gets.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvrelay.core.messages import PRIORITY_BOUND
from kvrelay.core.sampling import (
    BOUNDS,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RULE,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MIN_TOKENS_RULE,
    STOP_RULE,
    SamplingParams,
)
from kvrelay.core.structured import StructuredOutput
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.explain import Says, fail, fail_as, refuse
from kvrelay.pipeline.openai.structured import ResponseFormat, StructuredOutputs
from kvrelay.pipeline.openai.tools import (
    AUTO,
    NAME_RULE,
    FunctionTool,
    ToolCall,
    ToolCalling,
    ToolChoice,
    tool_calling,
    tool_constraint,
    valid_name,
)
from kvrelay.pipeline.openai.validate import check_known_fields, check_unicode
from kvrelay.pipeline.tokens import EMPTY_PROMPT

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def _bounded(name: str, base: Any) -> Any:
    """`base` within BOUNDS[name], refused in its words."""
    bound = BOUNDS[name]
    low: dict[str, Any] = {"gt": bound.low} if bound.low_open else {"ge": bound.low}
    high: dict[str, Any] = {} if bound.high is None else {"le": bound.high}
    return Annotated[base, Field(**low, **high), Says(bound=bound)]


def _false(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


def _false_only(base: Any, refused: str) -> Any:
    """A boolean that may only be false: true asks for `refused`, which is not implemented."""
    schema = WithJsonSchema({"type": "boolean", "const": False})
    return Annotated[base, AfterValidator(_false), schema, Says(refused=refused)]


# prompt_cache_retention: OpenAI's two policies, or (kvrelay) seconds; the ingress bounds it
CacheRetention = Annotated[
    Literal["in_memory", "24h"] | Annotated[int, Field(strict=True, ge=0)],
    Says(expect='"in_memory", "24h" or a number of seconds'),
]

# vLLM's priority (lower first); the ingress bounds it per API key (server/api_keys.py)
Priority = Annotated[
    int,
    Field(strict=True, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND),
    Says(invalid=f"{{param}} must be an integer within +-{PRIORITY_BOUND}, got {{value}}"),
]

# how many choices to return (n) or generate (best_of); the ingress caps them (max_choices)
Count = Annotated[Int64, Field(ge=1), Says(invalid="{param} must be at least 1, got {value}")]


def _empty(base: Any, refused: str) -> Any:
    """A list, object or string that may only be empty: anything in it is not implemented."""
    return Annotated[base, Field(max_length=0), Says(refused=refused)]


# The field types below are the Annotated types above at runtime (what pydantic reads: bounds,
# refusals); a type checker sees the type of their values.
if TYPE_CHECKING:
    Temperature = float
    TopP = float
    MinP = float
    PresencePenalty = float
    FrequencyPenalty = float
    RepetitionPenalty = float
    TopK = int
    MinTokens = int
    MaxTokens = int
    PromptLogprobs = int
    Logprobs = int
    NoStore = bool
    NoSuffix = str
else:
    Temperature = _bounded("temperature", Number)
    TopP = _bounded("top_p", Number)
    MinP = _bounded("min_p", Number)
    PresencePenalty = _bounded("presence_penalty", Number)
    FrequencyPenalty = _bounded("frequency_penalty", Number)
    RepetitionPenalty = _bounded("repetition_penalty", Number)
    TopK = _bounded("top_k", Int64)
    MinTokens = _bounded("min_tokens", Int64)
    MaxTokens = _bounded("max_tokens", Int64)
    PromptLogprobs = _bounded("prompt_logprobs", Int64)
    Logprobs = _bounded("logprobs", Int64)
    NoStore = _false_only(StrictBool, "store=true (stored completions)")
    NoSuffix = _empty(StrictStr, "suffix")


class _Nested(BaseModel):
    """Nested objects: keys other than these are ignored, as the OpenAI API does."""

    model_config = ConfigDict(strict=True, extra="ignore")


def _text_only(kind: str) -> str:
    if kind != "text":
        raise ValueError("only text parts are supported")
    return kind


class TextPart(_Nested):
    """A content part; only `text` parts are supported."""

    type: Annotated[
        StrictStr,
        AfterValidator(_text_only),
        WithJsonSchema({"type": "string", "const": "text"}),
        Says(refused=lambda kind: f"content part type {kind[:64]!r}"),
    ]
    text: StrictStr


class ChatMessage(_Nested):
    """One chat message; `content` may be null or absent only on assistant messages.
    Assistant messages may carry the `tool_calls` the model made; `tool` messages answer one
    (`tool_call_id`)."""

    role: Role
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    content: Annotated[
        StrictStr | Annotated[list[TextPart], Field(min_length=1)] | None,
        Says(expect="a string or an array of text parts"),
    ] = None
    name: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # refused as "must be an object"
        role = data.get("role")
        if role not in ROLES:
            message = f"{{param}} must be one of {', '.join(ROLES)}"
            raise fail(message, field="role", templated=True)
        if role == "tool" and data.get("tool_call_id") is None:
            message = (
                "Missing parameter 'tool_call_id': messages with role 'tool' must have a "
                "'tool_call_id'."
            )
            raise fail(message, field="tool_call_id", code="missing_required_parameter")
        if data.get("content") == []:  # no text at all: OpenAI refuses an empty array too
            message = "'{param}' must not be an empty array"
            raise fail(message, field="content", code="invalid_value", templated=True)
        if data.get("content") is None and role != "assistant":
            if "content" not in data:
                raise fail_as("missing", field="content")
            expected = "a string or an array of text parts, not null"
            raise fail_as("type", field="content", expected=expected)
        return data


_NOT_A_RESULT = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
    "with 'tool_calls'."
)


def check_tool_results(messages: list[ChatMessage]) -> None:
    """OpenAI's rule for `tool` messages: each answers a call of the assistant message right
    before it (or before the tool messages answering its other calls)."""
    calls: set[str] | None = None  # the call ids the next tool message may answer
    for i, message in enumerate(messages):
        if message.role == "tool":
            if calls is None:
                raise fail(_NOT_A_RESULT, field=f"messages[{i}].role")
            if message.tool_call_id not in calls:
                wrote = str(message.tool_call_id)[:64]
                raise fail(
                    f"Invalid parameter: 'tool_call_id' of {wrote!r} not found in 'tool_calls' "
                    "of previous message.",
                    field=f"messages[{i}].tool_call_id",
                )
        elif message.role == "assistant" and message.tool_calls:
            calls = {call.id for call in message.tool_calls}
        else:
            calls = None


class StreamOptions(_Nested):
    """`stream_options` (only with `stream: true`)."""

    include_usage: StrictBool | None = None


_StopText = Annotated[str, Field(min_length=1)]
Stop = Annotated[
    _StopText | Annotated[list[_StopText], Field(max_length=MAX_STOP)],
    Says(expect="a string or an array of strings", invalid=STOP_RULE, whole=True),
]
PROMPT_LOGPROBS_STREAM = "prompt_logprobs is not available when stream is true"
_WHOLE_IDS = Says(expect="an array of integers", whole=True)
_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")  # int64 digits at most (the vocabulary bounds it)


def _token_keys(value: dict[str | int, float]) -> dict[int, float]:
    """logit_bias keys as token ids: OpenAI sends strings of digits; the producer client ints.
    Negative or out-of-vocabulary ids are refused once the model is known (check_vocab)."""
    bias: dict[int, float] = {}
    for key, number in value.items():
        if isinstance(key, str) and not _TOKEN_KEY.fullmatch(key):
            raise fail(f"logit_bias has an invalid token id {key[:32]!r}")
        token = int(key)
        if not INT64_MIN <= token <= INT64_MAX:
            raise fail_as("int64")
        if token in bias:
            raise fail(f"logit_bias gives token id {token} twice")
        bias[token] = float(number)
    return bias


_Bias = Annotated[
    float, Field(strict=True, allow_inf_nan=False, ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)
]
LogitBias = Annotated[
    dict[StrictStr | Int64, _Bias],
    AfterValidator(_token_keys),
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^-?[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
        }
    ),
    Says(
        expect="an object mapping token ids to numbers",
        invalid=LOGIT_BIAS_RULE + ", got {value}",
        whole=True,
    ),
]


# request fields that are SamplingParams fields of the same name (absent: its default)
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "seed",
    "skip_special_tokens",
    "logit_bias",
)


class _Request(BaseModel):
    """Fields of both endpoints (top-level fields besides these are refused by name)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1), Says(missing="you must provide a model parameter")]
    n: Count | None = None
    logit_bias: LogitBias | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Int64 | None = None
    stop: Stop | None = None
    # token ids: the model's vocabulary bounds them, checked once it is known
    stop_token_ids: (
        Annotated[list[Int64], Says(expect="an array of integers", whole=True)] | None
    ) = None
    min_tokens: MinTokens | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    max_tokens: MaxTokens | None = None
    # vLLM's: each prompt token's logprob plus the top-n (not with stream, as vLLM refuses it)
    prompt_logprobs: PromptLogprobs | None = None
    user: StrictStr | None = None
    # non-empty: the HTTP edge refuses "" (validate.check_cache_salt), which the producer
    # client sends for "no salt"
    cache_salt: Annotated[StrictStr, WithJsonSchema({"type": "string", "minLength": 1})] | None = (
        None
    )
    # structured output: constraints checked (compiled) here, see openai/structured.py
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # the session whose pages the store retains (with `user` when no key), and for how long
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: CacheRetention | None = None
    priority: Priority | None = None  # None: the API key's default
    # pass-through: accepted, change nothing (docs/api.md)
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        """The whole body first: UTF-8 everywhere, no field we do not know; null is absent."""
        if isinstance(data, dict):
            try:  # msgpack, Redis and the tokenizer need UTF-8: no lone surrogates anywhere
                check_unicode(data)
                check_known_fields(data, _field_set(cls))
            except RequestError as err:
                raise fail(err.message, field=err.param or "", code=err.code) from err
            return {name: value for name, value in data.items() if value is not None}
        return data

    @field_validator("stream_options", mode="before")
    @classmethod
    def _with_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict) and not info.data.get("stream"):
            raise fail("stream_options is only allowed when stream is true")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> _Request:
        limit = self.max_tokens_given()[0]
        if limit is not None and self.min_tokens is not None and self.min_tokens > limit:
            raise fail(MIN_TOKENS_RULE, field="min_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise fail(PROMPT_LOGPROBS_STREAM, field="prompt_logprobs")
        return self

    def choices_per_prompt(self) -> int:
        return self.n or 1

    @field_validator("response_format", mode="before")
    @classmethod
    def _schema_name(cls, value: Any) -> Any:
        """OpenAI's rule for the JSON schema's name (before structured.py's checks of the
        rest, which would word a name too long as a bare "is invalid")."""
        schema = value.get("json_schema") if isinstance(value, dict) else None
        name = schema.get("name") if isinstance(schema, dict) else None
        if isinstance(name, str) and value.get("type") == "json_schema" and not valid_name(name):
            raise fail(NAME_RULE, field="json_schema.name", templated=True)
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> _Request:
        formatted = self.response_format is not None and self.response_format.spec() is not None
        if self.structured_outputs is not None and formatted:
            message = "response_format and structured_outputs cannot both constrain the output"
            raise fail(message, field="structured_outputs")
        return self

    def structured(self) -> StructuredOutput | None:
        """The output constraint the request asks for (None: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return self.response_format.spec() if self.response_format is not None else None

    def max_tokens_given(self) -> tuple[int | None, str]:
        """The output limit the client set and the field it used (the last one given wins)."""
        return self.max_tokens, "max_tokens"

    def to_sampling_params(self) -> tuple[SamplingParams, frozenset[str]]:
        """The sampling this (validated) body asks for, and the SamplingParams fields it set:
        the served model's generation defaults fill the others (`GenerationDefaults.apply`)."""
        given = {name: value for name in SAMPLING if (value := getattr(self, name)) is not None}
        stop = self.stop
        max_tokens = self.max_tokens_given()[0]
        sampling = SamplingParams(
            max_tokens=max_tokens,
            stop=stop if isinstance(stop, list) else [stop] if stop is not None else [],
            stop_token_ids=list(self.stop_token_ids or ()),
            structured=self.structured(),
            logprobs=self.top_logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked(),
            **given,
        ).normalize()
        return sampling, frozenset([*given, *(["max_tokens"] if max_tokens is not None else [])])

    def top_logprobs_asked(self) -> int | None:
        """SamplingParams.logprobs: None for none, n for the chosen token's plus the top n."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    max_completion_tokens: MaxTokens | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1), Says(expect="a non-empty array")]
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Logprobs | None = None
    store: NoStore | None = None
    parallel_tool_calls: StrictBool | None = None
    modalities: Annotated[Any, WithJsonSchema({"type": "array", "const": ["text"]})] = None

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value: Any) -> Any:
        if value is not None and value != ["text"]:
            raise refuse('output modalities other than ["text"]')
        return value

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _with_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        number = isinstance(value, int) and not isinstance(value, bool)
        if number and INT64_MIN <= value <= INT64_MAX and not info.data.get("logprobs"):
            raise fail("top_logprobs requires logprobs to be true")
        return value

    @model_validator(mode="after")
    def _tool_results(self) -> ChatCompletionRequest:
        check_tool_results(self.messages)
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        calling = tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)
        if calling is not None and calling.mode != AUTO and super().structured() is not None:
            message = (
                f"tool_choice {calling.mode} cannot be combined with another output constraint"
            )
            raise fail(message, field="tool_choice")
        if calling is not None and self.tools:
            tool_constraint(calling, self.tools)  # required: the calls' schema compiles
        return self

    def tool_calling(self) -> ToolCalling | None:
        """What the output is with tools (None: plain text; validated above)."""
        return tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutput | None:
        calling = self.tool_calling()
        if calling is not None and self.tools:
            spec = tool_constraint(calling, self.tools)
            if spec is not None:
                return spec
        return super().structured()

    def max_tokens_given(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Int64], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text or token ids) or a list of them."""

    prompt: PromptText | TokenIds | Annotated[list[PromptText | TokenIds], Field(min_length=2)]
    echo: StrictBool | None = None
    best_of: Count | None = None
    suffix: NoSuffix | None = None
    logprobs: Logprobs | None = None

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            message = f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}"
            raise fail(message, field="best_of")
        if best_of is not None and best_of > n and self.stream:
            # the best choices are known only once all are done (vLLM and OpenAI refuse it too)
            raise refuse("stream with best_of greater than n", field="best_of")
        return self

    def choices_per_prompt(self) -> int:
        return max(self.n or 1, self.best_of or 1)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            # vLLM's: the echoed prompt's tokens come with their logprobs, top-n as `logprobs`
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            if len(value) == 1:  # a batch of one, unwrapped (and its errors the prompt's)
                return _one_prompt(value[0], "[0]", "")
            return [_one_prompt(p, f"[{i}]", f"[{i}]") for i, p in enumerate(value)]
        return _one_prompt(value, "", "")


def _one_prompt(prompt: Any, where: str, item: str) -> Any:
    """One prompt (text or token ids) of `prompt`, at `where` in it (`item`: where its
    errors are reported)."""
    if isinstance(prompt, str):
        if not prompt:
            raise fail(EMPTY_PROMPT, field=item)
        return prompt
    if _ints(prompt) and prompt:
        for i, token in enumerate(prompt):
            if not INT64_MIN <= token <= INT64_MAX:
                raise fail_as("int64", field=f"{where}[{i}]")
        return prompt
    if prompt is None:
        raise fail_as("missing")
    if isinstance(prompt, list) and not prompt:
        raise fail("'prompt' must not be empty", field=item, code="invalid_value")
    raise fail_as("type", field=item, expected="a string or an array of token ids")


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level JSON field names a request model accepts."""
    return frozenset(f.alias or name for name, f in model.model_fields.items())


@functools.cache
def _field_set(model: type[BaseModel]) -> frozenset[str]:
    return field_names(model)  # read on every request: computed once per model
