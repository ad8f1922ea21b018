"""Three pipeline shards on a 3-node loopback Valkey Cluster (real nodes, real ingress and
decode worker, SmolLM2): each shard's keys on their own node, and a request set answered
exactly as one shard on one plain Valkey answers it, GET and resume from a second ingress."""

from __future__ import annotations

import pytest

from kvrelay.core.keys import Keys
from kvrelay.pipeline.server.app import create_app
from tests.conftest import ValkeyCluster
from tests.pipeline.ingress_support import MODEL, http, make_config, parse_sse, running_worker
from tests.queue_state import ids_on_every_shard

pytestmark = pytest.mark.anyio

PREFIX = "shc:"
# the request set: prompts, sampling (greedy and seeded), several choices
REQUESTS = [
    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 7},
    {"prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "n": 2},
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = ValkeyCluster(tmp_path_factory.mktemp("shards-cluster"), 3, key_prefix=PREFIX)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


async def answers(client, stem: str) -> list[list[str]]:
    """Every request of the set on every shard's id: the choices' texts."""
    out = []
    for body in REQUESTS:
        for rid in ids_on_every_shard(f"{stem}-{len(out)}"):
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, **body}, headers={"X-Request-Id": rid}
            )
            assert resp.status_code == 200, resp.text
            out.append([c["text"] for c in resp.json()["choices"]])
    return out


async def test_a_cluster_of_three_shards_answers_as_one_plain_valkey(
    cluster, valkey_session, smollm_tokenizer
):
    tokenizers = {MODEL: smollm_tokenizer}
    with running_worker(valkey_session.url, "shc-one:", "shc-one") as one:
        app = create_app(
            make_config(valkey_session.url, key_prefix="shc-one:"), tokenizers=tokenizers
        )
        try:
            async with http(app) as client:
                expected = await answers(client, "ref")
        finally:
            await app.state.ingress.aclose()
        with running_worker(
            cluster.url, PREFIX, "shc-three", loaded=one.engine.loaded, shards=3
        ) as three:
            apps = [
                create_app(
                    make_config(cluster.url, key_prefix=PREFIX, shards=3), tokenizers=tokenizers
                )
                for _ in range(2)
            ]
            try:
                async with http(apps[0]) as first, http(apps[1]) as second:
                    got = await answers(first, "clu")
                    rid = ids_on_every_shard("clu-0")[2]
                    state = await second.get(f"/v1/requests/{rid}")
                    assert (state.json()["status"], state.json()["completion_tokens"]) == (
                        "finished",
                        8,
                    )
                    resumed = await second.get(
                        f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": "3"}
                    )
                    events = parse_sse(resumed.content)
                    assert events[-1] == (None, "[DONE]")
                    assert [int(i) for i, _ in events[:-1] if i is not None][0] == 4
            finally:
                for app in apps:
                    await app.state.ingress.aclose()
            assert three.lanes.keys() == {0, 1, 2}
    # the expected texts repeat per shard: every shard answered the same
    assert got == expected
    assert [len(set(map(tuple, expected[i : i + 3]))) for i in (0, 3, 6)] == [1, 1, 1]
    # each shard's keys live on their own node (node i serves shard i's tag)
    for i, keys in enumerate(Keys(PREFIX, shards=3).all()):
        node = cluster.client(i)
        assert node.exists(keys.decode_stream) == 1
        [group] = node.xinfo_groups(keys.decode_stream)
        assert group["entries-read"] == 4  # 1 + 1 + the two choices of one request
        node.close()
