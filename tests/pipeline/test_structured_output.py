"""Structured output at the edge: `response_format` (json_object, json_schema) and vLLM's
`structured_outputs` on both endpoints become one `StructuredOutput` in the sampling params,
checked (compiled) at the ingress so a bad schema, regex or grammar is a 400 naming the field
and nothing is queued; through a real decode worker the answers fit their constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import redis.asyncio as aioredis

from kvrelay.core.keys import Keys
from kvrelay.core.messages import DecodeTask
from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import StructuredOutput, grammar_error
from kvrelay.pipeline.client.validate import parse_request, sampling_fields
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from kvrelay.pipeline.server.app import create_app
from kvrelay.pipeline.server.attach import request_digest
from tests.pipeline.ingress_support import MODEL, http, make_config, running_worker, unique_prefix

MESSAGES = [{"role": "user", "content": "Hi"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_TEXT = json.dumps(PERSON, separators=(",", ":"))
SCHEMA_FORMAT = {"name": "person", "schema": PERSON, "strict": True}
BAD_TYPE = {"name": "x", "schema": {"type": "foo"}}
COMPACT_PERSON = StructuredOutput("json", PERSON_TEXT, any_whitespace=False)
COMPACT_OBJECT = StructuredOutput("json_object", any_whitespace=False)


def chat(**fields):
    return parse_chat({"model": "m", "messages": MESSAGES, **fields})


def completion(**fields):
    return parse_completion({"model": "m", "prompt": "x", **fields})


@pytest.mark.parametrize("parse", [chat, completion], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("fields", "spec"),
    [
        ({"response_format": {"type": "text"}}, None),
        # JSON is compact by default (as OpenAI's): no whitespace between its tokens
        ({"response_format": {"type": "json_object"}}, COMPACT_OBJECT),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON, "strict": True},
                }
            },  # fmt: skip
            COMPACT_PERSON,
        ),
        ({"structured_outputs": {"json": PERSON}}, COMPACT_PERSON),
        (  # JSON text, spelled any way, is the same schema
            {"structured_outputs": {"json": json.dumps(PERSON, indent=2)}},
            COMPACT_PERSON,
        ),
        ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}, COMPACT_PERSON),
        (  # vLLM's default asked for: any whitespace
            {"structured_outputs": {"json": PERSON, "disable_any_whitespace": False}},
            StructuredOutput("json", PERSON_TEXT, any_whitespace=True),
        ),
        (
            {"structured_outputs": {"json": PERSON, "whitespace_pattern": "[ ]?"}},
            StructuredOutput("json", PERSON_TEXT, any_whitespace=False, whitespace_pattern="[ ]?"),
        ),
        (  # the pattern wins over vLLM's default spelled out
            {
                "structured_outputs": {
                    "json_object": True,
                    "whitespace_pattern": "(\\n[ ]{0,4})?",
                    "disable_any_whitespace": False,
                }
            },  # fmt: skip
            StructuredOutput("json_object", "", False, "(\\n[ ]{0,4})?"),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"], "disable_fallback": True}},
            StructuredOutput("choice", ["yes", "no"]),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            StructuredOutput("grammar", 'root ::= "a" | "b"'),
        ),
        ({"structured_outputs": {"json_object": True}}, COMPACT_OBJECT),
        (  # text format and a constraint together: the constraint
            {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
            StructuredOutput("regex", "a"),
        ),
    ],
)
def test_accepted_constraints_become_the_sampling_spec(parse, fields, spec):
    assert parse(**fields).sampling.structured == spec


BAD_REGEX = (
    'invalid regex: at 1(8): invalid regex "a(b" (in regex): regex parse error:\n    a(b\n'
    "     ^\nerror: unclosed group\n   1 | start: /a(b/\n              ^\n"
)


@pytest.mark.parametrize(
    ("fields", "code", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },  # fmt: skip
            None,
            "response_format.json_schema.schema",
            "invalid JSON schema: Invalid type: foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "missing_required_parameter",
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema' is a required property",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "missing_required_parameter",
            "response_format.json_schema",
            "'response_format.json_schema' is a required property",
        ),
        (
            {"response_format": {"type": "yaml"}},
            "unsupported_value",
            "response_format.type",
            "response_format type 'yaml' is not supported by this server",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, None, "structured_outputs.regex", BAD_REGEX),
        (
            {"structured_outputs": {"json": "{not json"}},
            None,
            "structured_outputs.json",
            "invalid JSON schema: not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a" | bar'}},
            None,
            "structured_outputs.grammar",
            'invalid grammar: at 1(8): unknown name: "bar"\n   1 | start: "a" | bar\n'
            "              ^\n",
        ),
        (
            {"structured_outputs": {"choice": []}},
            "invalid_type",
            "structured_outputs.choice",
            "'structured_outputs.choice' must be a non-empty array of strings",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            None,
            "structured_outputs",
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            "json_object (got regex, choice)",
        ),
        (
            {"structured_outputs": {}},
            None,
            "structured_outputs",
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            "json_object (got none)",
        ),
        (
            {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
            "unsupported_value",
            "structured_outputs.structural_tag",
            "structured_outputs.structural_tag is not supported by this server",
        ),
        (
            {"structured_outputs": {"regex": "a", "guided": 1}},
            "unknown_parameter",
            "structured_outputs.guided",
            "unknown structured_outputs field 'guided' (known: json, regex, choice, grammar, "
            "json_object, disable_any_whitespace, whitespace_pattern, disable_fallback)",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            None,
            "structured_outputs",
            "response_format and structured_outputs cannot both constrain the output",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "unsupported_value",
            "structured_outputs.whitespace_pattern",
            "whitespace_pattern applies to json and json_object only",
        ),
        (
            {"structured_outputs": {"json": PERSON, "whitespace_pattern": "\\s*"}},
            None,
            "structured_outputs.whitespace_pattern",
            "invalid whitespace_pattern: '\\\\s*' matches text other than JSON whitespace (space, "
            "tab, newline, carriage return)",
        ),
        (
            {"structured_outputs": {"json": PERSON, "whitespace_pattern": "[ ,]*"}},
            None,
            "structured_outputs.whitespace_pattern",
            "invalid whitespace_pattern: '[ ,]*' matches text other than JSON whitespace (space, "
            "tab, newline, carriage return)",
        ),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ "}},
            None,
            "structured_outputs.whitespace_pattern",
            "invalid whitespace_pattern: regex parse error:\n    [ \n    ^\nerror: unclosed "
            "character class",
        ),
        (
            {
                "structured_outputs": {
                    "json": PERSON,
                    "whitespace_pattern": " ",
                    "disable_any_whitespace": True,
                }
            },  # fmt: skip
            None,
            "structured_outputs.whitespace_pattern",
            "whitespace_pattern allows whitespace, disable_any_whitespace forbids it",
        ),
    ],
)
def test_refused_constraints_name_their_field(fields, code, param, message):
    for parse in (chat, completion):
        with pytest.raises(RequestError) as info:
            parse(**fields)
        err = info.value
        assert (err.status, err.code, err.param, err.message) == (400, code, param, message)
        assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "spec",
    [
        COMPACT_PERSON,
        StructuredOutput("json", PERSON_TEXT),  # any whitespace: the class's default
        StructuredOutput("json_object", whitespace_pattern="[ ]?"),
        StructuredOutput("choice", ["a", "b"]),
    ],
)
def test_producer_client_spec_is_the_same_request(spec):
    for sampling in (SamplingParams(structured=spec), {"structured": spec.to_dict()}):
        body = {**sampling_fields(sampling), "model": "m"}
        assert parse_request(body, "x", None, None).sampling.structured == spec


def test_producer_client_refuses_a_bad_spec():
    with pytest.raises(RequestError) as info:
        parse_request({"model": "m", "structured": {"value": 1}}, "x", None, None)
    assert (info.value.status, info.value.param) == (400, "sampling")
    bad = {"model": "m", "structured": {"kind": "regex", "value": "a(b"}}
    with pytest.raises(RequestError) as info:
        parse_request(bad, "x", None, None)
    assert info.value.param == "structured_outputs.regex"


def test_the_constraint_is_part_of_the_request_digest():
    """Reattaching with X-Request-Id: another schema is another request (409), the same one
    spelled otherwise is the same."""
    a = completion(structured_outputs={"json": PERSON})
    b = completion(response_format={"type": "json_schema", "json_schema": SCHEMA_FORMAT})
    c = completion(structured_outputs={"regex": "[0-9]+"})
    assert request_digest(a) == request_digest(b) != request_digest(c)
    assert request_digest(completion()) != request_digest(a)


def test_the_spec_travels_in_tasks():
    sampling = completion(structured_outputs={"choice": ["a", "b"]}).sampling
    task = DecodeTask(request_id="r", prompt_token_ids=[1], sampling=sampling)
    assert DecodeTask.decode(task.encode()).sampling.structured == StructuredOutput(
        "choice", ["a", "b"]
    )


# ---- through the ingress and a real decode worker (it prefills locally) ------------------

PREFIX = unique_prefix()
KEYS = Keys(PREFIX)


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    with running_worker(valkey_session.url, PREFIX, "decode-so") as worker:
        yield worker


@pytest.fixture
async def ingress(valkey_session, smollm_tokenizer, decode_worker):
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX), tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        async with http(app) as client:
            yield client
    finally:
        await app.state.ingress.aclose()


@pytest.mark.anyio
async def test_chat_json_schema_answer_fits_the_schema(ingress):
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    }
    resp = await ingress.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    # the engine's own answer: compact JSON, as OpenAI's (no whitespace between tokens)
    assert choice["message"]["content"] == '{"name":"Alejandro","age":25}'
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


@pytest.mark.anyio
async def test_completion_regex_and_choice_are_exact(ingress):
    base = {"model": MODEL, "temperature": 0, "max_tokens": 20}
    phone = r"[0-9]{3}-[0-9]{4}"
    body = {**base, "prompt": "Call me at", "structured_outputs": {"regex": phone}}
    resp = await ingress.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch(phone, choice["text"])
    body = {
        **base,
        "prompt": "The sky is blue. True or false? Answer:",
        "structured_outputs": {"choice": [" true", " false"]},
        "stream": True,
    }
    resp = await ingress.post("/v1/completions", json=body)
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line[6:7] == "{"]
    assert "".join(e["choices"][0]["text"] for e in events) in (" true", " false")
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_invalid_schema_is_a_400_and_nothing_is_queued(ingress, valkey_session):
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        before = [await r.xlen(KEYS.prefill_stream), await r.xlen(KEYS.decode_stream)]
        body = {
            "model": MODEL,
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": "2"}},
            },
        }
        resp = await ingress.post("/v1/completions", json=body, headers={"X-Request-Id": "so-400"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert (error["type"], error["param"]) == (
            "invalid_request_error",
            "response_format.json_schema.schema",
        )
        assert error["message"].startswith("invalid JSON schema: ")
        after = [await r.xlen(KEYS.prefill_stream), await r.xlen(KEYS.decode_stream)]
        assert after == before
        assert not await r.exists(KEYS.request("so-400"))
    finally:
        await r.aclose()


# ---- the grammar engine's limits (issue 46): refused at the ingress, or a failed request ---

ROW_LIMIT = (
    "the grammar engine cannot follow it: Parser Error: Current row has {} items; max is 2000; "
    "consider making your grammar left-recursive if it's right-recursive"
)
ALTERNATIVES_3000 = "start: " + " | ".join(f'"item{i}"' for i in range(3000))
# one parser row of 3 items per branch: 3,000 items once the answer starts
ANY_OF_1000 = {"anyOf": [{"type": "array", "prefixItems": [{"const": i}]} for i in range(1000)]}
TOO_LONG = 'start: "' + "a" * (256 * 1024) + '"'


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"structured_outputs": {"choice": [f"item{i}" for i in range(10_001)]}},
            "structured_outputs.choice",
            "invalid choice: choice has 10,001 strings; at most 10,000 are allowed",
        ),
        (
            {"structured_outputs": {"grammar": ALTERNATIVES_3000}},
            "structured_outputs.grammar",
            "invalid grammar: " + ROW_LIMIT.format(3001),
        ),
        (
            {
                "structured_outputs": {
                    "grammar": "start: " + " | ".join(f'"x{i}"' for i in range(20_000))
                }
            },
            "structured_outputs.grammar",
            "invalid grammar: " + ROW_LIMIT.format(20001),
        ),
        (  # reached after the first bytes: the ingress's walks get there
            {
                "structured_outputs": {
                    "grammar": 'start: /[0-9]{3}/ "." big\nbig: ' + ALTERNATIVES_3000[7:]
                }
            },
            "structured_outputs.grammar",
            "invalid grammar: " + ROW_LIMIT.format(3001),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": ANY_OF_1000},
                }
            },
            "response_format.json_schema.schema",
            "invalid JSON schema: " + ROW_LIMIT.format(3000),
        ),
        (
            {"structured_outputs": {"grammar": TOO_LONG}},
            "structured_outputs.grammar",
            "invalid grammar: grammar has 262,153 characters; at most 262,144 are allowed",
        ),
    ],
    ids=["choice-10001", "grammar-3000", "grammar-20000", "grammar-late", "schema", "too-long"],
)
def test_constraints_past_the_engine_limits_are_a_400_naming_the_field(fields, param, message):
    """Before, they were queued, and the worker's matcher failed on the first token: the answer
    was its first bytes with finish_reason "stop"."""
    for parse in (chat, completion):
        with pytest.raises(RequestError) as info:
            parse(**fields)
        err = info.value
        assert (err.status, err.code, err.param, err.message) == (400, None, param, message)
        assert err.body()["error"]["type"] == "invalid_request_error"


CHOICES_2001 = [f"item{i}" for i in range(2001)]


@pytest.mark.anyio
async def test_2001_choices_are_answered_with_one_of_them(ingress):
    """A choice is one lexeme, not a rule of 2,001 alternatives (one parser row too many)."""
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Pick an item."}],
        "structured_outputs": {"choice": CHOICES_2001},
    }
    resp = await ingress.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "item1")


@pytest.mark.anyio
async def test_a_grammar_past_the_engine_limits_is_a_400_and_nothing_is_queued(
    ingress, valkey_session
):
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        before = [await r.xlen(KEYS.prefill_stream), await r.xlen(KEYS.decode_stream)]
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "structured_outputs": {"grammar": ALTERNATIVES_3000},
        }
        headers = {"X-Request-Id": "so-rows"}
        resp = await ingress.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 400
        assert resp.json() == {
            "error": {
                "message": "invalid grammar: " + ROW_LIMIT.format(3001),
                "type": "invalid_request_error",
                "param": "structured_outputs.grammar",
                "code": None,
            }
        }
        after = [await r.xlen(KEYS.prefill_stream), await r.xlen(KEYS.decode_stream)]
        assert after == before
        assert not await r.exists(KEYS.request("so-rows"))
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_a_constraint_that_fails_mid_answer_fails_the_request(ingress):
    """66 letters, then a rule of 3,000 alternatives: the ingress's walks (64 bytes) do not get
    there, the worker's matcher fails once the letters are out. The request fails (500), where
    it used to end "stop" with text that breaks the grammar."""
    grammar = "start: /[a-z]{66}/ big\nbig: " + ALTERNATIVES_3000[7:]
    assert grammar_error(StructuredOutput("grammar", grammar)) is None
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "Write a long word."}],
        "structured_outputs": {"grammar": grammar},
    }
    resp = await ingress.post("/v1/chat/completions", json=body)
    assert resp.status_code == 500
    assert resp.json()["error"] == {
        "message": "the structured output constraint failed: Parser Error: Current row has 3001 "
        "items; max is 2000; consider making your grammar left-recursive if it's right-recursive",
        "type": "server_error",
        "param": None,
        "code": "generation_failed",
    }


@pytest.mark.anyio
async def test_json_whitespace_compact_by_default_and_as_the_pattern_allows(ingress):
    schema = {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    }
    base = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Classify the sentiment of 'I love it' as JSON."}],
    }
    answers = []
    for options in ({}, {"whitespace_pattern": "[ ]?"}, {"disable_any_whitespace": False}):
        body = {**base, "structured_outputs": {"json": schema, **options}}
        resp = await ingress.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        answers.append(choice["message"]["content"])
    assert answers == [
        '{"sentiment":"positive"}',  # compact, as OpenAI's
        '{ "sentiment": "positive" }',  # at most one space between tokens
        '{\n  "sentiment": "positive"\n}',  # vLLM's default asked for: any whitespace
    ]
