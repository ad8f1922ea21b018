"""A named tool call in the engine: the request's constraint (the function's parameters, as
the ingress makes it) resumed from any token gives the same call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.pipeline.openai.protocol import parse_chat
from kvrelay.pipeline.tokens import render_messages

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
BODY = {
    "model": DEFAULT_MODEL,
    "messages": [{"role": "user", "content": "Forecast for Rome this week?"}],
    "tools": [{"type": "function", "function": {"name": "forecast", "parameters": WEATHER}}],
    "tool_choice": {"type": "function", "function": {"name": "forecast"}},
    "temperature": 0.8,
    "seed": 11,
    "max_tokens": 60,
}


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    def make():
        config = EngineConfig(dtype="float32", device="cpu", num_blocks=128, num_threads=1)
        return Engine(config, loaded=loaded_model)

    return make


@pytest.fixture(scope="module")
def named_call(make_engine):
    """(prompt, sampling, full output) of a seeded named-call request, as the ingress parses
    and renders it."""
    engine = make_engine()
    req = parse_chat(BODY)
    prompt = engine.tokenizer.encode(render_messages(engine.tokenizer, req.messages, req.tools))
    full = engine.generate([prompt], req.sampling, request_ids=["call"])[0]
    assert full.finish_reason == "stop"
    jsonschema.validate(json.loads(full.text_delta), WEATHER)
    return prompt, req.sampling, full


@pytest.mark.parametrize("k", [1, 5, 12])
def test_named_call_resumed_from_token_k_is_identical(make_engine, named_call, k):
    prompt, sampling, full = named_call
    assert len(full.output_token_ids) > k
    other = make_engine()
    other.add_request("call", prompt, sampling, output_token_ids=full.output_token_ids[:k])
    rest: list[int] = []
    while other.has_unfinished_requests():
        for out in other.step():
            rest += out.new_token_ids
            finish = out.finish_reason
    assert full.output_token_ids[:k] + rest == full.output_token_ids
    assert finish == "stop"
