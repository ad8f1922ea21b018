"""Tool calling on /v1/chat/completions: the request fields, the prompt the tools and earlier
calls make, `auto` through the hermes parser (a worker role dictates the text: exact bodies and
deltas, also after a reattach), and named / required choices enforced by structured output
through a real decode worker, with the official `openai` client."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from kvrelay.core.structured import StructuredOutput
from kvrelay.core.tokenizer import Tokenizer
from kvrelay.core.tool_prompt import hermes_messages
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.protocol import parse_chat
from kvrelay.pipeline.openai.tool_calls import call_id
from kvrelay.pipeline.server.app import create_app
from kvrelay.pipeline.server.attach import request_digest
from kvrelay.pipeline.tokens import render_messages
from tests.pipeline.ingress_support import (
    MODEL,
    http,
    make_config,
    parse_sse,
    running_worker,
    unique_prefix,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict, description: str = "") -> dict:
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


TOOLS = [
    tool("get_weather", WEATHER, "Current weather in a city"),
    tool("get_time", TIME, "Current time in a time zone"),
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(**fields):
    return parse_chat({"model": MODEL, "messages": ASK, **fields})


def schema_text(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


# ---- request fields ----------------------------------------------------------------------


def test_named_choice_constrains_to_the_functions_parameters():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert req.sampling.structured == StructuredOutput("json", schema_text(TIME))
    assert req.tool_calling.to_dict() == {"mode": "named", "name": "get_time", "parallel": False}
    assert req.tools == TOOLS


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_constrains_to_an_array_of_calls(parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    req = chat(tools=TOOLS, tool_choice="required", **fields)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in (("get_weather", WEATHER), ("get_time", TIME))
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    assert req.sampling.structured == StructuredOutput("json", schema_text(schema))
    assert req.tool_calling.parallel is (parallel is not False)


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_leaves_the_output_free(choice):
    req = chat(tools=TOOLS, **({"tool_choice": choice} if choice else {}))
    assert req.sampling.structured is None
    assert req.tool_calling.to_dict() == {"mode": "auto", "name": "", "parallel": True}


def test_none_is_plain_text_with_the_tools_in_the_prompt():
    req = chat(tools=TOOLS, tool_choice="none")
    assert req.tool_calling is None and req.sampling.structured is None and req.tools == TOOLS


def test_tools_and_choice_are_part_of_the_request_digest():
    named = {"type": "function", "function": {"name": "get_time"}}
    digests = {
        request_digest(chat()),
        request_digest(chat(tools=TOOLS)),
        request_digest(chat(tools=TOOLS[:1])),
        request_digest(chat(tools=TOOLS, tool_choice="required")),
        request_digest(chat(tools=TOOLS, tool_choice=named)),
    }
    assert len(digests) == 5
    # without tools the digest is what it was (requests posted before stay reattachable)
    assert request_digest(chat(tool_choice="auto")) == request_digest(chat())


@pytest.mark.parametrize(
    ("fields", "code", "param", "message"),
    [
        (
            {"tools": [tool("f", {"type": "foo"})]},
            None,
            "tools[0].function.parameters",
            "invalid JSON schema: Invalid type: foo",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            None,
            "tool_choice",
            "tool_choice names the function 'nope', which is not in tools",
        ),
        (
            {"tool_choice": "required"},
            None,
            "tool_choice",
            "tool_choice is only allowed when tools are specified",
        ),
        (
            {"tools": [tool("get weather", WEATHER)]},
            None,
            "tools[0].function.name",
            "'tools[0].function.name' must be 1-64 characters of a-z, A-Z, 0-9, underscores "
            "and dashes",
        ),
        (
            {"tools": [tool("f", TIME), tool("f", WEATHER)]},
            None,
            "tools[1]",
            "tools has two functions named 'f'",
        ),
        (
            {"tools": [{"type": "web_search"}]},
            "unsupported_value",
            "tools[0].type",
            "tool type 'web_search' (only function tools) is not supported by this server",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            None,
            "tool_choice",
            "tool_choice required cannot be combined with another output constraint",
        ),
        (
            {"tools": TOOLS, "tool_choice": "any"},
            None,
            "tool_choice",
            '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
        ),
    ],
)
def test_refusals_name_their_field(fields, code, param, message):
    with pytest.raises(RequestError) as info:
        chat(**fields)
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (400, code, param, message)


# ---- the prompt --------------------------------------------------------------------------

FOLLOW_UP = [
    {"role": "user", "content": "Weather in Paris and the time in CET?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_smollm2_template_ignores_tools_so_they_are_written_hermes_style(smollm_tokenizer):
    assert not smollm_tokenizer.template_reads_tools
    req = parse_chat({"model": MODEL, "messages": FOLLOW_UP, "tools": TOOLS, "tool_choice": "none"})
    text = render_messages(smollm_tokenizer, req.messages, req.tools)
    assert text == (
        f"<|im_start|>system\n{TOOLS_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and the time in CET?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n"
        '{"temp": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_a_system_message_gets_the_tools_appended(smollm_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    text = render_messages(smollm_tokenizer, messages, TOOLS)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{TOOLS_PROMPT}<|im_end|>\n")


def test_a_template_that_reads_tools_gets_them_and_the_calls():
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    base = Tokenizer.from_files({"tokenizer.json": _TINY_TOKENIZER})
    tok = Tokenizer(base._tok, {}, source)
    assert tok.template_reads_tools
    req = parse_chat(
        {"model": MODEL, "messages": FOLLOW_UP[:3], "tools": TOOLS, "tool_choice": "none"}
    )
    assert render_messages(tok, req.messages, req.tools) == (
        "[get_weather][get_time]user:Weather in Paris and the time in CET?;"
        'assistant:<get_weather Paris><get_time >;tool:{"temp": 21}#call_1;'
    )


_TINY_TOKENIZER = json.dumps(
    {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"},
        "pre_tokenizer": {"type": "Whitespace"},
    }
).encode()


# ---- auto with the hermes parser (a worker role writes the text) --------------------------


def pieces(text: str, tokenizer) -> list[tuple[int, str]]:
    """(token id, text) per token of `text`, as a worker would emit them."""
    ids = tokenizer.encode(text)
    out, done = [], ""
    for i in range(len(ids)):
        now = tokenizer.decode(ids[: i + 1])
        out.append((ids[i], now[len(done) :]))
        done = now
    assert done == text
    return out


ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 64, **fields}


def test_the_parser_setting_names_a_known_parser():
    from kvrelay.core.config import ConfigError
    from kvrelay.pipeline.server.config import IngressConfig, load_config

    assert IngressConfig().tool_call_parser == "auto"  # picked from the chat template
    for setting in ("hermes", "none", "auto"):
        assert IngressConfig(tool_call_parser=setting).validate().tool_call_parser == setting
    # "none" is the setting, not an absent value, in the environment too
    assert load_config(environ={"KVRELAY_INGRESS_TOOL_CALL_PARSER": "none"}).tool_call_parser == (
        "none"
    )
    with pytest.raises(
        ConfigError, match="tool_call_parser must be one of auto, none, hermes, got 'x'"
    ):
        IngressConfig(tool_call_parser="x").validate()


@pytest.mark.anyio
async def test_auto_with_the_parser_set_to_none_is_a_400(harness):
    factory, _ = harness
    app = factory(tool_call_parser="none")
    async with http(app) as client:
        resp = await client.post("/v1/chat/completions", json=_body())
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": '"auto" tool choice requires the ingress to run with --tool-call-parser '
        '(hermes); use tool_choice "required", a named function or "none"',
        "type": "invalid_request_error",
        "param": "tool_choice",
        "code": None,
    }
    assert await _queued(app) == 0


async def _queued(app) -> int:
    ing = app.state.ingress
    return await ing.redis.xlen(ing.keys.prefill_stream) + await ing.redis.xlen(
        ing.keys.decode_stream
    )


@pytest.mark.anyio
async def test_auto_with_a_template_of_an_unknown_call_format_is_a_400(
    valkey_session, smollm_tokenizer
):
    """A template that reads `tools` but writes no <tool_call> blocks (Llama 3.1-style bare
    JSON): the default setting finds no parser and says which flag to give."""
    template = (
        '{% if tools %}Answer {"name": ..., "parameters": ...}{% endif %}'
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tok = Tokenizer(smollm_tokenizer._tok, {}, template)
    assert tok.template_reads_tools
    config = make_config(valkey_session.url, request_timeout_s=0.05, disconnect_grace_s=0.0)
    app = create_app(config, tokenizers={MODEL: tok})
    try:
        async with http(app) as client:
            resp = await client.post("/v1/chat/completions", json=_body())
            plain = await client.post("/v1/chat/completions", json=_body(tool_choice="none"))
        assert resp.status_code == 400
        assert resp.json()["error"] == {
            "message": '"auto" tool choice needs a tool call parser: the chat template of '
            f"{MODEL!r} does not show which format its tool calls take; start the ingress "
            "with --tool-call-parser hermes if the model writes <tool_call> blocks, or use "
            'tool_choice "required", a named function or "none"',
            "type": "invalid_request_error",
            "param": "tool_choice",
            "code": None,
        }
        assert plain.status_code == 504  # not refused: queued, and no worker: its deadline
        assert await _queued(app) == 1
    finally:
        await app.state.ingress.aclose()


@pytest.mark.anyio
async def test_auto_by_default_whole_answer_with_the_openai_client(harness, smollm_tokenizer):
    """The default setting (auto) reads SmolLM2's answers as hermes: tools work with no flag."""
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as transport:
        client = openai.AsyncOpenAI(
            base_url="http://ingress/v1", api_key="x", http_client=transport, max_retries=0
        )
        ask = asyncio.create_task(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=TOOLS,
                max_tokens=64,
                extra_headers={"X-Request-Id": "tc-1"},
            )
        )
        await role.serve_one(pieces(ANSWER, smollm_tokenizer))
        completion = await ask
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert [c.model_dump() for c in choice.message.tool_calls] == [
        {
            "id": call_id("tc-1", 0),
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}',
            },
        }
    ]


@pytest.mark.anyio
async def test_auto_hermes_stream_deltas_and_a_reattach_give_the_same_events(
    harness, smollm_tokenizer
):
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    headers = {"X-Request-Id": "tc-2"}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=_body(stream=True), headers=headers)
        )
        await role.serve_one(pieces(ANSWER, smollm_tokenizer))
        resp = await post
        events = parse_sse(resp.content)
        assert events[-1] == (None, "[DONE]")
        chunks = [(i, json.loads(d)) for i, d in events[:-1]]
        deltas = [
            (i, c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for i, c in chunks
        ]
        head = {"index": 0, "id": call_id("tc-2", 0), "type": "function"}
        texts = [d.get("content") for _, d, _ in deltas[1:] if "content" in d]
        assert "".join(texts) == "Let me check.\n"
        calls = [(i, d["tool_calls"], f) for i, d, f in deltas if "tool_calls" in d]
        assert calls[0][1] == [{**head, "function": {"name": "get_weather", "arguments": ""}}]
        fragments = ['{"', "city", '":', ' "', "Paris", '",', ' "', "unit", '":', ' "', "c"]
        fragments += ["elsius", '"', "}"]
        assert deltas == [
            (None, {"role": "assistant", "content": ""}, None),
            *[
                (str(i), {"content": t}, None)
                for i, t in enumerate(["Let", " me", " check", ".", "\n"])
            ],
            # "<tool_call>" and the call's head are held back until the name is whole
            (
                "21",
                {"tool_calls": [{**head, "function": {"name": "get_weather", "arguments": ""}}]},
                None,
            ),
            *[
                (str(22 + k), {"tool_calls": [{"index": 0, "function": {"arguments": t}}]}, None)
                for k, t in enumerate(fragments)
            ],
            ("41", {}, "tool_calls"),  # "\n</tool_call>" is no delta
        ]
        arguments = "".join(c[0]["function"]["arguments"] for _, c, _ in calls[1:])
        assert arguments == '{"city": "Paris", "unit": "celsius"}'
        assert all(c[0] == {"index": 0, "function": c[0]["function"]} for _, c, _ in calls[1:])
        assert deltas[-1][2] == "tool_calls"
        # a client that got the events up to the name reattaches from there: the same rest
        at = next(k for k, (i, d, _) in enumerate(deltas) if "tool_calls" in d and i is not None)
        again = await client.post(
            "/v1/chat/completions",
            json=_body(stream=True),
            headers={**headers, "Last-Event-ID": deltas[at][0]},
        )
        assert parse_sse(again.content) == events[at + 1 :]
        # and the whole body, asked again, is the same message
        whole = await client.post("/v1/chat/completions", json=_body(), headers=headers)
        assert whole.json()["choices"][0]["message"]["tool_calls"][0]["id"] == head["id"]


# ---- named and required through a real decode worker ---------------------------------------

PREFIX = unique_prefix()


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    # on CPU where a GPU is visible too: the calls below are the fp32 model's greedy answers
    with running_worker(valkey_session.url, PREFIX, "decode-tools", device="cpu") as worker:
        yield worker


@pytest.fixture
async def client(valkey_session, smollm_tokenizer, decode_worker):
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX, request_timeout_s=120),
        tokenizers={MODEL: smollm_tokenizer},
    )
    try:
        async with http(app) as transport:
            yield openai.AsyncOpenAI(
                base_url="http://ingress/v1", api_key="x", http_client=transport, max_retries=0
            )
    finally:
        await app.state.ingress.aclose()


@pytest.mark.anyio
async def test_named_choice_through_a_real_worker(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    args = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
    )
    completion = await client.chat.completions.create(
        **args, extra_headers={"X-Request-Id": "tc-n"}
    )
    choice = completion.choices[0]
    # a forced named call ends with "stop", as OpenAI and vLLM answer it
    assert (choice.finish_reason, choice.message.content) == ("stop", None)
    (called,) = choice.message.tool_calls
    assert (called.id, called.type, called.function.name) == (
        call_id("tc-n", 0),
        "function",
        "get_weather",
    )
    # greedy, as the engine writes JSON: vLLM's whitespace
    assert called.function.arguments == '{\n  "city": "Paris",\n  "unit": "celsius"\n}'
    jsonschema.validate(json.loads(called.function.arguments), WEATHER)
    # streamed: the same call, its arguments in fragments
    stream = await client.chat.completions.create(
        **args, stream=True, extra_headers={"X-Request-Id": "tc-ns"}
    )
    parts = [c.choices[0] async for c in stream]
    first = parts[1].delta.tool_calls[0]
    assert (first.index, first.id, first.function.name, first.function.arguments) == (
        0,
        call_id("tc-ns", 0),
        "get_weather",
        "",
    )
    fragments = "".join(
        p.delta.tool_calls[0].function.arguments for p in parts[2:] if p.delta.tool_calls
    )
    assert fragments == called.function.arguments
    assert parts[-1].finish_reason == "stop"


@pytest.mark.anyio
async def test_required_through_a_real_worker(client):
    ask = [{"role": "user", "content": "What time is it in Tokyo, and the weather in Paris?"}]
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=ask,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        extra_headers={"X-Request-Id": "tc-r"},
    )
    choice = completion.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    calls = choice.message.tool_calls
    # the 135M model picks one call; the time zone is cut at the schema's maxLength
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", '{\n"zone": "Asia/Tok"\n}')
    ]
    assert [c.id for c in calls] == [call_id("tc-r", i) for i in range(len(calls))]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


@pytest.mark.anyio
async def test_follow_up_prompt_ids_are_the_templates(client, smollm_tokenizer):
    # /tokenize is not tool-aware; the prompt the request was queued with is (req:{id})
    raw = client._client  # the httpx transport of the ingress
    body = {
        "model": MODEL,
        "messages": FOLLOW_UP,
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 1,
    }
    resp = await raw.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "tc-f"})
    assert resp.status_code == 200, resp.text
    expected = smollm_tokenizer.apply_chat_template(
        hermes_messages(parse_chat(body).messages, TOOLS)
    )
    assert resp.json()["usage"]["prompt_tokens"] == len(expected)
