"""Ingress hardening (issue #10) without workers: exact admission under a burst, huge prompts
off the event loop, unknown fields refused, deadlines met, the disconnect grace default."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from kvrelay.pipeline.queue import submit as submit_module
from kvrelay.pipeline.queue import subscription as subscription_module
from kvrelay.pipeline.server.config import IngressConfig
from tests.pipeline.ingress_support import MODEL, http, parse_sse
from tests.pipeline.queue_sim import cancel_flags

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
HEALTH_ANSWERS = 60
OVERLOADED = re.compile(
    r"The server is overloaded \((\d+) requests waiting for a worker\); retry after 2 s\."
)


async def test_max_waiting_is_exact_under_a_burst(harness):
    factory, _worker = harness
    app = factory(max_waiting=4, retry_after_s=2, request_timeout_s=1.0)
    ing = app.state.ingress
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    async with http(app) as client:
        resps = await asyncio.gather(
            *(
                client.post("/v1/completions", json=body, headers={"X-Request-Id": f"b-{i}"})
                for i in range(40)
            )
        )
    # no worker reads: the 4 admitted requests wait until their deadline, the rest are refused
    assert sorted(r.status_code for r in resps) == [429] * 36 + [504] * 4
    assert await ing.redis.xlen(ing.keys.decode_stream) == 4
    assert not await ing.redis.exists(ing.keys.prefill_stream)
    for i, resp in enumerate(resps):
        queued = await ing.redis.exists(ing.keys.request(f"b-{i}"))
        assert queued == (resp.status_code == 504)
        if resp.status_code != 429:
            continue
        assert resp.headers["retry-after"] == "2"
        err = resp.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("rate_limit_error", None, "overloaded")
        assert int(OVERLOADED.fullmatch(err["message"]).group(1)) >= 4
        assert set(resp.json()) == {"error"}


async def test_hopeless_prompt_is_refused_before_tokenizing(harness):
    factory, _worker = harness
    app = factory(max_prompt_tokens=8192)  # as the model's context (the injected tokenizer's
    text = "word " * 780_000  # is unknown): 3.9 MB is more characters than 8192 tokens hold
    async with http(app) as client:
        for path, body, param in (
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": text}]},
                "messages",
            ),  # noqa: E501
            ("/v1/completions", {"model": MODEL, "prompt": text}, "prompt"),
        ):
            resp = await client.post(path, json=body)
            err = resp.json()["error"]
            assert resp.status_code == 400
            assert (err["type"], err["param"], err["code"]) == (
                "invalid_request_error",
                param,
                "context_length_exceeded",
            )
            assert err["message"] == (
                f"'{param}' has 3900000 characters: more than 8192 tokens (the longest prompt "
                "accepted here) can hold, at 81 characters per token at most. Please reduce the "
                f"length of the {param}."
            )


async def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(harness):
    factory, _worker = harness
    app = factory()
    # Under the character bound, so it is tokenized (~160k tokens), then refused by its length.
    text = "hello world, this is a test. " * 20_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    async with http(app) as client:
        await client.get("/health")  # connections and snapshots warm
        big = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        answered = 0  # /health answers given while the long prompt was still being worked on
        while not big.done() and answered < HEALTH_ANSWERS:
            resp = await client.get("/health")
            assert resp.status_code == 503  # no workers; but it answers
            answered += not big.done()
        resp = await big
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    assert err["message"].startswith("the prompt has 160031 tokens")
    # Tokenizing while holding the GIL froze the event loop: /health answered ~10 times, all
    # before the tokenizer started, and then waited for it.
    assert answered == HEALTH_ANSWERS


async def test_unknown_and_unsupported_fields_are_refused(harness):
    factory, _worker = harness
    app = factory()
    chat = ("/v1/chat/completions", {"model": MODEL, "messages": HI})
    text = ("/v1/completions", {"model": MODEL, "prompt": "Hi"})
    unknown = "unknown_parameter"
    cases = [  # (endpoint, field, value, code)
        *((ep, "guided_json", {"type": "object"}, unknown) for ep in (chat, text)),
        # served under --scheduling-policy priority only (vLLM refuses it the same way)
        *((ep, "priority", 5, "unsupported_value") for ep in (chat, text)),
        *((ep, "lora_request", {"lora_name": "x"}, unknown) for ep in (chat, text)),
        *((ep, "functions", [{"name": "f"}], "unsupported_value") for ep in (chat, text)),
        (chat, "modalities", ["text", "audio"], "unsupported_value"),
        (text, "modalities", ["text"], unknown),  # a chat field
        (chat, "store", True, "unsupported_value"),
        (text, "max_completion_tokens", 4, unknown),  # a chat field
    ]
    async with http(app) as client:
        for (path, base), name, value, code in cases:
            resp = await client.post(path, json={**base, name: value})
            assert resp.status_code == 400, (path, name)
            err = resp.json()["error"]
            assert (err["type"], err["param"], err["code"]) == (
                "invalid_request_error",
                name,
                code,
            ), (path, name)
        resp = await client.post(text[0], json={**text[1], "guided_json": {}})
        assert resp.json()["error"]["message"] == (
            "Unrecognized request argument supplied: guided_json (this server does not "
            "implement it)"
        )
        resp = await client.post(chat[0], json={**chat[1], "functions": []})
        assert resp.json()["error"]["message"] == (
            "functions (legacy function calling) is not supported by this server"
        )
        ing = app.state.ingress
        assert not await ing.redis.exists(ing.keys.decode_stream)  # nothing was queued


def test_pass_through_and_extension_fields_are_accepted():
    chat = parse_chat(
        {
            "model": MODEL,
            "messages": HI,
            "user": "u1",
            "stream": True,
            "stream_options": {"include_usage": True},
            "metadata": {"team": "a"},
            "store": False,
            "service_tier": "auto",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "parallel_tool_calls": True,
            "modalities": ["text"],
            "guided_json": None,  # null asks for nothing
            "ignore_eos": True,
            "min_tokens": 7,
        }
    )
    assert (chat.user, chat.include_usage) == ("u1", True)
    assert (chat.sampling.ignore_eos, chat.sampling.min_tokens) == (True, 7)
    text = parse_completion(
        {"model": MODEL, "prompt": "Hi", "metadata": {}, "min_tokens": 2, "ignore_eos": True}
    )
    assert (text.prompt, text.sampling.min_tokens, text.sampling.ignore_eos) == ("Hi", 2, True)


async def test_deadline_answers_at_the_deadline(harness, fake_clock):
    factory, _worker = harness
    app = factory(request_timeout_s=1.0)
    ing = app.state.ingress
    # the deadline is set and waited for on one clock that moves only as the reader waits
    fake_clock.install(submit_module, subscription_module)
    async with http(app) as client:
        for rid, stream in (("dl-1", False), ("dl-2", True)):
            body = {"model": MODEL, "prompt": "Hi", "stream": stream}
            submitted = fake_clock.time()
            resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
            deadline = float(await ing.redis.hget(ing.keys.request(rid), "deadline"))
            if stream:
                events = parse_sse(resp.content)
                assert [e[1] for e in events[1:]] == ["[DONE]"]
                assert json.loads(events[0][1])["error"]["code"] == "request_timeout"
            else:
                assert (resp.status_code, resp.json()["error"]["code"]) == (504, "request_timeout")
            assert await cancel_flags(ing.redis, ing.keys, [rid]) == [True]
            # The reader used to wait 2 s past the deadline; now it answers at it.
            assert deadline == submitted + 1.0 == fake_clock.time()


def test_default_disconnect_grace_allows_a_resume():
    from kvrelay.pipeline.server.config import load_config

    assert IngressConfig().disconnect_grace_s == 10.0
    assert load_config({}).disconnect_grace_s == 10.0
