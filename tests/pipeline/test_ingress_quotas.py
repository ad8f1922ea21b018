"""Per-key quotas at the ingress: exact across two ingresses sharing one Valkey, tokens as
OpenAI counts them, concurrency units held until the reply ends, OpenAI's headers and 429s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import pytest

from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.errors import overloaded
from kvrelay.pipeline.queue.quota import WINDOW_MS, go_duration
from kvrelay.pipeline.server.api_keys import key_id_of
from tests.pipeline.ingress_support import MODEL, WorkerRole, http, unique_prefix

pytestmark = pytest.mark.anyio

KEYS_FILE = """
[[key]]
name = "limited"
key = "sk-limited"
rpm = {rpm}
tpm = {tpm}
max_concurrent = {max_concurrent}

[[key]]
name = "free"
key = "sk-free"
"""
LIMITED = {"Authorization": "Bearer sk-limited"}
FREE = {"Authorization": "Bearer sk-free"}


def keys_file(tmp_path, rpm=0, tpm=0, max_concurrent=0) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE.format(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent))
    return str(path)


@contextlib.asynccontextmanager
async def serving_all(role: WorkerRole):
    """Answer every request queued meanwhile with one final token (several choices too)."""

    stopped = False

    async def loop() -> None:
        while not stopped:  # (a cancel inside redis-py's read may come out as a TimeoutError)
            try:
                taken = await role.take(timeout_s=0.2)
            except TimeoutError:
                continue
            chunk = TokenChunk(index=0, token_ids=[65], text="a", finish_reason="stop")
            await role.emit(taken.task.request_id, chunk)
            await role.finish(taken)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stopped = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def completion(prompt, max_tokens: int = 1, **more) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **more}


def check_refusal(resp, kind: str) -> int:
    """The wait (ms) a 429 of the quota says, checked against its headers."""
    assert resp.status_code == 429
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (kind, "rate_limit_exceeded", None)
    wait_ms = int(resp.headers["retry-after-ms"])
    assert resp.headers["retry-after"] == str(math.ceil(wait_ms / 1000))
    assert error["message"].endswith(f"Please try again in {go_duration(wait_ms)}.")
    return wait_ms


async def test_requests_per_minute_exact_over_two_ingresses(harness, tmp_path):
    factory, worker = harness
    prefix, path = unique_prefix(), keys_file(tmp_path, rpm=50)
    apps = [factory(key_prefix=prefix, api_keys_file=path) for _ in range(2)]
    role = await worker(apps[0])
    clients = [http(app) for app in apps]
    async with serving_all(role), clients[0], clients[1]:
        posts = [
            clients[i % 2].post("/v1/completions", json=completion([1, 2, 3]), headers=LIMITED)
            for i in range(200)
        ]
        replies = await asyncio.gather(*posts)
    statuses = [r.status_code for r in replies]
    assert (statuses.count(200), statuses.count(429)) == (50, 150)
    admitted = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    # both ingresses admitted some; each admitted request saw its own place in the window
    assert {r.json()["choices"][0]["text"] for r in admitted} == {"a"}
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in admitted)
    assert remaining == list(range(50))
    for r in replies:
        assert r.headers["x-ratelimit-limit-requests"] == "50"
        assert "x-ratelimit-limit-tokens" not in r.headers  # no tokens limit
    ing = apps[0].state.ingress
    left_after = await ing.redis.pttl(ing.keys.quota_requests(key_id_of("sk-limited")))
    assert await ing.redis.get(ing.keys.quota_requests(key_id_of("sk-limited"))) == b"50"
    for r in refused:
        wait_ms = check_refusal(r, "requests")
        assert left_after <= wait_ms <= WINDOW_MS
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"] == go_duration(wait_ms)
        assert r.json()["error"]["message"] == (
            "Rate limit reached for key 'limited' on requests per min (RPM): Limit 50, Used 50, "
            f"Requested 1. Please try again in {go_duration(wait_ms)}."
        )


async def test_tokens_per_minute_count_prompts_and_max_tokens(harness, tmp_path):
    factory, worker = harness
    app = factory(api_keys_file=keys_file(tmp_path, tpm=100))
    role = await worker(app)
    async with serving_all(role), http(app) as client:

        async def post(body):
            return await client.post("/v1/completions", json=body, headers=LIMITED)

        resp = await post(completion([1, 2, 3, 4, 5], max_tokens=10))  # 5 + 10
        assert resp.status_code == 200
        assert resp.headers["x-ratelimit-limit-tokens"] == "100"
        assert resp.headers["x-ratelimit-remaining-tokens"] == "85"
        assert resp.headers["x-ratelimit-reset-tokens"] == "1m0s"
        assert "x-ratelimit-limit-requests" not in resp.headers
        # n choices of one prompt: its tokens once, max_tokens each
        resp = await post(completion([1, 2, 3, 4, 5], max_tokens=10, n=2))  # 5 + 2 * 10
        assert resp.status_code == 200
        assert resp.headers["x-ratelimit-remaining-tokens"] == "60"
        # several prompts: each prompt's tokens and max_tokens; streamed, the same headers
        async with client.stream(
            "POST",
            "/v1/completions",
            json=completion([[1, 2], [3, 4, 5]], max_tokens=5, stream=True),
            headers=LIMITED,
        ) as stream:
            body = b"".join([part async for part in stream.aiter_bytes()])
        assert stream.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
        assert stream.headers["x-ratelimit-remaining-tokens"] == "45"  # 60 - (5 + 2 * 5)
        refused = await post(completion([1, 2, 3, 4, 5, 6], max_tokens=40))  # 46 > 45
        wait_ms = check_refusal(refused, "tokens")
        assert refused.headers["x-ratelimit-remaining-tokens"] == "45"  # nothing taken
        assert refused.headers["x-ratelimit-reset-tokens"] == go_duration(wait_ms)
        assert refused.json()["error"]["message"].startswith(
            "Rate limit reached for key 'limited' on tokens per min (TPM): Limit 100, Used 55, "
            "Requested 46."
        )
        resp = await post(completion([1, 2, 3, 4, 5], max_tokens=40))  # 45: exactly what is left
        assert resp.status_code == 200 and resp.headers["x-ratelimit-remaining-tokens"] == "0"
        huge = await post(completion([1], max_tokens=100))
        assert huge.status_code == 429 and "retry-after" not in huge.headers
        assert huge.json()["error"] == {
            "message": "Request too large for key 'limited' on tokens per min (TPM): Limit 100, "
            "Requested 101. The input or output tokens must be reduced in order to run "
            "successfully.",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        # errors before the quota (a bad body) take nothing and carry no quota headers
        bad = await post(completion([1], max_tokens=-1))
        assert bad.status_code == 400 and "x-ratelimit-limit-tokens" not in bad.headers


class OpenReply:
    """A POST sent straight to the ASGI app, whose client disconnects when told to."""

    def __init__(self, app, body: dict, headers: dict[str, str]):
        self.messages: list[dict] = []
        self.started = asyncio.Event()
        self._gone = asyncio.Event()
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), *raw],
            "client": ("127.0.0.1", 5000),
            "server": ("ingress", 80),
        }
        self._body = json.dumps(body).encode()
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.start":
            self.started.set()

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    async def disconnect(self) -> None:
        self._gone.set()
        await asyncio.wait_for(self.task, 5)


async def _units(app, key: str) -> int:
    ing = app.state.ingress
    return await ing.redis.zcard(ing.keys.quota_open(key_id_of(key)))


async def _released(app, key: str, expected: int) -> None:
    """The units given back (a reply's end releases them right after its last byte)."""
    for _ in range(250):
        if await _units(app, key) == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {await _units(app, key)} units open, expected {expected}")


async def test_concurrent_requests_held_until_the_reply_ends(harness, tmp_path):
    factory, worker = harness
    app = factory(api_keys_file=keys_file(tmp_path, max_concurrent=2))
    role = await worker(app)
    stream = completion([1, 2], max_tokens=4, stream=True)
    async with http(app) as client:
        # two open streams (no worker answers yet) hold both units
        first, second = OpenReply(app, stream, LIMITED), OpenReply(app, stream, LIMITED)
        await asyncio.wait_for(asyncio.gather(first.started.wait(), second.started.wait()), 5)
        assert (first.status, second.status) == (200, 200)
        assert "x-ratelimit-limit-requests" not in first.headers  # no per-minute limits
        assert await _units(app, "sk-limited") == 2
        refused = await client.post("/v1/completions", json=completion([1]), headers=LIMITED)
        assert check_refusal(refused, "requests") == 1000  # the ingress's retry_after_s
        assert refused.json()["error"]["message"] == (
            "Rate limit reached for key 'limited' on concurrent requests: Limit 2, Open 2. "
            "Please try again in 1s."
        )
        # a key without limits is never counted
        free = await client.post("/v1/completions", json=completion([1], n=0), headers=FREE)
        assert free.status_code == 400 and "x-ratelimit-limit-requests" not in free.headers

        # completion: the first is answered; its unit is given back as its reply ends
        taken = [await role.take(), await role.take()]
        ids = [t.task.request_id for t in taken]
        done = TokenChunk(index=0, token_ids=[65], text="a", finish_reason="stop")
        await role.emit(first.headers["x-request-id"], done)
        await asyncio.wait_for(first.task, 5)
        assert first.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        await _released(app, "sk-limited", 1)

        # disconnect: the client goes away, its unit comes back at once
        third = OpenReply(app, stream, LIMITED)
        await asyncio.wait_for(third.started.wait(), 5)
        assert third.status == 200 and await _units(app, "sk-limited") == 2
        await second.disconnect()
        await _released(app, "sk-limited", 1)

        # cancel: DELETE, and the worker ends the request as cancelled
        fourth = OpenReply(app, stream, LIMITED)
        await asyncio.wait_for(fourth.started.wait(), 5)
        rid = fourth.headers["x-request-id"]
        resp = await client.delete(f"/v1/requests/{rid}", headers=LIMITED)
        assert resp.json()["cancelled"] is True
        await role.emit(rid, TokenChunk(index=0, token_ids=[], finish_reason="cancelled"))
        await asyncio.wait_for(fourth.task, 5)
        await _released(app, "sk-limited", 1)
        await third.disconnect()
        await _released(app, "sk-limited", 0)
        # several choices (n, a list of prompts) are one request: one unit
        several = OpenReply(app, completion([[1], [2]], n=2, stream=True), LIMITED)
        await asyncio.wait_for(several.started.wait(), 5)
        assert several.status == 200 and await _units(app, "sk-limited") == 1
        await several.disconnect()
        await _released(app, "sk-limited", 0)
        assert sorted(ids) == sorted(r.headers["x-request-id"] for r in (first, second))


async def test_a_request_refused_after_the_quota_gives_its_unit_back(harness, tmp_path):
    factory, _ = harness
    app = factory(api_keys_file=keys_file(tmp_path, rpm=10, max_concurrent=1))
    ing = app.state.ingress
    queued = ing.producer.enqueue

    async def full(*args, **kwargs):  # the queue's exact bound, reached meanwhile
        raise overloaded("1 requests waiting for a worker", 1)

    ing.producer.enqueue = full
    async with http(app) as client:
        for remaining in ("9", "8"):  # the unit came back: the next one is admitted
            resp = await client.post("/v1/completions", json=completion([1]), headers=LIMITED)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "overloaded"
            # counted (the quota admitted it), and its headers say so
            assert resp.headers["x-ratelimit-remaining-requests"] == remaining
            await _released(app, "sk-limited", 0)
        ing.producer.enqueue = queued
        first = OpenReply(app, completion([1], stream=True), LIMITED)
        await asyncio.wait_for(first.started.wait(), 5)
        assert first.status == 200 and first.headers["x-ratelimit-remaining-requests"] == "7"
        await first.disconnect()
        await _released(app, "sk-limited", 0)


async def test_keys_without_limits_are_not_counted(harness, tmp_path):
    factory, worker = harness
    app = factory(api_keys_file=keys_file(tmp_path, rpm=1), api_keys=("sk-plain",))
    role = await worker(app)
    async with serving_all(role), http(app) as client:
        for headers in (FREE, FREE, {"Authorization": "Bearer sk-plain"}):
            resp = await client.post("/v1/completions", json=completion([1]), headers=headers)
            assert resp.status_code == 200
            assert not [h for h in resp.headers if h.startswith("x-ratelimit")]
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                 "max_output_tokens": 2}, headers=LIMITED)  # fmt: skip
        assert resp.status_code == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"
        resp = await client.post("/v1/chat/completions", headers=LIMITED, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert check_refusal(resp, "requests") > 0
    ing = app.state.ingress
    found = [k async for k in ing.redis.scan_iter(match=f"*{ing.keys.prefix[:-1]}.quota.*")]
    assert found == [ing.keys.quota_requests(key_id_of("sk-limited")).encode()]
