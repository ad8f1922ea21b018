"""Several models on one stack: each model's requests go to its own pipeline's streams (real
Valkey), a model whose workers are all gone answers 503 while others serve, and one model
keeps the keys of before."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.keys import Keys, check_pipeline, pipeline_name
from kvrelay.pipeline.model_registry import model_pipelines
from kvrelay.pipeline.server.app import create_app
from kvrelay.pipeline.server.config import IngressConfig
from tests.pipeline.ingress_support import MODEL, MODEL_INFO, WorkerRole, http, make_config

OTHER = "tiny-llama"


def test_a_pipeline_has_its_own_streams_and_consumers_and_shares_the_rest():
    keys = Keys("kvrelay:")
    b = keys.for_pipeline("b")
    assert (keys.prefill_stream, keys.decode_stream, keys.consumers) == (
        "{kvrelay}:stream:prefill",
        "{kvrelay}:stream:decode",
        "{kvrelay}:consumers",
    )  # a single-model stack's keys, unchanged
    assert (b.prefill_stream, b.decode_stream, b.consumers) == (
        "{kvrelay}:stream:prefill:b",
        "{kvrelay}:stream:decode:b",
        "{kvrelay}:consumers:b",
    )
    assert (b.request("r"), b.out("r"), b.progress, b.dlq, b.models) == (
        keys.request("r"), keys.out("r"), keys.progress, keys.dlq, keys.models,
    )  # fmt: skip
    sharded = Keys("kvrelay:", shards=3).for_pipeline("b")
    assert sharded.at(2).decode_stream == "{kvrelay.2}:stream:decode:b"
    assert sharded.of("req-1").pipeline == "b" and b.for_pipeline("") == keys
    assert keys.stream_pipeline("{kvrelay}:stream:decode:b") == ("decode", "b")
    assert keys.stream_pipeline("{kvrelay}:stream:prefill") == ("prefill", "")
    assert keys.stream_pipeline("{kvrelay}:dlq") is None
    assert keys.stream_pipeline("{other}:stream:decode") is None
    assert pipeline_name("Qwen/Qwen3 0.6B") == "qwen-qwen3-0.6b"
    with pytest.raises(ValueError, match="invalid pipeline name 'B:x'"):
        check_pipeline("B:x")


def test_the_first_model_keeps_the_unnamed_pipeline_each_other_gets_its_own(tmp_path):
    assert model_pipelines([MODEL, OTHER, "Big Model"]) == {
        MODEL: "", OTHER: OTHER, "Big Model": "big-model",
    }  # fmt: skip
    path = tmp_path / "Tiny"  # a path's model is served under its directory's name
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    assert model_pipelines([MODEL, str(path)]) == {MODEL: "", "Tiny": "tiny"}
    with pytest.raises(ValueError, match="would share pipeline 'a-b'"):
        model_pipelines([MODEL, "a b", "a-b"])
    with pytest.raises(ValueError, match="share pipeline"):
        IngressConfig(models=(MODEL, "a b", "a-b")).validate()


@pytest.fixture
async def two_models(valkey_session, smollm_tokenizer):
    """An ingress serving MODEL and OTHER, and a worker role on each model's pipeline."""
    config = make_config(valkey_session.url, models=(MODEL, OTHER), max_waiting=2)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer, OTHER: smollm_tokenizer})
    keys = app.state.ingress.keys
    first = await WorkerRole(valkey_session.url, keys).setup()
    other = await WorkerRole(valkey_session.url, keys.for_pipeline(OTHER)).setup()
    await first.publish_model()
    await other.publish_model(dict(MODEL_INFO, pipeline=OTHER), name=OTHER)
    yield app, first, other
    await app.state.ingress.aclose()
    await first.aclose()
    await other.aclose()


async def _complete(app, model: str):
    async with http(app) as client:
        return await client.post(
            "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}
        )


@pytest.mark.anyio
async def test_each_model_is_queued_on_its_own_pipeline(two_models):
    app, first, other = two_models
    ing = app.state.ingress
    await first.heartbeat("decode-0", "decode")
    await other.heartbeat("decode-b-0", "decode", model=OTHER)
    serve = asyncio.create_task(other.serve_one([(7, "B")]))
    resp = await _complete(app, OTHER)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "B" and resp.json()["model"] == OTHER
    taken = await serve
    assert taken.task.model == OTHER
    streams = ing.keys.for_pipeline(OTHER)
    assert await ing.redis.xlen(streams.decode_stream) == 1
    assert await ing.redis.xlen(ing.keys.decode_stream) == 0  # nothing on the first model's
    serve = asyncio.create_task(first.serve_one([(5, "A")]))
    resp = await _complete(app, MODEL)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "A"
    assert (await serve).task.model == MODEL
    assert await ing.redis.xlen(ing.keys.decode_stream) == 1
    # both pipelines' load counts for the ingress (backpressure)
    await ing.redis.xadd(streams.prefill_stream, {"m": b"x"})
    load = await ing.cluster.load(fresh=True)
    assert (load["prefill"].waiting, load["decode"].waiting) == (1, 0)


@pytest.mark.anyio
async def test_a_model_with_no_live_worker_answers_503_while_another_serves(two_models):
    app, first, other = two_models
    ing = app.state.ingress
    # no worker live at all (a stack starting or restarting): both models queue as before
    assert await ing.cluster.serving(MODEL) and await ing.cluster.serving(OTHER)
    await first.heartbeat("decode-0", "decode")
    assert not await ing.cluster.serving(OTHER)
    resp = await _complete(app, OTHER)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "service_unavailable",
        "model_unavailable",
        "model",
    )
    assert error["message"].startswith(f"The model `{OTHER}` has no live worker")
    assert await ing.redis.xlen(ing.keys.for_pipeline(OTHER).decode_stream) == 0
    # a model not served at all: 404 as before
    resp = await _complete(app, "nope")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    # its worker back (or draining ones only: nobody takes anything, so all wait alike)
    await other.heartbeat("decode-b-0", "decode", model=OTHER)
    assert await ing.cluster.serving(OTHER)
    await ing.redis.hset(first.keys.worker("decode-0"), "draining", "1")
    await ing.redis.hset(first.keys.worker("decode-b-0"), "draining", "1")
    assert await ing.cluster.serving(MODEL) and await ing.cluster.serving(OTHER)
    async with http(app) as client:
        health = (await client.get("/health")).json()
    assert health["models"] == {MODEL: {"decode": 1}, OTHER: {"decode": 1}}


@pytest.mark.anyio
async def test_the_pipeline_is_what_the_workers_publish(two_models):
    app, first, other = two_models
    registry = app.state.ingress.registry
    assert (await registry.get(OTHER)).pipeline == OTHER
    assert (await registry.get(MODEL)).pipeline == ""
    # the workers' word wins over the configured order (a hand-built stack)
    await other.publish_model(dict(MODEL_INFO, pipeline="elsewhere"), name=OTHER)
    await app.state.ingress.cluster.models(fresh=True)
    assert (await registry.get(OTHER)).pipeline == "elsewhere"
    published = json.loads(await first.r.hget(first.keys.models, OTHER))
    assert published["pipeline"] == "elsewhere"


@pytest.mark.anyio
async def test_the_waiting_bound_is_per_model(two_models):
    app, first, other = two_models
    ing = app.state.ingress
    await first.heartbeat("decode-0", "decode")
    await other.heartbeat("decode-b-0", "decode", model=OTHER)
    backlog = ing.keys.for_pipeline(OTHER).decode_stream
    for _ in range(2):  # OTHER's workers are behind: its bound (2) is reached
        await ing.redis.xadd(backlog, {"m": b"x"})
    await ing.cluster.load(fresh=True)
    resp = await _complete(app, OTHER)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "overloaded"
    serve = asyncio.create_task(first.serve_one([(5, "A")]))  # the first model is not held up
    resp = await _complete(app, MODEL)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "A"
    await serve
