"""Submitting across a Valkey restart: a new request waits for Valkey (up to `submit_wait_s` and
its deadline) instead of a 503, over HTTP and from the producer client, and is queued once even
when the reply to a script that ran is lost."""

from __future__ import annotations

import asyncio
import re

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvrelay.core.keys import Keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.openai.protocol import parse_completion
from kvrelay.pipeline.queue import outage as outage_module
from kvrelay.pipeline.queue import submit as submit_module
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, WorkerRole, http, make_config, unique_prefix

pytestmark = pytest.mark.anyio

OUTAGE_S = 1.0  # how long Valkey stays down: many retries, well inside the default wait


def _client(url: str, prefix: str, tokenizer, **kwargs) -> AsyncClient:
    return AsyncClient(url, key_prefix=prefix, tokenizers={MODEL: tokenizer}, **kwargs)


def _entries(url: str, keys: Keys) -> int:
    r = redis.Redis.from_url(url)
    try:
        return r.xlen(keys.prefill_stream) + r.xlen(keys.decode_stream)
    finally:
        r.close()


async def _restart_after(valkey, pending: asyncio.Task) -> None:
    """Valkey down for OUTAGE_S while `pending` waits for it, then back (its AOF reloaded)."""
    await asyncio.sleep(OUTAGE_S)
    assert not pending.done(), pending  # waiting, not failed
    await asyncio.to_thread(valkey.start)


async def test_client_submit_waits_for_a_valkey_restart(valkey, smollm_tokenizer):
    prefix = unique_prefix()
    await (await WorkerRole(valkey.url, Keys(prefix)).setup()).aclose()  # groups, in the AOF
    async with _client(valkey.url, prefix, smollm_tokenizer) as client:
        valkey.stop(kill=True)
        submit = asyncio.create_task(
            client.submit("Hello", request_id="o-1", sampling=SamplingParams(max_tokens=4))
        )
        await _restart_after(valkey, submit)
        assert await asyncio.wait_for(submit, 20) == "o-1"
        assert (await client.status("o-1"))["status"] == "queued"
    role = await WorkerRole(valkey.url, Keys(prefix)).setup()
    try:
        taken = await role.take()
        assert (taken.stage, taken.task.request_id, taken.task.prompt_token_ids) == (
            "decode", "o-1", [19556])  # fmt: skip
    finally:
        await role.aclose()
    assert _entries(valkey.url, Keys(prefix)) == 1


async def test_enqueue_waits_for_a_restart_once_prepared(valkey, smollm_tokenizer):
    prefix = unique_prefix()
    async with _client(valkey.url, prefix, smollm_tokenizer) as client:
        parsed = parse_completion({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        task, entry = await client.producer.prepare_parsed(parsed, request_id="o-2")
        valkey.stop(kill=True)
        queue = asyncio.create_task(client.producer.enqueue(task, entry))
        await _restart_after(valkey, queue)
        route = await asyncio.wait_for(queue, 20)
    assert (route.stage, route.reason) == ("decode", "short prompt")
    assert _entries(valkey.url, Keys(prefix)) == 1


async def test_a_lost_reply_to_a_queued_request_queues_it_once(valkey_session, smollm_tokenizer):
    """The script ran but its reply never came (the connection dropped): the retry is told
    the request is queued (its own submission), not 409, and nothing is queued twice."""
    prefix = unique_prefix()
    async with _client(valkey_session.url, prefix, smollm_tokenizer) as client:
        producer = client.producer
        script, calls = producer._submit, []

        async def reply_lost_once(keys, args):
            reply = await script(keys=keys, args=args)
            calls.append((reply, args[5].encode()))  # and the submission id it was given
            if len(calls) == 1:
                raise RedisConnectionError("Connection closed by server.")
            return reply

        producer._submit = reply_lost_once
        assert await client.submit("Hello", request_id="lost-1") == "lost-1"
        (queued, first_id), (replayed, second_id) = calls
        assert re.fullmatch(rb"\d+-\d+", queued)  # the entry was added by the first try
        assert replayed == first_id == second_id  # the retry: "this submission is queued"
        assert _entries(valkey_session.url, Keys(prefix)) == 1
        # the same id from another submission is still refused
        with pytest.raises(RequestError) as info:
            await client.submit("Hello", request_id="lost-1")
        assert (info.value.status, info.value.code) == (409, "duplicate_request_id")
        assert calls[2][0] is None and calls[2][1] != first_id
    assert _entries(valkey_session.url, Keys(prefix)) == 1


async def test_a_429_is_not_retried(valkey_session, smollm_tokenizer):
    prefix = unique_prefix()
    async with _client(valkey_session.url, prefix, smollm_tokenizer) as client:
        producer = client.producer
        producer.max_waiting = 1
        await client.submit("Hello")
        script, replies = producer._submit, []

        async def counted(keys, args):
            replies.append(await script(keys=keys, args=args))
            return replies[-1]

        producer._submit = counted
        with pytest.raises(RequestError) as info:
            await client.submit("Hello")
        assert (info.value.status, info.value.code) == (429, "overloaded")
        assert replies == [1]  # one try, refused with the queue length: no retry
    assert _entries(valkey_session.url, Keys(prefix)) == 1


@pytest.mark.parametrize(
    ("wait_s", "timeout_s"), [(0.5, 600.0), (30.0, 0.5)], ids=["submit_wait_s", "deadline"]
)
async def test_client_gives_503_when_valkey_stays_down(valkey, smollm_tokenizer, fake_clock,
                                                        wait_s, timeout_s):  # fmt: skip
    prefix = unique_prefix()
    # the clock of the outage wait and of the deadline: it moves only as the submission waits
    fake_clock.install(outage_module, submit_module)
    async with _client(
        valkey.url, prefix, smollm_tokenizer, submit_wait_s=wait_s, timeout_s=timeout_s
    ) as client:
        valkey.stop(kill=True)
        with pytest.raises(RequestError) as info:
            await client.submit("Hello")
    assert (info.value.status, info.value.code) == (503, "queue_unavailable")
    # retried with pauses for exactly the bound (submit_wait_s or the deadline), then gave up
    assert len(fake_clock.slept) > 1 and fake_clock.waited == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("request_id", [None, "chosen-1"], ids=["new-id", "x-request-id"])
async def test_http_request_waits_for_a_valkey_restart(valkey, smollm_tokenizer, request_id):
    # with X-Request-Id the ingress first looks the id up: that read waits too
    app = create_app(make_config(valkey.url), tokenizers={MODEL: smollm_tokenizer})
    ing = app.state.ingress
    await (await WorkerRole(valkey.url, ing.keys).setup()).aclose()
    headers = {"X-Request-Id": request_id} if request_id else {}
    try:
        async with http(app) as client:
            valkey.stop(kill=True)
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
            post = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
            await _restart_after(valkey, post)
            role = await WorkerRole(valkey.url, ing.keys).setup()
            try:
                await role.serve_one([(905, " world"), (17, "!")], finish_reason="length")
            finally:
                await role.aclose()
            resp = await asyncio.wait_for(post, 20)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == " world!"
    finally:
        await ing.aclose()
    assert _entries(valkey.url, ing.keys) == 1


async def test_http_request_gets_503_past_submit_wait_s(valkey, smollm_tokenizer, fake_clock):
    config = make_config(valkey.url, submit_wait_s=0.5)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    try:
        async with http(app) as client:
            valkey.stop(kill=True)
            fake_clock.install(outage_module, submit_module)  # moves only as the wait pauses
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "queue_unavailable"
        # retried with pauses for exactly submit_wait_s, then gave up
        assert len(fake_clock.slept) > 1 and fake_clock.waited == pytest.approx(0.5, abs=1e-3)
    finally:
        await app.state.ingress.aclose()
