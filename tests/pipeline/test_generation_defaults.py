"""Sampling fields a request leaves out: request > operator override > model defaults > OpenAI's.

The same request gets the same parameters over HTTP (chat and completions) and through the
producer client; /v1/models shows the defaults (the commands' flag: tests/cli/
test_generation_override.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.core.keys import Keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.errors import RequestError
from tests.pipeline.ingress_support import MODEL, MODEL_INFO, WorkerRole, http, unique_prefix

HI = [{"role": "user", "content": "Hi"}]
OVERRIDE = {"temperature": 0.5, "top_k": 40, "max_new_tokens": 32}
# what a worker publishes: the model's defaults under its own override
PUBLISHED = {**MODEL_INFO, "generation_defaults": {"temperature": 0.3, "repetition_penalty": 1.1}}


async def _post(app, role, path: str, body: dict, **headers) -> SamplingParams:
    """POST `body`; the sampling of the task the worker gets."""
    serve = asyncio.create_task(role.serve_one([(19556, "Hello")]))
    async with http(app) as api:
        resp = await api.post(path, json={"model": MODEL, **body}, headers=headers)
    assert resp.status_code == 200, resp.text
    return (await serve).task.sampling


async def _submit(client: AsyncClient, role: WorkerRole, **kwargs) -> SamplingParams:
    await client.submit(**kwargs)
    taken = await role.take()
    await role.finish(taken)
    return taken.task.sampling


@pytest.mark.anyio
async def test_fields_left_out_take_the_model_defaults(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    await role.publish_model()  # numbers only, as a worker before issue #18 did
    n = len(smollm_tokenizer.apply_chat_template(HI))
    chat = await _post(app, role, "/v1/chat/completions", {"messages": HI})
    # kvrelay's table for SmolLM2-Instruct (its model card); max_tokens: the context left
    assert chat == SamplingParams(max_tokens=min(4096, 8192 - n), temperature=0.2, top_p=0.9)
    text = await _post(app, role, "/v1/completions", {"prompt": "Hello"})
    assert text == SamplingParams(max_tokens=4096, temperature=0.2, top_p=0.9)
    given = {"temperature": 1.0, "top_p": 1.0, "top_k": 5, "max_completion_tokens": 7}
    chat = await _post(app, role, "/v1/chat/completions", {"messages": HI, **given})
    assert chat == SamplingParams(max_tokens=7, temperature=1.0, top_p=1.0, top_k=5)


@pytest.mark.anyio
async def test_override_and_published_defaults_same_over_http_and_client(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory(override_generation_config=json.dumps(OVERRIDE))
    role = await worker(app)
    await role.publish_model(PUBLISHED)
    ing = app.state.ingress
    expected = SamplingParams(max_tokens=32, temperature=0.5, top_k=40, repetition_penalty=1.1)
    asked = SamplingParams(max_tokens=10, temperature=0.9, seed=4)
    http_runs = [
        await _post(app, role, "/v1/chat/completions", {"messages": HI}),
        await _post(app, role, "/v1/completions", {"prompt": "Hello"}),
        await _post(
            app,
            role,
            "/v1/chat/completions",
            {"messages": HI, "temperature": 0.9, "seed": 4, "max_tokens": 10},
        ),
    ]
    given = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, repetition_penalty=1.1, seed=4)
    assert http_runs == [expected, expected, given]

    client = AsyncClient(
        ing.config.redis_url,
        key_prefix=ing.config.key_prefix,
        tokenizers={MODEL: smollm_tokenizer},
        override_generation_config=OVERRIDE,
    )
    try:
        client_runs = [
            await _submit(client, role, messages=HI),
            await _submit(client, role, prompt="Hello"),
            await _submit(client, role, messages=HI, sampling=asked),
            await _submit(
                client,
                role,
                messages=HI,
                sampling={"temperature": 0.9, "seed": 4, "max_tokens": 10},
            ),
        ]
    finally:
        await client.aclose()
    assert client_runs == [*http_runs, http_runs[2]]

    async with http(app) as api:
        listed = (await api.get("/v1/models")).json()
        one = (await api.get(f"/v1/models/{MODEL}")).json()
    assert listed == {"object": "list", "data": [one]}
    assert one == {
        "id": MODEL,
        "object": "model",
        "created": ing.started,
        "owned_by": "kvrelay",
        "max_model_len": 8192,
        "generation_defaults": {
            "temperature": 0.5,
            "top_p": 1.0,  # the published layer (the worker's view of the model) has none
            "top_k": 40,
            "min_p": 0.0,
            "repetition_penalty": 1.1,
            "max_tokens": 32,
        },
    }


@pytest.mark.anyio
async def test_client_sampling_params_at_class_defaults_count_as_left_out(
    valkey_session, smollm_tokenizer
):
    prefix = unique_prefix()
    role = await WorkerRole(valkey_session.url, Keys(prefix)).setup()
    client = AsyncClient(
        valkey_session.url, key_prefix=prefix, tokenizers={MODEL: smollm_tokenizer}
    )
    try:
        left_out = await _submit(client, role, prompt="Hello", sampling=SamplingParams(seed=1))
        at_default = await _submit(
            client, role, prompt="Hello", sampling=SamplingParams(temperature=1.0, seed=1)
        )
        pinned = await _submit(client, role, prompt="Hello", sampling={"temperature": 1.0})
        nothing = await _submit(client, role, prompt="Hello")
    finally:
        await client.aclose()
        await role.aclose()
    model = SamplingParams(max_tokens=4096, temperature=0.2, top_p=0.9, seed=1)
    assert (left_out, at_default) == (model, model)
    assert pinned == SamplingParams(max_tokens=4096, temperature=1.0, top_p=0.9)
    # no sampling at all: as an HTTP body without sampling fields (was max_tokens 16, T=1.0)
    assert nothing == SamplingParams(max_tokens=4096, temperature=0.2, top_p=0.9)


@pytest.mark.anyio
async def test_leaving_a_field_out_is_another_request_than_giving_its_default(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    first = asyncio.create_task(
        _post(app, role, "/v1/completions", {"prompt": "Hi"}, **{"X-Request-Id": "same-id"})
    )
    await asyncio.sleep(0.5)  # queued and taken by the worker role (which answers it)
    async with http(app) as api:
        again = await api.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "temperature": 1.0},
            headers={"X-Request-Id": "same-id"},
        )
    assert (again.status_code, again.json()["error"]["code"]) == (409, "duplicate_request_id")
    assert (await first).temperature == 0.2


def test_client_refuses_a_bad_override():
    with pytest.raises(RequestError) as info:
        AsyncClient(override_generation_config={"temperature": -1})
    assert (info.value.status, info.value.param, info.value.message) == (
        400,
        "override_generation_config",
        "override_generation_config: temperature must be in [0, 100], got -1.0",
    )
