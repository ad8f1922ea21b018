"""The Responses API with a real decode worker (SmolLM2 on CPU, real Valkey): greedy answers
equal the chat endpoint's for the same conversation, through `previous_response_id` too;
`text.format` json_schema through the official client's `responses.parse`, and a named function
call whose arguments are valid for its parameters."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvrelay.pipeline.openai.tool_calls import call_id
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, make_config, running_worker, unique_prefix
from tests.pipeline.test_tool_calling import WEATHER

pytestmark = pytest.mark.anyio

PREFIX = unique_prefix()


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    """One real decode worker (it prefills locally) under this module's key prefix."""
    with running_worker(valkey_session.url, PREFIX, "decode-r") as worker:
        yield worker


async def test_greedy_answers_match_chat_completions(
    valkey_session, smollm_tokenizer, decode_worker
):
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX, mode="colocated"),
        tokenizers={MODEL: smollm_tokenizer},
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress/v1") as http:
        client = openai.AsyncOpenAI(
            base_url="http://ingress/v1", api_key="none", http_client=http, max_retries=0
        )
        greedy = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
        first = await client.responses.create(
            input="What is the capital of France?", instructions="Answer in one line.", **greedy
        )
        messages = [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        chat = await client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=12
        )
        assert first.output_text == chat.choices[0].message.content and first.output_text
        assert first.usage.input_tokens == chat.usage.prompt_tokens
        assert first.usage.output_tokens == chat.usage.completion_tokens
        assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else
                                "completed")  # fmt: skip

        async with client.responses.stream(
            input="And of Italy?", previous_response_id=first.id, **greedy
        ) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            second = await stream.get_final_response()
        messages = [
            *messages[1:],  # the instructions are not carried over
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ]
        chat = await client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=12
        )
        assert "".join(deltas) == second.output_text == chat.choices[0].message.content
        assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    await app.state.ingress.aclose()


@pytest.fixture
async def client(valkey_session, smollm_tokenizer, decode_worker):
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX, mode="colocated"),
        tokenizers={MODEL: smollm_tokenizer},
    )
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress/v1") as http:
            yield openai.AsyncOpenAI(
                base_url="http://ingress/v1", api_key="none", http_client=http, max_retries=0
            )
    finally:
        await app.state.ingress.aclose()


class City(BaseModel):
    name: str
    country: str


async def test_parse_with_a_pydantic_text_format(client):
    parsed = await client.responses.parse(
        model=MODEL,
        input="What is the capital of France? Give the city and its country.",
        text_format=City,
        temperature=0,
        max_output_tokens=40,
    )
    assert parsed.status == "completed"
    fmt = parsed.text.format
    assert (fmt.type, fmt.name, fmt.strict) == ("json_schema", "City", True)
    assert fmt.schema_ == City.model_json_schema() | {"additionalProperties": False}
    # greedy: compact JSON (no runs of newlines between the members), the 135M model's spelling
    assert parsed.output_parsed == City(name="Paris", country="FRANCE")
    assert parsed.output_text == '{"name":"Paris","country":"FRANCE"}'


async def test_named_function_call_arguments_are_valid(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    response = await client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
        extra_headers={"X-Request-Id": "resp-wn"},
    )
    (call,) = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id == call_id("resp-wn", 0)
    # greedy, as the engine writes JSON: the same arguments as chat's named choice
    assert call.arguments == '{\n  "city": "Paris",\n  "unit": "celsius"\n}'
    jsonschema.validate(json.loads(call.arguments), WEATHER)
