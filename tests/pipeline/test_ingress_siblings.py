"""Two ingresses on one Redis (as `kvrelay up --ingresses 2` runs them): a request started at one
is resumed at the other, which holds nothing of it in memory: the Responses API stream after
Last-Event-ID (numbered as the first reply, the answer stored), a chat stream after
Last-Event-ID and a repeated X-Request-Id submission; a client gone from one ingress and back at
the other within the disconnect grace keeps its request (the attach count is in Redis)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, http, make_config, parse_sse
from tests.pipeline.queue_sim import cancel_flags
from tests.pipeline.test_ingress_server import serving

pytestmark = pytest.mark.anyio

CHUNKS = [
    TokenChunk(index=0, token_ids=[19556], text="Hello"),
    TokenChunk(index=1, token_ids=[905, 28], text=" world!", finish_reason="stop",
               usage={"prompt_tokens": 3, "completion_tokens": 3}),
]  # fmt: skip


def _events(body: bytes) -> list[tuple[str | None, str, dict]]:
    """(id, event, data) per Responses API SSE event."""
    out = []
    for block in body.decode().split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("id"), lines["event"], json.loads(lines["data"])))
    return out


def _siblings(factory):
    first = factory()
    return first, factory(key_prefix=first.state.ingress.config.key_prefix)


async def _serve(role, request_id: str, between) -> None:
    """Answer the request with CHUNKS, running `between()` after the first chunk."""
    taken = await role.take()
    assert taken.task.request_id == request_id
    await role.emit(request_id, CHUNKS[0])
    await between()
    await role.emit(request_id, CHUNKS[1])
    await role.finish(taken)


async def test_a_response_started_at_one_ingress_streams_on_from_another(harness):
    factory, worker = harness
    first, second = _siblings(factory)
    assert first.state.ingress.feed.reader_id != second.state.ingress.feed.reader_id
    role = await worker(first)
    body = {"model": MODEL, "input": "Hi", "stream": True}
    headers = {"X-Request-Id": "resp-sib1"}
    async with http(first) as one, http(second) as two:
        started = asyncio.create_task(one.post("/v1/responses", json=body, headers=headers))
        resumed: list = []

        async def resume_at_the_other() -> None:  # while the request runs
            again = {**headers, "Last-Event-ID": "0"}
            resumed.append(asyncio.create_task(two.post("/v1/responses", json=body, headers=again)))

        await _serve(role, "resp-sib1", resume_at_the_other)
        full, tail = _events((await started).content), _events((await resumed[0]).content)
        stored = await two.get("/v1/responses/resp_sib1")
    # the other ingress sends the deltas after token 0 and the ending, exactly as the first
    # reply has them (sequence numbers, ids, the final object)
    after = next(k for k, (i, _e, _d) in enumerate(full) if i == "0") + 1
    assert [e for _i, e, _d in full[after:]] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert tail == full[after:]
    final = full[-1][2]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello world!"
    assert stored.status_code == 200 and stored.json() == final


async def test_a_chat_stream_resumes_and_a_repost_reattaches_at_another_ingress(harness):
    factory, worker = harness
    first, second = _siblings(factory)
    role = await worker(first)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    headers = {"X-Request-Id": "chat-sib1"}
    async with http(first) as one, http(second) as two:
        started = asyncio.create_task(one.post("/v1/chat/completions", json=body, headers=headers))
        resumed: list = []

        async def resume_at_the_other() -> None:
            resumed.append(asyncio.create_task(two.get(
                "/v1/requests/chat-sib1/stream", headers={"Last-Event-ID": "0"})))  # fmt: skip

        await _serve(role, "chat-sib1", resume_at_the_other)
        full, tail = parse_sse((await started).content), parse_sse((await resumed[0]).content)
        whole = await two.post(
            "/v1/chat/completions", json={**body, "stream": False}, headers=headers
        )
    # the first reply: role, token 0, tokens 1-2 (final), [DONE]; the other ingress sends
    # what came after token 0, the same bytes
    assert [i for i, _d in full] == [None, "0", "1", None]
    assert tail == full[2:]
    assert json.loads(tail[0][1])["choices"][0]["delta"] == {"content": " world!"}
    assert whole.status_code == 200
    answer = whole.json()
    text = answer["choices"][0]["message"]["content"]
    assert (answer["id"], text) == ("chat-sib1", "Hello world!")


async def test_a_client_gone_from_one_ingress_and_back_at_another_keeps_its_request(
    valkey_session, smollm_tokenizer
):
    url, grace = valkey_session.url, 0.5
    async with serving(url, smollm_tokenizer, disconnect_grace_s=grace) as (base, app, role):
        ing = app.state.ingress
        config = make_config(url, key_prefix=ing.config.key_prefix, disconnect_grace_s=grace)
        other = create_app(config, tokenizers={MODEL: smollm_tokenizer})
        body = {"model": MODEL, "prompt": "Hi"}
        headers = {"X-Request-Id": "gone-1"}
        try:
            async with httpx.AsyncClient(base_url=base) as one, http(other) as two:
                with pytest.raises(httpx.ReadTimeout):  # gone from the first ingress
                    await one.post("/v1/completions", json=body, headers=headers, timeout=0.3)
                taken = await role.take()
                back = asyncio.create_task(two.post("/v1/completions", json=body,
                                                    headers=headers))  # fmt: skip
                record, tries = ing.keys.request("gone-1"), 0
                while await ing.redis.hget(record, "attach") != b"1":  # back at the other
                    tries += 1
                    assert tries < 1000, "the client did not reattach"
                    await asyncio.sleep(0.01)
                await asyncio.sleep(grace + 0.3)  # past the first ingress's grace period
                assert await cancel_flags(ing.redis, ing.keys, ["gone-1"]) == [False]
                await role.emit("gone-1", TokenChunk(index=0, token_ids=[1], text="a",
                                                     finish_reason="stop"))  # fmt: skip
                await role.finish(taken)
                assert (await back).json()["choices"][0]["text"] == "a"
        finally:
            await other.state.ingress.aclose()
