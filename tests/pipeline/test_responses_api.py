"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over the chat
path, with a real Valkey and tokenizer; a WorkerRole answers over the streams (exact bodies),
and the official openai client reads them through uvicorn."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response

from kvrelay.core.messages import TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.openai.responses_api import ResponsesRequest
from tests.pipeline.ingress_support import MODEL, http
from tests.pipeline.openapi_bodies import Generator
from tests.pipeline.test_ingress_server import serving
from tests.pipeline.test_openapi_fuzz import (
    _accepted,
    _check_error_shape,
    _model_accepts,
    _schema_only_limit,
)

pytestmark = pytest.mark.anyio

USAGE = {"prompt_tokens": 31, "completion_tokens": 2, "cached_tokens": 16}
HELLO = [(19556, "Hello"), (905, " world")]


def _events(body: bytes) -> list[tuple[str | None, str, dict]]:
    """(id, event, data) per SSE event; every event is `event:` + `data:`, ending blank."""
    assert body.endswith(b"\n\n")
    out = []
    for block in body.decode().split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) <= {"id", "event", "data"}, block
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines.get("id"), lines["event"], data))
    return out


def _expected(rid: str, text: str, **changes) -> dict:
    suffix = rid.removeprefix("resp-")
    body = {
        "id": "resp_" + suffix,
        "object": "response",
        "created_at": changes.pop("created_at"),
        "status": "completed",
        "background": False,
        "completed_at": changes.pop("completed_at"),
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "metadata": {},
        "model": MODEL,
        "output": [
            {
                "id": "msg_" + suffix,
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "prompt_cache_retention": None,
        "reasoning": None,
        "safety_identifier": None,
        "service_tier": None,
        "store": True,
        "temperature": 0.2,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 0.9,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 31,
            "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 33,
        },
        "user": None,
    }
    body.update(changes)
    return body


async def test_whole_response_body_task_and_retrieval(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    serve = asyncio.create_task(role.serve_one(HELLO, usage=USAGE))
    body = {
        "model": MODEL,
        "input": "Hi",
        "instructions": "Answer briefly.",
        "max_output_tokens": 5,
        "temperature": 0,
        "metadata": {"k": "v"},
        "user": "u1",
        "text": {"format": {"type": "text"}},
        "tools": [],
        "tool_choice": "none",
        "truncation": "disabled",
        "reasoning": None,
    }
    async with http(app) as client:
        resp = await client.post("/v1/responses", json=body)
        taken = await serve
        rid = taken.task.request_id
        data = resp.json()
        assert resp.status_code == 200 and resp.headers["x-request-id"] == rid
        assert rid.startswith("resp-") and data["id"] == "resp_" + rid.removeprefix("resp-")
        assert data == _expected(
            rid,
            "Hello world",
            created_at=data["created_at"],
            completed_at=data["completed_at"],
            instructions="Answer briefly.",
            max_output_tokens=5,
            metadata={"k": "v"},
            user="u1",
            temperature=0.0,
            tool_choice="none",
        )
        assert isinstance(data["created_at"], int) and data["completed_at"] >= data["created_at"]
        Response.model_validate(data)  # every field the official client's type requires
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
        ]
        assert taken.task.prompt_token_ids == smollm_tokenizer.apply_chat_template(messages)
        assert taken.task.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_p=0.9)
        got = await client.get(f"/v1/responses/{data['id']}")
        assert got.status_code == 200 and got.json() == data
        state = (await client.get(f"/v1/requests/{rid}")).json()
        assert (state["status"], state["user"]) == ("finished", "u1")


async def test_stream_events_in_order(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    serve = asyncio.create_task(role.serve_one(HELLO, finish_reason="length", usage=USAGE))
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 2}
    async with http(app) as client:
        resp = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "resp-s1"})
    await serve
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.content)
    assert [(i, e) for i, e, _ in events] == [
        (None, "response.created"),
        (None, "response.in_progress"),
        (None, "response.output_item.added"),
        (None, "response.content_part.added"),
        ("0", "response.output_text.delta"),
        ("1", "response.output_text.delta"),
        (None, "response.output_text.done"),
        (None, "response.content_part.done"),
        (None, "response.output_item.done"),
        (None, "response.incomplete"),
    ]
    assert [d["sequence_number"] for _, _, d in events] == list(range(10))
    data = [d for _, _, d in events]
    created = data[0]["response"]
    assert (created["id"], created["status"], created["output"]) == ("resp_s1", "in_progress", [])
    assert data[2]["item"] == {
        "id": "msg_s1",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    where = {"item_id": "msg_s1", "output_index": 0, "content_index": 0}
    assert data[3] == {"type": "response.content_part.added", **where, "part": part,
                       "sequence_number": 3}  # fmt: skip
    assert data[4] == {"type": "response.output_text.delta", **where, "delta": "Hello",
                       "logprobs": [], "sequence_number": 4}  # fmt: skip
    assert data[5]["delta"] == " world"
    assert data[6] == {"type": "response.output_text.done", **where, "text": "Hello world",
                       "logprobs": [], "sequence_number": 6}  # fmt: skip
    assert data[7]["part"] == {**part, "text": "Hello world"}
    final = data[9]["response"]
    assert data[8]["item"] == final["output"][0]
    assert final == _expected(
        "resp-s1",
        "Hello world",
        created_at=created["created_at"],
        completed_at=None,
        status="incomplete",
        incomplete_details={"reason": "max_output_tokens"},
        max_output_tokens=2,
        output=[{**final["output"][0], "status": "incomplete"}],
    )
    Response.model_validate(final)


async def test_previous_response_id_continues_the_conversation(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(HELLO))
        first = body = {"model": MODEL, "input": "Hi", "instructions": "Be terse."}
        first = (await client.post("/v1/responses", json=body)).json()
        await serve
        serve = asyncio.create_task(role.serve_one([(30, "?")]))
        body = {
            "model": MODEL,
            "previous_response_id": first["id"],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Again"}]}],
        }
        second = (await client.post("/v1/responses", json=body)).json()
        taken = await serve
        # instructions are not carried over; the first exchange is
        earlier = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello world"},
        ]
        messages = [*earlier, {"role": "user", "content": "Again"}]
        assert taken.task.prompt_token_ids == smollm_tokenizer.apply_chat_template(messages)
        assert second["previous_response_id"] == first["id"]
        assert second["instructions"] is None
        # a third turn sees both exchanges
        serve = asyncio.create_task(role.serve_one([(30, "!")]))
        body = {"model": MODEL, "previous_response_id": second["id"], "input": "More"}
        assert (await client.post("/v1/responses", json=body)).status_code == 200
        taken = await serve
        messages += [{"role": "assistant", "content": "?"}, {"role": "user", "content": "More"}]
        assert taken.task.prompt_token_ids == smollm_tokenizer.apply_chat_template(messages)


async def test_store_false_and_unknown_ids(harness):
    factory, worker = harness
    app = factory(api_keys=("k1", "k2"))
    role = await worker(app)
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(HELLO))
        body = {"model": MODEL, "input": "Hi", "store": False}
        unstored = (await client.post("/v1/responses", json=body, headers=k1)).json()
        await serve
        assert unstored["store"] is False and unstored["status"] == "completed"
        serve = asyncio.create_task(role.serve_one(HELLO))
        stored = await client.post("/v1/responses", json={**body, "store": True}, headers=k1)
        await serve
        stored_id = stored.json()["id"]
        assert (await client.get(f"/v1/responses/{stored_id}", headers=k1)).status_code == 200
        for rid, headers in ((unstored["id"], k1), (stored_id, k2), ("resp_nope", k1)):
            got = await client.get(f"/v1/responses/{rid}", headers=headers)
            assert got.status_code == 404
            assert got.json()["error"] == {
                "message": f"Response with id '{rid}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": "response_not_found",
            }
            follow = {"model": MODEL, "input": "x", "previous_response_id": rid}
            refused = await client.post("/v1/responses", json=follow, headers=headers)
            assert refused.status_code == 400
            assert refused.json()["error"] == {
                "message": f"Previous response with id '{rid}' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }
        bad = await client.get("/v1/responses/chatcmpl-1", headers=k1)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request_id"
        assert "x-request-id" not in bad.headers
        bad = await client.post(
            "/v1/responses", json=body, headers={**k1, "X-Request-Id": "chatcmpl-1"}
        )
        assert bad.status_code == 400
        assert (bad.json()["error"]["param"], bad.json()["error"]["code"]) == (
            "X-Request-Id", "invalid_request_id")  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
            "text.format.name",
            None,
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x" * 65, "schema": {}}}},
            "text.format.name",
            None,
        ),
        (  # answers no function call of the conversation (input, previous response)
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
            "input[0].call_id",
            None,
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": ""},
                    {"type": "function_call_output", "call_id": "call_1", "output": "x"},
                    {"type": "function_call_output", "call_id": "call_2", "output": "x"},
                ]
            },
            "input[2].call_id",
            None,
        ),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
            "tools[0].parameters",
            None,
        ),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "unsupported_value"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_value"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "unsupported_value"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}},
            "text.format.schema",
            None,
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "missing_required_parameter",
        ),
        ({"truncation": "auto"}, "truncation", "unsupported_value"),
        ({"background": True}, "background", "unknown_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"input": ""}, "input", "invalid_value"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "unsupported_value",
        ),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", "unsupported_value"),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
            "missing_required_parameter",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}]},
            "input[0].arguments",
            "invalid_type",
        ),
        ({"model": "gpt-17"}, "model", "model_not_found"),
    ],
)
async def test_refused_fields(harness, extra, param, code):
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
    error = resp.json()["error"]
    assert resp.status_code == (404 if code == "model_not_found" else 400)
    assert (error["param"], error["code"]) == (param, code)
    ing = app.state.ingress
    assert await ing.redis.xlen(ing.keys.prefill_stream) == 0  # nothing queued
    assert await ing.redis.xlen(ing.keys.decode_stream) == 0


async def test_official_client(valkey_session, smollm_tokenizer):
    """client.responses.create (whole and stream=True), .stream() and .retrieve()."""
    async with serving(valkey_session.url, smollm_tokenizer) as (base, _app, role):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        serve = asyncio.create_task(role.serve_one(HELLO, usage=USAGE))
        whole = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
        await serve
        assert (whole.status, whole.output_text) == ("completed", "Hello world")
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (31, 2)
        assert whole.usage.input_tokens_details.cached_tokens == 16

        serve = asyncio.create_task(role.serve_one(HELLO))
        stream = await client.responses.create(
            model=MODEL, input="Hi", previous_response_id=whole.id, stream=True
        )
        events = [event async for event in stream]
        taken = await serve
        assert [e.type for e in events][-3:] == [
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert deltas == ["Hello", " world"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello world"},
            {"role": "user", "content": "Hi"},
        ]
        assert taken.task.prompt_token_ids == smollm_tokenizer.apply_chat_template(messages)

        serve = asyncio.create_task(role.serve_one([(30, "?")]))
        async with client.responses.stream(model=MODEL, input="Hi") as manager:
            texts = [e.delta async for e in manager if e.type == "response.output_text.delta"]
            final = await manager.get_final_response()
        await serve
        assert texts == ["?"] and final.output_text == "?" and final.status == "completed"

        again = await client.responses.retrieve(final.id)
        assert again.output_text == "?" and again.id == final.id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_missing")
        with pytest.raises(openai.BadRequestError) as info:
            output = {"type": "function_call_output", "call_id": "call_x", "output": "1"}
            await client.responses.create(model=MODEL, input=[output])
        assert info.value.param == "input[0].call_id"
        assert info.value.body["message"] == (
            "No tool call found for function call output with call_id 'call_x'."
        )
        deleted = await client.responses.delete(final.id)
        assert deleted is None  # the client returns nothing; the body is checked below
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(final.id)
        await client.close()


async def test_generated_bodies_match_the_request_model(harness):
    """Seeded bodies from /openapi.json's ResponsesRequest (no worker: accepted ones time out):
    the server and the model agree, and every refusal is OpenAI-shaped."""
    factory, _ = harness
    # the priority policy: any priority the schema allows is served
    app = factory(
        request_timeout_s=0.05,
        max_waiting=100_000,
        disconnect_grace_s=0.0,
        scheduling_policy="priority",
    )
    async with http(app) as client:
        doc = (await client.get("/openapi.json")).json()
        gen = Generator(doc["components"]["schemas"], 20261124, MODEL)
        schema = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
        cases = []
        for i in range(120):
            body = gen.valid(schema["application/json"]["schema"])
            body.pop("previous_response_id", None)  # a stored response, not a schema matter
            cases.append(("valid", body) if i < 48 else gen.mutate(body, ["model", "input"]))
        resps = []
        for start in range(0, len(cases), 24):
            resps += await asyncio.gather(
                *(
                    client.post(
                        "/v1/responses",
                        content=json.dumps(body).encode(),
                        headers={"content-type": "application/json"},
                    )
                    for _kind, body in cases[start : start + 24]
                )
            )
    accepted = 0
    for (kind, body), resp in zip(cases, resps, strict=True):
        what = f"{kind} {json.dumps(body)[:300]} -> {resp.status_code} {resp.text[:300]}"
        ok = _model_accepts(ResponsesRequest, body)
        if kind == "valid":
            assert ok, what
        if _accepted(resp):
            assert ok, what
            accepted += 1
            continue
        assert 400 <= resp.status_code < 500, what
        err = _check_error_shape(resp, what)
        if ok:
            assert resp.status_code in (400, 404) and _schema_only_limit(err), what
    assert accepted >= 48


async def test_repost_reattaches_and_resumes_after_last_event_id(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "input": "Hi", "stream": True}
    headers = {"X-Request-Id": "resp-r1"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(HELLO))
        first = await client.post("/v1/responses", json=body, headers=headers)
        await serve
        again = await client.post(
            "/v1/responses", json=body, headers={**headers, "Last-Event-ID": "0"}
        )
        whole = await client.post("/v1/responses", json={**body, "stream": False}, headers=headers)
        other = await client.post("/v1/responses", json={**body, "input": "Ho"}, headers=headers)
    full = _events(first.content)
    resumed = _events(again.content)
    # the deltas after token 0, then the ending, numbered as in the first reply
    assert [(i, e, d["sequence_number"]) for i, e, d in resumed] == [
        ("1", "response.output_text.delta", 5),
        (None, "response.output_text.done", 6),
        (None, "response.content_part.done", 7),
        (None, "response.output_item.done", 8),
        (None, "response.completed", 9),
    ]
    assert resumed[0][2] == full[5][2]
    assert whole.status_code == 200 and whole.json()["output"] == full[-1][2]["response"]["output"]
    assert other.status_code == 409 and other.json()["error"]["code"] == "duplicate_request_id"


async def test_a_failed_generation(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as client:
        for stream in (False, True):
            post = asyncio.create_task(
                client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "stream": stream})
            )
            taken = await role.take()
            rid = taken.task.request_id
            await role.emit(rid, TokenChunk(index=0, token_ids=[19556], text="Hello"))
            await role.emit(rid, TokenChunk(index=1, finish_reason="error", error="worker died"))
            await role.finish(taken, status="failed")
            resp = await post
            stored = (await client.get("/v1/responses/resp_" + rid.removeprefix("resp-"))).json()
            assert (stored["status"], stored["error"]) == (
                "failed", {"code": "server_error", "message": "worker died"})  # fmt: skip
            assert stored["output"][0]["content"][0]["text"] == "Hello"
            if not stream:
                assert resp.status_code == 500
                assert resp.json()["error"]["code"] == "generation_failed"
            else:
                events = _events(resp.content)
                assert events[-1][1] == "response.failed"
                assert events[-1][2]["response"] == stored


async def test_delete_a_stored_response(harness):
    """OpenAI's DELETE: the body, then 404 on GET and DELETE, 400 as a previous response; only
    the owner's key deletes, and a re-post of the same request does not store it again."""
    factory, worker = harness
    app = factory(api_keys=("k1", "k2"))
    role = await worker(app)
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    body = {"model": MODEL, "input": "Hi"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one(HELLO))
        posted = await client.post(
            "/v1/responses", json=body, headers={**k1, "X-Request-Id": "resp-d1"}
        )
        await serve
        assert posted.status_code == 200
        path = "/v1/responses/resp_d1"
        other = await client.delete(path, headers=k2)  # another key's: not there for it
        assert other.status_code == 404
        assert (await client.get(path, headers=k1)).status_code == 200
        deleted = await client.delete(path, headers=k1)
        assert deleted.status_code == 200
        assert deleted.json() == {"id": "resp_d1", "object": "response", "deleted": True}
        assert deleted.headers["x-request-id"] == "resp-d1"
        not_found = {
            "message": "Response with id 'resp_d1' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": "response_not_found",
        }
        for again in (client.get(path, headers=k1), client.delete(path, headers=k1)):
            resp = await again
            assert resp.status_code == 404 and resp.json()["error"] == not_found
        follow = {**body, "previous_response_id": "resp_d1"}
        refused = await client.post("/v1/responses", json=follow, headers=k1)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "previous_response_not_found"
        # the same request posted again reattaches and answers, but stays deleted
        again = await client.post(
            "/v1/responses", json=body, headers={**k1, "X-Request-Id": "resp-d1"}
        )
        assert again.status_code == 200 and again.json()["output"] == posted.json()["output"]
        assert (await client.get(path, headers=k1)).status_code == 404
        bad = await client.delete("/v1/responses/chatcmpl-1", headers=k1)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request_id"
        missing_key = await client.delete("/v1/responses/resp_nope")
        assert missing_key.status_code == 401


async def test_delete_a_response_in_progress(harness):
    """Deleting while the answer is generated: the client that asked still gets it; the final
    object is not stored (GET stays 404)."""
    factory, worker = harness
    app = factory()
    role = await worker(app)
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/responses", json={"model": MODEL, "input": "Hi"},
                        headers={"X-Request-Id": "resp-d2"})
        )  # fmt: skip
        taken = await role.take()
        for _ in range(500):  # stored in progress just after it is queued
            got = await client.get("/v1/responses/resp_d2")
            if got.status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert got.json()["status"] == "in_progress"
        deleted = await client.delete("/v1/responses/resp_d2")
        assert deleted.json() == {"id": "resp_d2", "object": "response", "deleted": True}
        for i, (tid, text) in enumerate(HELLO):
            chunk = TokenChunk(index=i, token_ids=[tid], text=text,
                               finish_reason="stop" if i == len(HELLO) - 1 else None)  # fmt: skip
            await role.emit(taken.task.request_id, chunk)
        await role.finish(taken)
        answered = await post
        assert answered.status_code == 200
        assert answered.json()["status"] == "completed"
        assert answered.json()["output"][0]["content"][0]["text"] == "Hello world"
        assert (await client.get("/v1/responses/resp_d2")).status_code == 404
