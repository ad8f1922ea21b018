"""Ingress robustness: request ids in paths and headers, admission bursts, id conflicts,
X-Request-Id on every response, model retrieval, reattach delivery options, a hung Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time

import pytest

from tests.pipeline.ingress_support import MODEL, http, make_config, parse_sse

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 4}


def warnings(caplog) -> list[str]:
    """The warnings and errors logged since the last caplog.clear()."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _error(resp) -> tuple[int, str | None, str | None]:
    err = resp.json()["error"]
    return resp.status_code, err["code"], err["param"]


async def test_invalid_request_ids_give_400_and_no_id_header(harness):
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        for path in (
            "/v1/requests/%C3%A9%F0%9F%98%80",
            "/v1/requests/a%0d%0aSet-Cookie:%20x",
            "/v1/requests/a%0a",  # a trailing newline must not slip through a `$` anchor
            "/v1/requests/%0a/stream",
            "/v1/requests/" + "a" * 129,
        ):
            for method in ("GET", "DELETE") if not path.endswith("/stream") else ("GET",):
                resp = await client.request(method, path)
                assert _error(resp) == (400, "invalid_request_id", "request_id"), path
                assert "x-request-id" not in resp.headers
        for bad in ("bad id", "a" * 129, "é".encode()):
            resp = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad}
            )
            assert _error(resp) == (400, "invalid_request_id", "X-Request-Id")
            assert "x-request-id" not in resp.headers
        resp = await client.get("/v1/requests/ok-but-unknown")
        assert _error(resp) == (404, "request_not_found", "request_id")
        assert resp.headers["x-request-id"] == "ok-but-unknown"


async def test_every_response_carries_x_request_id(harness):
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        for method, path, status in (
            ("GET", "/health", 503),  # no decode worker
            ("GET", "/v1/models", 200),
            ("GET", "/metrics", 200),
            ("GET", "/nope", 404),
            ("PUT", "/v1/models", 405),
        ):
            resp = await client.request(method, path, headers={"X-Request-Id": "mine-1"})
            assert (resp.status_code, resp.headers["x-request-id"]) == (status, "mine-1"), path
            resp = await client.request(method, path)
            assert resp.headers["x-request-id"].startswith("req-"), path
            assert len(resp.headers["x-request-id"]) == 36
        resp = await client.put("/v1/models")
        assert _error(resp) == (405, "method_not_allowed", None)


async def test_retrieve_model(harness):
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        resp = await client.get(f"/v1/models/{MODEL}")
        assert resp.status_code == 200
        assert resp.json() == {
            "id": MODEL,
            "object": "model",
            "created": app.state.ingress.started,
            "owned_by": "kvrelay",
            "max_model_len": None,  # no worker has published it (injected tokenizer)
            "generation_defaults": {
                "temperature": 0.2,
                "top_p": 0.9,
                "top_k": 0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "max_tokens": None,
            },
        }
        resp = await client.get("/v1/models/org/gpt-17")
        assert _error(resp) == (404, "model_not_found", "model")
        assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_max_inflight_holds_for_a_burst(harness):
    factory, worker = harness
    app = factory(max_inflight=2, retry_after_s=3)
    role = await worker(app)
    ing = app.state.ingress
    async with http(app) as client:
        posts = [
            asyncio.create_task(
                client.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}"})
            )
            for i in range(8)
        ]
        end = time.monotonic() + 10
        while sum(t.done() for t in posts) < 6 and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # a seventh answer would show up now
        done = [t for t in posts if t.done()]
        refused = [t.result() for t in done]
        assert len(refused) == 6
        for resp in refused:
            assert _error(resp) == (429, "overloaded", None)
            assert resp.headers["retry-after"] == "3"
        assert ing.backpressure.inflight == 2
        for _ in range(2):
            await role.serve_one([(1, "a")])
        results = await asyncio.gather(*posts)
    assert sorted(r.status_code for r in results) == [200] * 2 + [429] * 6
    assert ing.backpressure.inflight == 0
    text = ing.metrics.render().decode()
    assert 'kvrelay:requests_rejected_total{status="429"} 6.0' in text


async def test_reposting_an_id_must_be_the_same_request(harness):
    factory, worker = harness
    app = factory(api_keys=("k1", "k2"))
    role = await worker(app)
    k1 = {"Authorization": "Bearer k1", "X-Request-Id": "same-1"}
    k2 = {"Authorization": "Bearer k2", "X-Request-Id": "same-1"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one([(19556, "Hello")], usage={"prompt_tokens": 31}))
        first = await client.post("/v1/chat/completions", json=CHAT, headers=k1)
        await serve
        assert first.status_code == 200
        for path, body, headers in (
            ("/v1/chat/completions", {**CHAT, "max_tokens": 5}, k1),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Ho"}]}, k1),
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}, k1),
            ("/v1/chat/completions", CHAT, k2),
        ):
            resp = await client.post(path, json=body, headers=headers)
            assert _error(resp) == (409, "duplicate_request_id", "X-Request-Id"), body
            assert resp.json()["error"]["type"] == "invalid_request_error"
            assert resp.headers["x-request-id"] == "same-1"
        again = await client.post("/v1/chat/completions", json=CHAT, headers=k1)
        assert again.status_code == 200
        assert again.json()["choices"] == first.json()["choices"]
        # the same request, now streamed without stream_options: no usage anywhere
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=k1)
        events = parse_sse(resp.content)
        assert [e[0] for e in events] == [None, "0", None]
        for _, data in events[:-1]:
            assert "usage" not in json.loads(data)
        resp = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            headers=k1,
        )
        events = parse_sse(resp.content)
        assert json.loads(events[-2][1])["usage"]["prompt_tokens"] == 31
        assert [json.loads(d)["usage"] for _, d in events[:-2]] == [None, None]


async def test_generation_failure_is_counted_as_rejected(harness):
    from kvrelay.core.messages import TokenChunk

    factory, worker = harness
    app = factory()
    role = await worker(app)

    async def fail() -> None:
        taken = await role.take()
        chunk = TokenChunk(index=0, finish_reason="error", error="boom")
        await role.emit(taken.task.request_id, chunk)
        await role.finish(taken, status="failed")

    async with http(app) as client:
        serve = asyncio.create_task(fail())
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        await serve
    assert _error(resp) == (500, "generation_failed", None)
    text = app.state.ingress.metrics.render().decode()
    assert 'kvrelay:requests_rejected_total{status="500"} 1.0' in text


async def test_a_hung_redis_gives_503_within_seconds(valkey, smollm_tokenizer, caplog):
    from kvrelay.pipeline.server.app import create_app

    config = make_config(valkey.url, redis_timeout_s=1.0)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    # every read is bounded by the socket timeout: 1 s more than the longest XREAD BLOCK
    timeout_s = app.state.ingress.redis.connection_pool.connection_kwargs["socket_timeout"]
    assert timeout_s == config.redis_socket_timeout_s == 1.0 + config.read_block_ms / 1000
    timed_out = f"Timeout reading from 127.0.0.1:{valkey.port}"
    try:
        async with http(app) as client:
            assert (await client.get("/health")).status_code == 503  # up, but no worker
            os.kill(valkey.proc.pid, signal.SIGSTOP)
            try:
                for method, path, body, code in (
                    ("GET", "/health", None, None),
                    ("POST", "/v1/chat/completions", CHAT, "queue_unavailable"),
                    ("GET", "/v1/requests/r-1", None, "queue_unavailable"),
                    ("GET", "/v1/requests/r-1/stream", None, "queue_unavailable"),
                ):
                    caplog.clear()
                    resp = await client.request(method, path, json=body)
                    assert resp.status_code == 503, path
                    # the 503 is that one read timing out: no retry, no waiting the outage out
                    if code:
                        assert resp.json()["error"]["code"] == code
                        assert warnings(caplog) == [f"redis unavailable: {timed_out}"], path
                    else:
                        assert (resp.json()["redis"], resp.json()["error"]) == (False, timed_out)
                        assert warnings(caplog) == []
            finally:
                os.kill(valkey.proc.pid, signal.SIGCONT)
            assert (await client.get("/health")).json()["redis"] is True
    finally:
        await app.state.ingress.aclose()


async def test_an_unexpected_error_is_an_openai_500_with_a_request_id(harness, monkeypatch):
    from kvrelay.pipeline.server.info import InfoApi

    async def broken(self, request):
        raise RuntimeError("a bug in an endpoint")

    monkeypatch.setattr(InfoApi, "metrics", broken)  # before the app binds its routes
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        resp = await client.get("/metrics", headers={"X-Request-Id": "oops-1"})
    assert resp.status_code == 500
    assert resp.headers["x-request-id"] == "oops-1"
    assert resp.json() == {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


async def test_openapi_lists_every_route_the_app_serves(harness):
    """The document and the route table cannot drift: same paths, same methods, and every
    path parameter declared (generated clients reach /v1/requests/{id}/stream too)."""
    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        doc = (await client.get("/openapi.json")).json()
    served: dict[str, set[str]] = {}
    for route in app.routes:
        path = re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path)  # {model_id:path} -> {model_id}
        served.setdefault(path, set()).update(m.lower() for m in route.methods - {"HEAD"})
    assert {path: set(ops) for path, ops in doc["paths"].items()} == served
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"\{(\w+)\}", path)), (path, method)
    resume = doc["paths"]["/v1/requests/{request_id}/stream"]["get"]
    assert list(resume["responses"]["200"]["content"]) == ["text/event-stream"]
    assert [(p["name"], p["in"]) for p in resume["parameters"]] == [
        ("request_id", "path"),
        ("Last-Event-ID", "header"),
        ("last_event_id", "query"),
    ]


async def test_metrics_have_no_created_series(harness):
    """No `*_created` timestamps (as vLLM), from the ingress nor from a worker's registry."""
    from kvrelay.workers.metrics import WorkerMetrics

    factory, _worker = harness
    app = factory()
    async with http(app) as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
        text = (await client.get("/metrics")).text
    assert 'kvrelay:requests_rejected_total{status="400"} 1.0' in text
    assert "_created" not in text
    worker = WorkerMetrics(MODEL)
    worker.store_io("load", 2, 4096)
    worker.finished(prompt_tokens=7, cached_tokens=4)
    text = worker.base.render().decode()
    assert f'kvrelay:kv_store_pages_total{{model_name="{MODEL}",op="load"}} 2.0' in text
    assert "_created" not in text
