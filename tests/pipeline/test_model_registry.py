"""Producers on a host without the model: they tokenize with the files a worker publishes.

Each test points KVRELAY_CACHE_DIR at an empty directory, as on another host: the model is
not prepared there, so the only way to serve a request is the copy in Valkey.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvrelay.core import modelref
from kvrelay.core.keys import Keys
from kvrelay.core.model_bundle import ModelBundle
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient, Client
from kvrelay.pipeline.errors import RequestError
from kvrelay.pipeline.server.app import create_app
from kvrelay.workers.publication import ModelPublication
from tests.pipeline.ingress_support import (
    MODEL,
    MODEL_INFO,
    WorkerRole,
    http,
    make_config,
    unique_prefix,
)

CHAT = [
    {"role": "system", "content": "Réponds brièvement."},
    {"role": "user", "content": "Grüße 👋, 世界! What is 2+2?"},
]
TEXT = "Once upon a time,\n\tin 東京 <|im_end|>"
NOT_READY = (
    f"model '{MODEL}' is not ready: no worker serving it has published its files yet. Start one "
    f"(`kvrelay worker decode --model {MODEL}`, or `kvrelay up`): a worker publishes the "
    "tokenizer and limits producers need, on any host"
)


@pytest.fixture
def model_dir(smollm_tokenizer):
    """The converted model directory on the worker's host (the default cache)."""
    return modelref.converted_dir(modelref.resolve_model(MODEL))


@pytest.fixture
def other_host(tmp_path, monkeypatch):
    """An empty KVRELAY_CACHE_DIR: the model is not prepared here."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(cache))
    assert not modelref.is_prepared(modelref.resolve_model(MODEL))
    return cache


def publish(url: str, prefix: str, model_dir) -> str:
    """What a worker's heartbeat does; returns the files' digest."""
    publication = ModelPublication.from_dir(MODEL, model_dir, PublishedModel(**MODEL_INFO))
    r = redis.Redis.from_url(url)
    try:
        publication.publish(r, Keys(prefix))
    finally:
        r.close()
    assert publication.entry.files is not None
    return publication.entry.files


@pytest.mark.anyio
async def test_client_on_another_host_tokenizes_like_the_worker(
    valkey_session, smollm_tokenizer, model_dir, other_host
):
    prefix = unique_prefix()
    digest = publish(valkey_session.url, prefix, model_dir)
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(valkey_session.url, key_prefix=prefix)  # no model files, no tokenizer
    try:
        await client.submit(messages=CHAT, request_id="chat-1")
        chat = (await role.take()).task
        await client.submit(TEXT, request_id="text-1", sampling={"temperature": 0})
        text = (await role.take()).task
        await client.submit("Hello", request_id="hello-1")
        hello = (await role.take()).task
    finally:
        await client.aclose()
        await role.aclose()
    assert chat.prompt_token_ids == smollm_tokenizer.apply_chat_template(CHAT)
    assert text.prompt_token_ids == smollm_tokenizer.encode(TEXT, add_special_tokens=True)
    assert text.prompt_token_ids[-1] == 2  # the special token is one id, as locally
    assert hello.prompt_token_ids == [19556]
    # the published numbers and the model's defaults came along
    n = len(chat.prompt_token_ids)
    assert chat.sampling == SamplingParams(
        max_tokens=min(4096, 8192 - n), temperature=0.2, top_p=0.9
    )
    assert text.sampling == SamplingParams(
        max_tokens=min(4096, 8192 - len(text.prompt_token_ids)), temperature=0.0, top_p=0.9
    )
    # kept for the next process on this host, under its own cache directory
    kept = other_host / "model-files" / digest
    assert sorted(p.name for p in kept.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert ModelBundle.from_dir(kept).digest == digest


@pytest.mark.anyio
async def test_before_any_worker_publishes_503_then_it_works(
    valkey_session, smollm_tokenizer, model_dir, other_host
):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(valkey_session.url, key_prefix=prefix)
    try:
        with pytest.raises(RequestError) as info:
            await client.submit(messages=CHAT)
        err = info.value
        assert (err.status, err.code, err.type, err.message) == (
            503,
            "model_not_ready",
            "service_unavailable",
            NOT_READY,
        )
        with pytest.raises(RequestError) as info:
            await client.submit("x", model="gpt-17")
        assert (info.value.status, info.value.code) == (404, "model_not_found")
        # a worker starts: the same client serves without a restart
        publish(valkey_session.url, prefix, model_dir)
        await asyncio.sleep(0.3)  # the models snapshot is refreshed every 0.25 s
        await client.submit(messages=CHAT, request_id="after")
        task = (await role.take()).task
        assert task.prompt_token_ids == smollm_tokenizer.apply_chat_template(CHAT)
    finally:
        await client.aclose()
        await role.aclose()


def test_files_are_fetched_once_and_kept_on_disk(
    valkey_session, smollm_tokenizer, model_dir, other_host, tmp_path, monkeypatch
):
    prefix = unique_prefix()
    digest = publish(valkey_session.url, prefix, model_dir)
    r = redis.Redis.from_url(valkey_session.url)
    try:
        with Client(valkey_session.url, key_prefix=prefix) as client:
            client.submit("Hello", request_id="first")
            r.delete(Keys(prefix).model_files(digest))  # fetched: no longer needed from Valkey
            client.submit("Hello again", request_id="second")
        # a new process on this host reads the copy it kept
        with Client(valkey_session.url, key_prefix=prefix) as client:
            client.submit("Hello", request_id="third")
        # a host without that copy needs the workers to publish the files again
        monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "another-cache"))
        with Client(valkey_session.url, key_prefix=prefix) as client:
            with pytest.raises(RequestError) as info:
                client.submit("Hello", request_id="fourth")
            assert (info.value.status, info.value.message) == (503, NOT_READY)
        assert r.exists(Keys(prefix).request("third")) and not r.exists(
            Keys(prefix).request("fourth")
        )
    finally:
        r.close()


def test_corrupt_published_files_are_refused(valkey_session, model_dir, other_host):
    prefix = unique_prefix()
    digest = publish(valkey_session.url, prefix, model_dir)
    r = redis.Redis.from_url(valkey_session.url)
    try:
        r.hset(Keys(prefix).model_files(digest), "config.json", b"{}")
        with (
            Client(valkey_session.url, key_prefix=prefix) as client,
            pytest.raises(RequestError) as info,
        ):
            client.submit("Hello")
        assert (info.value.status, info.value.message) == (503, NOT_READY)
        assert not (other_host / "model-files" / digest).exists()
    finally:
        r.close()


@pytest.mark.anyio
async def test_ingress_on_another_host_serves_with_published_files(
    valkey_session, smollm_tokenizer, model_dir, other_host
):
    config = make_config(valkey_session.url)
    app = create_app(config)  # no injected tokenizer: only what the host or Valkey has
    ing = app.state.ingress
    role = await WorkerRole(valkey_session.url, ing.keys).setup()
    try:
        async with http(app) as api:
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 3}
            resp = await api.post("/v1/chat/completions", json=body)
            assert resp.status_code == 503
            assert resp.json()["error"] == {
                "message": NOT_READY,
                "type": "service_unavailable",
                "param": None,
                "code": "model_not_ready",
            }
            publish(valkey_session.url, config.key_prefix, model_dir)
            serve = asyncio.create_task(role.serve_one([(19556, "Hello")]))
            resp = await api.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200
            task = (await serve).task
            assert task.prompt_token_ids == smollm_tokenizer.apply_chat_template(CHAT)
            models = (await api.get("/v1/models")).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 8192)]
    finally:
        await ing.aclose()
        await role.aclose()


@pytest.mark.anyio
async def test_a_model_no_worker_published_for_a_week_is_not_listed(valkey_session):
    import json
    import time

    import redis.asyncio as aioredis

    from kvrelay.core.model_bundle import PUBLICATION_TTL_S
    from kvrelay.pipeline.queue.cluster import ClusterState

    keys = Keys("stale-models:")
    r = aioredis.from_url(valkey_session.url)
    now = time.time()
    await r.hset(keys.models, mapping={
        "fresh": json.dumps({"page_size": 16, "published": now - 60}),
        "stale": json.dumps({"page_size": 16, "published": now - PUBLICATION_TTL_S - 60}),
        "unstamped": json.dumps({"page_size": 16}),  # a worker from before `published`
    })  # fmt: skip
    cluster = ClusterState(r, keys)
    try:
        assert sorted(await cluster.models(fresh=True)) == ["fresh", "unstamped"]
    finally:
        cluster.close()
        await r.aclose()


# what `kvrelay up --chat-template` gives the workers: tools and documents unread
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@pytest.mark.anyio
async def test_workers_template_and_aliases_win_over_the_files_on_this_host(
    valkey_session, smollm_tokenizer, model_dir
):
    prefix = unique_prefix()
    publication = ModelPublication.from_dir(
        MODEL,
        model_dir,
        PublishedModel(**MODEL_INFO, aliases=("smol", "smol-chat")),
        chat_template=TEMPLATE,
    )
    assert publication.entry.files != ModelBundle.from_dir(model_dir).digest
    r = redis.Redis.from_url(valkey_session.url)
    try:
        publication.publish(r, Keys(prefix))
    finally:
        r.close()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    # the model is prepared on this host, but its files lack the workers' --chat-template
    client = AsyncClient(valkey_session.url, key_prefix=prefix)
    try:
        await client.submit(messages=CHAT, request_id="tpl-1", model="smol-chat")
        task = (await role.take()).task
        assert await client.registry.served() == [MODEL, "smol", "smol-chat"]
    finally:
        await client.aclose()
        await role.aclose()
    rendered = "<system>Réponds brièvement.<user>Grüße 👋, 世界! What is 2+2?<assistant>"
    assert task.prompt_token_ids == smollm_tokenizer.encode(rendered)
    assert task.model == MODEL  # queued under the model's first name
