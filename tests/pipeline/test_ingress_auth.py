"""API keys: enforcement, configuration, and requests visible only to the key that made them."""

from __future__ import annotations

import asyncio

import pytest

from tests.pipeline.ingress_support import MODEL, http

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]


def err(message, param=None, code=None, type_="invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def test_api_keys(harness):
    factory, _ = harness
    app = factory(api_keys=("k1", "k2"))
    body = {"model": MODEL, "messages": HI, "n": 0}  # a 400 once authenticated
    async with http(app) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "missing_api_key"
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert (resp.status_code, resp.json()) == (
            401,
            err("Incorrect API key provided.", code="invalid_api_key"),
        )
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k2"}
        )
        assert resp.status_code == 400
        assert (await client.get("/v1/models")).status_code == 401
        assert (
            await client.get("/v1/models", headers={"Authorization": "Bearer k1"})
        ).status_code == 200
        assert (await client.get("/health")).status_code == 503  # open, no workers
        assert (await client.get("/metrics")).status_code == 200


async def test_requests_belong_to_their_api_key(harness):
    factory, worker = harness
    app = factory(api_keys=("k1", "k2"))
    role = await worker(app)
    k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    async with http(app) as client:
        serve = asyncio.create_task(role.serve_one([(1, "a")]))
        resp = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={**k1, "X-Request-Id": "own-1"},
        )
        await serve
        assert resp.status_code == 200
        assert (await client.get("/v1/requests/own-1", headers=k1)).status_code == 200
        for method in ("GET", "DELETE"):
            resp = await client.request(method, "/v1/requests/own-1", headers=k2)
            assert resp.status_code == 404
        resp = await client.get("/v1/requests/own-1/stream", headers=k2)
        assert resp.json()["error"]["code"] == "request_not_found"
        resp = await client.get("/v1/requests/own-1/stream", headers=k1)
        assert resp.text.endswith("data: [DONE]\n\n")


async def test_api_keys_from_environment(monkeypatch):
    from kvrelay.pipeline.server.config import load_config

    monkeypatch.setenv("KVRELAY_API_KEYS", "a,b")
    monkeypatch.setenv("KVRELAY_INGRESS_MODE", "colocated")
    cfg = load_config()
    assert cfg.api_keys == ("a", "b") and cfg.mode == "colocated"
    monkeypatch.setenv("KVRELAY_INGRESS_API_KEYS", "c")
    assert load_config().api_keys == ("c",)
    assert load_config(api_keys=("d",)).api_keys == ("d",)
