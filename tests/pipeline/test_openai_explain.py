"""Each request-model error reads as the server has always answered it (exact code, param, text).

The request models (pipeline/openai/models.py) are the only validation of an OpenAI body; these
cases pin the wording `explain.py` gives their errors: ranges from core.sampling, refused
features, cross-field rules, union fields (stop, prompt, content) and list items.
"""

from __future__ import annotations

import pytest

from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
TEXT = {"model": "m", "prompt": "x"}
UNSUPPORTED = "unsupported_value"
NOT_SUPPORTED = "is not supported by this server"
ROLE = "messages[0].role must be one of system, developer, user, assistant, tool"
TEN = [{"role": "user", "content": "x"}] * 10

CASES = [
    (CHAT, {"stop": ["a"] * 17}, None, "stop", "stop must be at most 16 non-empty strings"),
    (TEXT, {"stop": ""}, None, "stop", "stop must be at most 16 non-empty strings"),
    (CHAT, {"top_k": -5}, None, "top_k", "top_k must be 0 (disabled) or positive, got -5"),
    (TEXT, {"temperature": 500}, None, "temperature", "temperature must be in [0, 100], got 500.0"),
    (TEXT, {"top_p": -(2**70)}, None, "top_p", "'top_p' is out of range"),
    (TEXT, {"n": 0}, None, "n", "n must be at least 1, got 0"),
    (TEXT, {"best_of": 0}, None, "best_of", "best_of must be at least 1, got 0"),
    (
        TEXT,
        {"n": 3, "best_of": 2},
        None,
        "best_of",
        "best_of must be greater than or equal to n, got n=3 and best_of=2",
    ),
    (
        TEXT,
        {"n": 1, "best_of": 2, "stream": True},
        UNSUPPORTED,
        "best_of",
        f"stream with best_of greater than n {NOT_SUPPORTED}",
    ),
    (
        CHAT,
        {"tool_choice": {"type": "function"}},
        "missing_required_parameter",
        "tool_choice.function",
        "'tool_choice.function' is a required property",
    ),
    (
        CHAT,
        {"response_format": {"type": "structural_tag"}},
        UNSUPPORTED,
        "response_format.type",
        f"response_format type 'structural_tag' {NOT_SUPPORTED}",
    ),
    (
        CHAT,
        {"modalities": ["text", "audio"]},
        UNSUPPORTED,
        "modalities",
        f'output modalities other than ["text"] {NOT_SUPPORTED}',
    ),
    (
        CHAT,
        {"store": True},
        UNSUPPORTED,
        "store",
        f"store=true (stored completions) {NOT_SUPPORTED}",
    ),
    (CHAT, {"messages": []}, "invalid_type", "messages", "'messages' must be a non-empty array"),
    (
        CHAT,
        {"messages": [*TEN, 7]},
        "invalid_type",
        "messages[10]",
        "'messages[10]' must be an object",
    ),
    (CHAT, {"messages": [{"content": "x"}]}, None, "messages[0].role", ROLE),
    (TEXT, {"prompt": ["a", ""]}, None, "prompt[1]", "the prompt is empty"),
    (TEXT, {"prompt": ["a", []]}, "invalid_value", "prompt[1]", "'prompt' must not be empty"),
    (TEXT, {"prompt": ""}, None, "prompt", "the prompt is empty"),
    (
        TEXT,
        {"prompt": [1, 2.5]},
        "invalid_type",
        "prompt",
        "'prompt' must be a string or an array of token ids",
    ),
    (
        TEXT,
        {"min_tokens": 5, "max_tokens": 2},
        None,
        "min_tokens",
        "min_tokens must not exceed max_tokens",
    ),
    (CHAT, {"top_logprobs": 3}, None, "top_logprobs", "top_logprobs requires logprobs to be true"),
    (
        TEXT,
        {"stream_options": {"include_usage": True}},
        None,
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (
        CHAT,
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "invalid_type",
        "stream_options.include_usage",
        "'stream_options.include_usage' must be a boolean",
    ),
    (
        CHAT,
        {"model": ""},
        "missing_required_parameter",
        "model",
        "you must provide a model parameter",
    ),
    (
        CHAT,
        {"model": None},
        "missing_required_parameter",
        "model",
        "you must provide a model parameter",
    ),
    (
        TEXT,
        {"logit_bias": {"5": 101}},
        None,
        "logit_bias",
        "logit_bias must map token ids to numbers in [-100, 100], got 101",
    ),
    (TEXT, {"suffix": "s"}, UNSUPPORTED, "suffix", f"suffix {NOT_SUPPORTED}"),
    (
        CHAT,
        {"tools": [{"type": "retrieval"}]},
        UNSUPPORTED,
        "tools[0].type",
        f"tool type 'retrieval' (only function tools) {NOT_SUPPORTED}",
    ),
    (
        CHAT,
        {"prompt_logprobs": 21},
        None,
        "prompt_logprobs",
        "prompt_logprobs must be in [0, 20], got 21",
    ),
    (
        TEXT,
        {"prompt_logprobs": 0, "stream": True},
        None,
        "prompt_logprobs",
        "prompt_logprobs is not available when stream is true",
    ),
    (
        TEXT,
        {"functions": []},
        UNSUPPORTED,
        "functions",
        f"functions (legacy function calling) {NOT_SUPPORTED}",
    ),
    (
        TEXT,
        {"stop_token_ids": [1, "2"]},
        "invalid_type",
        "stop_token_ids",
        "'stop_token_ids' must be an array of integers",
    ),
    (
        TEXT,
        {"skip_special_tokens": 2**64},
        "invalid_type",
        "skip_special_tokens",
        "'skip_special_tokens' must be a boolean",
    ),
]


@pytest.mark.parametrize(("base", "extra", "code", "param", "message"), CASES)
def test_error_wording(base, extra, code, param, message):
    parse = parse_chat if "messages" in base else parse_completion
    with pytest.raises(RequestError) as info:
        parse({**base, **extra})
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (400, code, param, message)


def test_null_is_absent_and_top_k_minus_one_is_disabled():
    req = parse_completion({**TEXT, "guided_json": None, "seed": None, "top_k": -1})
    assert (req.sampling.seed, req.sampling.top_k, req.prompt) == (None, 0, "x")
