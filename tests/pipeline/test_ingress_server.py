"""The ingress behind a real uvicorn server: the official openai client, and client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys

import httpx
import openai
import pytest
import uvicorn

from kvrelay.pipeline.server.app import create_app
from tests.conftest import free_port
from tests.pipeline.ingress_support import MODEL, WorkerRole, make_config
from tests.pipeline.queue_sim import cancel_flags

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
USAGE = {"prompt_tokens": 31, "completion_tokens": 2, "cached_tokens": 16}


@contextlib.asynccontextmanager
async def serving(valkey_url: str, tokenizer, **overrides):
    """(base url, app, worker role) with uvicorn serving the app on a free port."""
    port = free_port()
    app = create_app(make_config(valkey_url, **overrides), tokenizers={MODEL: tokenizer})
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,  # a test that failed mid-request must not hang here
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
        assert not task.done(), "uvicorn failed to start"
    role = await WorkerRole(valkey_url, app.state.ingress.keys).setup()
    try:
        yield f"http://127.0.0.1:{port}", app, role
    finally:
        server.should_exit = True
        await task
        await role.aclose()


async def test_openai_client_stream_and_whole(valkey_session, smollm_tokenizer):
    async with serving(valkey_session.url, smollm_tokenizer, api_keys=("sk-test",)) as (
        base,
        _app,
        role,
    ):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
        serve = asyncio.create_task(
            role.serve_one([(19556, "Hello"), (905, " world")], usage=USAGE)
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            seed=3,
            temperature=0.5,
        )
        chunks = [c async for c in stream]
        taken = await serve
        assert taken.task.sampling.seed == 3 and taken.task.sampling.max_tokens == 4
        assert [c.choices[0].delta.content for c in chunks[:-1]] == ["", "Hello", " world"]
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, "stop"]
        assert chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens == 31
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
        assert {c.id for c in chunks} == {taken.task.request_id}

        serve = asyncio.create_task(role.serve_one([(905, " world")], finish_reason="length"))
        done = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        await serve
        assert done.choices[0].text == " world" and done.choices[0].finish_reason == "length"
        assert done.usage.completion_tokens == 1

        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="nope", messages=HI)
        assert info.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=HI, n=17)
        assert info.value.param == "n"
        bad_key = openai.AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad_key.models.list()
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-17")
        assert missing.value.code == "model_not_found"
        await client.close()
        await bad_key.close()


async def _wait_cancel(app, request_id: str) -> bool:
    ing = app.state.ingress
    for _ in range(250):  # up to 5 s on a busy machine
        if await cancel_flags(ing.redis, ing.keys, [request_id]) == [True]:
            return True
        await asyncio.sleep(0.02)
    return False


async def _wait_metric(app, line: str) -> str:
    """The rendered metrics once they hold `line` (the count lands after the cancel key)."""
    text = ""
    for _ in range(250):  # up to 5 s on a busy machine
        text = app.state.ingress.metrics.render().decode()
        if line in text:
            break
        await asyncio.sleep(0.02)
    return text


async def test_disconnect_cancels_the_request(valkey_session, smollm_tokenizer):
    from kvrelay.core.messages import TokenChunk

    async with (  # grace 0: cancelled at once (the default grace is in test_ingress_hardening)
        serving(valkey_session.url, smollm_tokenizer, disconnect_grace_s=0) as (base, app, role),
        httpx.AsyncClient(base_url=base) as http,
    ):
        # streaming, gone after the first token
        async with http.stream(
            "POST",
            "/v1/completions",
            headers={"X-Request-Id": "d-1"},
            json={"model": MODEL, "prompt": "Hi", "stream": True},
        ) as r:
            await role.take()
            await role.emit("d-1", TokenChunk(index=0, token_ids=[1], text="a"))
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        assert await _wait_cancel(app, "d-1")
        # not streaming, gone while waiting for the first token (nothing written yet)
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                "/v1/completions",
                headers={"X-Request-Id": "d-2"},
                json={"model": MODEL, "prompt": "Hi"},
                timeout=0.5,
            )
        assert await _wait_cancel(app, "d-2")
        label = f'finished_reason="cancelled",model_name="{MODEL}"'
        line = f"kvrelay:request_success_total{{{label}}} 2.0"
        assert line in await _wait_metric(app, line)
        ing = app.state.ingress
        assert await cancel_flags(ing.redis, ing.keys, ["d-3"]) != [True]


async def test_disconnect_grace_lets_a_client_come_back(valkey_session, smollm_tokenizer):
    from kvrelay.core.messages import TokenChunk

    async with serving(valkey_session.url, smollm_tokenizer, disconnect_grace_s=0.5) as (
        base,
        app,
        role,
    ):
        ing = app.state.ingress
        async with httpx.AsyncClient(base_url=base) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/completions",
                    headers={"X-Request-Id": "g-1"},
                    json={"model": MODEL, "prompt": "Hi"},
                    timeout=0.3,
                )
            taken = await role.take()
            back = asyncio.create_task(
                http.post(  # the same request again: reattaches
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "Hi"},
                    headers={"X-Request-Id": "g-1"},
                )
            )
            await asyncio.sleep(0.8)  # past the grace period
            assert await cancel_flags(ing.redis, ing.keys, ["g-1"]) == [False]
            await role.emit(
                "g-1", TokenChunk(index=0, token_ids=[1], text="a", finish_reason="stop")
            )
            await role.finish(taken)
            assert (await back).json()["choices"][0]["text"] == "a"
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/completions",
                    headers={"X-Request-Id": "g-2"},
                    json={"model": MODEL, "prompt": "Hi"},
                    timeout=0.3,
                )
            assert await _wait_cancel(app, "g-2")


async def test_a_client_gone_mid_body_is_a_quiet_499(valkey_session, smollm_tokenizer, caplog):
    """A chunked upload cut off: no traceback, no 5xx; counted as nginx's 499."""
    caplog.set_level(logging.DEBUG)
    uvicorn_log = logging.getLogger("uvicorn")  # does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    try:
        async with serving(valkey_session.url, smollm_tokenizer) as (base, app, _role):
            port = int(base.rsplit(":", 1)[1])
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            part = b'{"model": "%s", "prompt": "' % MODEL.encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: ingress\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                b"X-Request-Id: cut-1\r\n\r\n" + b"%x\r\n%s\r\n" % (len(part), part)
            )
            await writer.drain()
            writer.close()  # the rest of the body never comes
            await writer.wait_closed()
            for _ in range(250):  # until the ingress has counted it (under any status)
                text = app.state.ingress.metrics.render().decode()
                if "kvrelay:requests_rejected_total{" in text:
                    break
                await asyncio.sleep(0.02)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert 'kvrelay:requests_rejected_total{status="499"} 1.0' in text
    assert 'status="500"' not in text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not [r for r in caplog.records if r.exc_info]
    assert "request cut-1: client disconnected while sending its body" in caplog.messages


def test_ingress_does_not_import_torch():
    code = (
        "import kvrelay.pipeline.server.app, kvrelay.pipeline.client.producer, kvrelay.cli.serve,"
        " sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_stalled_body_gets_408_and_its_connection_closed(
    valkey_session, smollm_tokenizer, fake_clock, caplog, monkeypatch
):
    """Issue 46: a chunk of 5 MB declared, 1 KB sent, then nothing: held open forever before.
    Now each body read waits `body_timeout_s` (30 s by default; on the fake clock here)."""
    import time

    from kvrelay.pipeline.server import middleware

    monkeypatch.setattr(middleware, "time", time, raising=False)  # it waits on asyncio only
    clock = fake_clock.install(middleware)
    caplog.set_level(logging.INFO, logger=middleware.__name__)
    async with serving(valkey_session.url, smollm_tokenizer) as (base, app, _role):
        port = int(base.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        part = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * 1000
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: ingress\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"X-Request-Id: stall-1\r\n\r\n" + b"%x\r\n" % (5 << 20) + part
        )
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 60)  # to the end: the ingress closes it
        writer.close()
        text = app.state.ingress.metrics.render().decode()
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *headers = head.decode().split("\r\n")
    headers = dict(h.lower().split(": ", 1) for h in headers)
    assert status == "HTTP/1.1 408 Request Timeout"
    assert (headers["connection"], headers["x-request-id"]) == ("close", "stall-1")
    assert json.loads(body) == {
        "error": {
            "message": "the request body stopped arriving: no data for 30 s",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_body_timeout",
        }
    }
    assert clock.slept == [30.0]  # one read waited the whole default timeout
    assert 'kvrelay:requests_rejected_total{status="408"} 1.0' in text
    assert any(m.endswith("no request body data for 30 s: 408") for m in caplog.messages)
