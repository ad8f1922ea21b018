"""Priorities and fair shares through a real worker (SmolLM2, real Valkey) under
`--scheduling-policy priority`, with tenants from a keys file: the order requests finish in,
exactly, on a worker that runs one sequence at a time."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvrelay.core import record as rec
from kvrelay.core.keys import Keys
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, http, make_config, running_worker

pytestmark = pytest.mark.anyio

PREFIX = "prio:"
KEYS = Keys(PREFIX)
KEYS_FILE = """
[[key]]
name = "batch"
key = "sk-batch"
priority = 10
priority_range = [0, 10]

[[key]]
name = "a"
key = "sk-a"

[[key]]
name = "b"
key = "sk-b"
"""


@pytest.fixture(scope="module")
def one_seq_worker(valkey_session):
    with running_worker(valkey_session.url, PREFIX, "prio-w", max_num_seqs=1) as worker:
        yield worker


@pytest.fixture
async def ingress(valkey_session, smollm_tokenizer, one_seq_worker, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    config = make_config(
        valkey_session.url,
        key_prefix=PREFIX,
        scheduling_policy="priority",
        api_keys_file=str(path),
    )
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    r = aioredis.Redis.from_url(valkey_session.url)
    try:
        async with http(app) as client:
            yield client, r
    finally:
        await r.aclose()
        await app.state.ingress.aclose()


def post(client, key: str, rid: str, max_tokens: int, **fields):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **fields}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": rid}
    return client.post("/v1/completions", json=body, headers=headers)


async def run_in_order(client, r, plan) -> tuple[list[str], dict[str, str]]:
    """Post `plan` [(key, id, max_tokens, fields)] in order (each queued before the next is
    posted; the first running first); (ids in the order they finished, id -> text)."""
    finished: list[str] = []
    texts: dict[str, str] = {}

    async def one(key: str, rid: str, max_tokens: int, fields: dict) -> None:
        resp = await post(client, key, rid, max_tokens, **fields)
        assert resp.status_code == 200, resp.text
        finished.append(rid)
        texts[rid] = resp.json()["choices"][0]["text"]

    tasks = []
    for i, (key, rid, max_tokens, fields) in enumerate(plan):
        tasks.append(asyncio.create_task(one(key, rid, max_tokens, fields)))
        while not await r.exists(KEYS.request(rid)):  # queued
            await asyncio.sleep(0.005)
        if i == 0:  # the first runs before the others come
            while not await r.hget(KEYS.request(rid), rec.OWNER):
                await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    return finished, texts


async def test_a_better_priority_displaces_the_running_request(ingress):
    client, r = ingress
    plan = [
        ("sk-batch", "low-0", 48, {}),  # the key's default: 10
        ("sk-batch", "low-1", 48, {}),
        ("sk-batch", "low-2", 48, {}),
        ("sk-batch", "urgent", 4, {"priority": 0}),  # within the key's range
    ]
    finished, texts = await run_in_order(client, r, plan)
    # urgent preempts low-0 (recomputed: the same tokens), the others keep their order
    assert finished == ["urgent", "low-0", "low-1", "low-2"]
    assert texts["low-0"] == texts["low-1"] == texts["low-2"]
    assert texts["low-0"].startswith(texts["urgent"])
    resp = await post(client, "sk-batch", "too-low", 4, priority=11)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "priority"
    assert err["message"] == "priority must be within [0, 10] for this API key, got 11"


async def test_tenants_share_by_weighted_tokens_not_arrival(ingress):
    client, r = ingress
    plan = [("sk-a", "a-0", 48, {})]
    plan += [("sk-a", f"a-{i}", 4, {}) for i in range(1, 6)]
    plan += [("sk-b", f"b-{i}", 4, {}) for i in range(2)]
    finished, _ = await run_in_order(client, r, plan)
    # start tags: a-1 a0's cost c0 (then a-2 c0 + c, ...), b-0 the virtual time c0, b-1 c0 + c
    # (a tie with a-2, broken by id): b is served from its first request on, not after a's
    assert finished == ["a-0", "a-1", "b-0", "a-2", "b-1", "a-3", "a-4", "a-5"]
