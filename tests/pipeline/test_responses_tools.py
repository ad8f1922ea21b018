"""Function tools and `text.format` on POST /v1/responses, with a real Valkey and tokenizer: a
WorkerRole dictates the text, so bodies and events are exact (auto through the hermes parser, a
named function, json_object), and follow-up turns render the prompt chat renders for the same
calls and results."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response

from kvrelay.core.structured import JSON, JSON_OBJECT, StructuredOutput
from kvrelay.core.tool_prompt import hermes_messages
from kvrelay.pipeline.openai.tool_calls import call_id
from kvrelay.pipeline.tokens import render_messages
from tests.pipeline.ingress_support import MODEL, http
from tests.pipeline.test_responses_api import USAGE, _events, _expected
from tests.pipeline.test_tool_calling import ANSWER, TIME, WEATHER, pieces

pytestmark = pytest.mark.anyio

# Responses' flat function tools, and the same tools in chat's shape
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Time", "parameters": TIME},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": p},
    }
    for t, p in ((TOOLS[0], WEATHER), (TOOLS[1], TIME))
]
ECHOED = [{**t, "strict": None} for t in TOOLS]
ASK = "What is the weather in Paris?"
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'


def fc_id(request_id: str, index: int) -> str:
    return "fc_" + call_id(request_id, index).removeprefix("call_")


def call_item(request_id: str, index: int, name: str, arguments: str, status="completed"):
    return {
        "type": "function_call",
        "id": fc_id(request_id, index),
        "call_id": call_id(request_id, index),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


async def test_auto_hermes_whole_body_and_the_official_client(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    body = {"model": MODEL, "input": ASK, "tools": TOOLS}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer), usage=USAGE))
        resp = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "resp-t1"})
        taken = await serve
        data = resp.json()
        assert resp.status_code == 200, resp.text
        assert data == _expected(
            "resp-t1",
            "",
            created_at=data["created_at"],
            completed_at=data["completed_at"],
            output=[
                message_item("msg_t1", "Let me check.\n"),
                call_item("resp-t1", 0, "get_weather", ARGUMENTS),
            ],
            tools=ECHOED,
        )
        Response.model_validate(data)
        # auto: the output is free; the tools are in the prompt (hermes-style for SmolLM2)
        assert taken.task.sampling.structured is None
        chat = [{"role": "user", "content": ASK}]
        assert taken.task.prompt_token_ids == smollm_tokenizer.apply_chat_template(
            hermes_messages(chat, CHAT_TOOLS)
        )
        # the official client reads the call as a ResponseFunctionToolCall
        oai = openai.AsyncOpenAI(
            base_url="http://ingress/v1", api_key="x", http_client=client, max_retries=0
        )
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer)))
        got = await oai.responses.create(
            model=MODEL, input=ASK, tools=TOOLS, extra_headers={"X-Request-Id": "resp-t2"}
        )
        await serve
        assert got.output_text == "Let me check.\n"
        call = got.output[1]
        assert (call.type, call.id, call.call_id, call.name, call.arguments, call.status) == (
            "function_call", fc_id("resp-t2", 0), call_id("resp-t2", 0), "get_weather",
            ARGUMENTS, "completed")  # fmt: skip
        # and its stream helper accumulates the events into the same output
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer)))
        async with oai.responses.stream(
            model=MODEL, input=ASK, tools=TOOLS, extra_headers={"X-Request-Id": "resp-t2s"}
        ) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
        await serve
        assert kinds.count("response.function_call_arguments.delta") == 14
        assert [item.model_dump(exclude_none=True) for item in streamed.output] == [
            message_item("msg_t2s", "Let me check.\n"),
            call_item("resp-t2s", 0, "get_weather", ARGUMENTS),
        ]


async def test_auto_hermes_stream_events_and_a_reattach(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    body = {"model": MODEL, "input": ASK, "tools": TOOLS, "stream": True}
    headers = {"X-Request-Id": "resp-t3"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer)))
        resp = await client.post("/v1/responses", json=body, headers=headers)
        await serve
        events = _events(resp.content)
        again = await client.post(
            "/v1/responses", json=body, headers={**headers, "Last-Event-ID": "21"}
        )
    msg, fc = {"item_id": "msg_t3", "output_index": 0}, {"item_id": fc_id("resp-t3", 0),
                                                         "output_index": 1}  # fmt: skip
    fragments = ['{"', "city", '":', ' "', "Paris", '",', ' "', "unit", '":', ' "', "c"]
    fragments += ["elsius", '"', "}"]
    final = events[-1][2]["response"]
    expected = [
        (None, "response.created", None),
        (None, "response.in_progress", None),
        # the message opens with its first text
        (None, "response.output_item.added",
         {"output_index": 0, "item": {**message_item("msg_t3", "", "in_progress"),
                                      "content": []}}),
        (None, "response.content_part.added",
         {**msg, "content_index": 0,
          "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        *[
            (str(i), "response.output_text.delta",
             {**msg, "content_index": 0, "delta": t, "logprobs": []})
            for i, t in enumerate(["Let", " me", " check", ".", "\n"])
        ],
        # the call's name is whole at token 21: the message closes, the call opens
        (None, "response.output_text.done",
         {**msg, "content_index": 0, "text": "Let me check.\n", "logprobs": []}),
        (None, "response.content_part.done",
         {**msg, "content_index": 0, "part": message_item("", "Let me check.\n")["content"][0]}),
        (None, "response.output_item.done",
         {"output_index": 0, "item": message_item("msg_t3", "Let me check.\n")}),
        ("21", "response.output_item.added",
         {"output_index": 1, "item": call_item("resp-t3", 0, "get_weather", "", "in_progress")}),
        *[
            (str(22 + k), "response.function_call_arguments.delta", {**fc, "delta": t})
            for k, t in enumerate(fragments)
        ],
        (None, "response.function_call_arguments.done", {**fc, "arguments": ARGUMENTS}),
        (None, "response.output_item.done",
         {"output_index": 1, "item": call_item("resp-t3", 0, "get_weather", ARGUMENTS)}),
        (None, "response.completed", {"response": final}),
    ]  # fmt: skip
    got = []
    for n, (i, e, d) in enumerate(events):
        assert d.pop("sequence_number") == n and d.pop("type") == e
        got.append((i, e, d if n > 1 else None))
    assert got == expected
    assert final["output"] == [
        message_item("msg_t3", "Let me check.\n"),
        call_item("resp-t3", 0, "get_weather", ARGUMENTS),
    ]
    Response.model_validate(final)
    # a client that had the call's head resumes with the same events, numbered as before
    resumed = _events(again.content)
    assert [(i, e, d["sequence_number"]) for i, e, d in resumed] == [
        (i, e, n) for n, (i, e, _) in enumerate(events) if n > 12
    ]
    assert events[12][0] == "21"
    assert resumed[-1][2]["response"]["output"] == final["output"]


async def test_named_function_whole_and_streamed(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()  # a named choice needs no parser: the output is the arguments
    role = await worker(app)
    named = {"type": "function", "name": "get_weather"}
    body = {"model": MODEL, "input": ASK, "tools": TOOLS, "tool_choice": named,
            "parallel_tool_calls": False}  # fmt: skip
    text = '{"city": "Paris"}'
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(text, smollm_tokenizer)))
        resp = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "resp-n1"})
        taken = await serve
        data = resp.json()
        assert data["output"] == [call_item("resp-n1", 0, "get_weather", text)]
        assert (data["tool_choice"], data["parallel_tool_calls"], data["tools"]) == (
            named, False, ECHOED)  # fmt: skip
        Response.model_validate(data)
        # enforced by structured output: the function's parameters schema
        spec = json.dumps(WEATHER, separators=(",", ":"))
        assert taken.task.sampling.structured == StructuredOutput(JSON, spec)

        serve = asyncio.create_task(role.serve_one(pieces(text, smollm_tokenizer)))
        resp = await client.post(
            "/v1/responses", json={**body, "stream": True}, headers={"X-Request-Id": "resp-n2"}
        )
        await serve
    events = _events(resp.content)
    fc = {"item_id": fc_id("resp-n2", 0), "output_index": 0}
    deltas = [t for _, t in pieces(text, smollm_tokenizer)]
    assert [(i, e) for i, e, _ in events] == [
        (None, "response.created"),
        (None, "response.in_progress"),
        (None, "response.output_item.added"),
        ("0", "response.function_call_arguments.delta"),
        *[(str(k), "response.function_call_arguments.delta") for k in range(1, len(deltas))],
        (None, "response.function_call_arguments.done"),
        (None, "response.output_item.done"),
        (None, "response.completed"),
    ]
    assert events[2][2]["item"] == call_item("resp-n2", 0, "get_weather", "", "in_progress")
    assert [d["delta"] for _, e, d in events if e.endswith("arguments.delta")] == deltas
    assert events[-3][2] == {"type": "response.function_call_arguments.done", **fc,
                             "arguments": text, "sequence_number": len(events) - 3}  # fmt: skip
    assert events[-1][2]["response"]["output"] == [call_item("resp-n2", 0, "get_weather", text)]


async def test_json_object_format_is_the_constraint_and_echoed(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "input": "JSON please", "text": {"format": {"type": "json_object"}}}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one([(28, "{}")]))
        data = (await client.post("/v1/responses", json=body)).json()
        taken = await serve
    assert taken.task.sampling.structured == StructuredOutput(JSON_OBJECT, any_whitespace=False)
    assert data["text"] == {"format": {"type": "json_object"}}
    assert data["output"][0]["content"][0]["text"] == "{}"


FOLLOW_UP_TEXT = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n" + "\n".join(json.dumps(t) for t in CHAT_TOOLS) + "\n</tools>\n\nFor each "
    "function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


async def test_function_call_output_follow_ups_render_as_chat(harness, smollm_tokenizer):
    """The same turn through previous_response_id (the stored calls) and as input items."""
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer)))
        first = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": ASK, "tools": TOOLS},
            headers={"X-Request-Id": "resp-f1"},
        )
        await serve
        first = first.json()
        result = {"type": "function_call_output", "call_id": call_id("resp-f1", 0),
                  "output": '{"temp": 21}'}  # fmt: skip
        follow = {"model": MODEL, "tools": TOOLS, "tool_choice": "none"}
        prompts = []
        for extra in (
            {"previous_response_id": first["id"], "input": [result]},
            # the client carries the conversation: the earlier output items go back as input
            {"input": [{"role": "user", "content": ASK}, *first["output"], result]},
        ):
            serve = asyncio.create_task(role.serve_one([(30, "?")]))
            resp = await client.post("/v1/responses", json={**follow, **extra})
            assert resp.status_code == 200, resp.text
            prompts.append((await serve).task.prompt_token_ids)
    # chat's rendering of the same calls and results (SmolLM2's template ignores tools)
    chat = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Let me check.\n", "tool_calls": [{
            "id": call_id("resp-f1", 0), "type": "function",
            "function": {"name": "get_weather", "arguments": json.loads(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": call_id("resp-f1", 0), "content": '{"temp": 21}'},
    ]  # fmt: skip
    assert render_messages(smollm_tokenizer, chat, CHAT_TOOLS) == FOLLOW_UP_TEXT
    expected = smollm_tokenizer.apply_chat_template(hermes_messages(chat, CHAT_TOOLS))
    assert prompts == [expected, expected]


async def test_required_gives_one_item_per_call(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    text = (
        '[{"name": "get_time", "arguments": {"zone": "CET"}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )
    body = {"model": MODEL, "input": ASK, "tools": TOOLS, "tool_choice": "required"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(text, smollm_tokenizer)))
        resp = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "resp-q1"})
        taken = await serve
    assert resp.json()["output"] == [
        call_item("resp-q1", 0, "get_time", '{"zone": "CET"}'),
        call_item("resp-q1", 1, "get_weather", '{"city": "Paris"}'),
    ]
    assert resp.json()["tool_choice"] == "required"
    assert json.loads(taken.task.sampling.structured.value)["type"] == "array"


async def test_a_function_call_output_answers_a_call_of_the_conversation(harness, smollm_tokenizer):
    """The call may be in `input` or in the previous response; otherwise 400, nothing queued."""
    factory, worker = harness
    app = factory()  # the default parser setting: hermes, from SmolLM2's template
    role = await worker(app)
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(pieces(ANSWER, smollm_tokenizer)))
        first = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": ASK, "tools": TOOLS},
            headers={"X-Request-Id": "resp-o1"},
        )
        await serve
        assert first.json()["output"][1]["call_id"] == call_id("resp-o1", 0)
        ing = app.state.ingress
        streams = (ing.keys.prefill_stream, ing.keys.decode_stream)
        queued = [await ing.redis.xlen(stream) for stream in streams]

        def result(call: str) -> dict:
            return {"type": "function_call_output", "call_id": call, "output": "21"}

        for extra, param, call in (
            ({"previous_response_id": first.json()["id"]}, "input[1].call_id", "call_other"),
            ({}, "input[1].call_id", call_id("resp-o1", 0)),  # the call is not in this one
        ):
            body = {"model": MODEL, "input": [{"role": "user", "content": ASK}, result(call)]}
            resp = await client.post("/v1/responses", json={**body, **extra})
            assert resp.status_code == 400
            assert resp.json()["error"] == {
                "message": f"No tool call found for function call output with call_id {call!r}.",
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        assert [await ing.redis.xlen(stream) for stream in streams] == queued
        serve = asyncio.create_task(role.serve_one([(30, "?")]))
        follow = {
            "previous_response_id": first.json()["id"],
            "input": [result(call_id("resp-o1", 0))],
        }
        resp = await client.post("/v1/responses", json={"model": MODEL, **follow})
        await serve
        assert resp.status_code == 200 and resp.json()["status"] == "completed"
