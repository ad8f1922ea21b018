"""Usage accounting end to end (real decode worker: SmolLM2 on CPU, real Valkey, keys file):
after chat, completions with n=2, best_of, a streamed request with include_usage and a
Responses API call, every key's counters equal the sum of the `usage` its clients received,
and /metrics exports the same values."""

from __future__ import annotations

import json

import pytest
import redis

from kvrelay.core.keys import Keys
from kvrelay.pipeline.queue.usage import read_total_sync
from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, http, make_config, running_worker, unique_prefix

pytestmark = pytest.mark.anyio

PREFIX = unique_prefix()
KEYS_FILE = """
[[key]]
name = "alice"
key = "sk-alice"
tenant = "acme"

[[key]]
name = "bob"
key = "sk-bob"
tenant = "beta"
"""
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    with running_worker(valkey_session.url, PREFIX, "decode-u") as worker:
        yield worker


def add(sums: dict[str, list[int]], name: str, prompt: int, cached: int, completion: int):
    got = sums.setdefault(name, [0, 0, 0, 0])
    for i, value in enumerate((1, prompt, cached, completion)):
        got[i] += value


def chat_usage(u: dict) -> tuple[int, int, int]:
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]


def sse_usage(text: str) -> dict:
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    [usage] = [json.loads(d)["usage"] for d in datas[:-1] if json.loads(d).get("usage")]
    assert datas[-1] == "[DONE]"
    return usage


async def test_counters_equal_the_usage_clients_received(
    valkey_session, smollm_tokenizer, decode_worker, tmp_path
):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    config = make_config(valkey_session.url, key_prefix=PREFIX, api_keys_file=str(path))
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    sums: dict[str, list[int]] = {}  # key -> [requests, prompt, cached, completion]
    try:
        async with http(app) as client:
            chat = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
            resp = await client.post("/v1/chat/completions", json=chat, headers=ALICE)
            assert resp.status_code == 200, resp.text
            add(sums, "alice", *chat_usage(resp.json()["usage"]))
            again = await client.post("/v1/chat/completions", json=chat, headers=ALICE)
            add(sums, "alice", *chat_usage(again.json()["usage"]))  # its prompt cached now
            two = {"model": MODEL, "prompt": ["Red, green", "One, two"], "max_tokens": 5,
                   "n": 2, "temperature": 0.8, "seed": 4}  # fmt: skip
            resp = await client.post("/v1/completions", json=two, headers=ALICE)
            assert resp.status_code == 200 and len(resp.json()["choices"]) == 4, resp.text
            add(sums, "alice", *chat_usage(resp.json()["usage"]))
            best = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "best_of": 2,
                    "temperature": 0.9, "seed": 2}  # fmt: skip
            resp = await client.post("/v1/completions", json=best, headers=BOB)
            assert len(resp.json()["choices"]) == 1, resp.text
            add(sums, "bob", *chat_usage(resp.json()["usage"]))
            streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            resp = await client.post("/v1/chat/completions", json=streamed, headers=BOB)
            assert resp.status_code == 200, resp.text
            add(sums, "bob", *chat_usage(sse_usage(resp.text)))
            answer = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 5}
            resp = await client.post("/v1/responses", json=answer, headers=BOB)
            assert resp.status_code == 200, resp.text
            u = resp.json()["usage"]
            add(sums, "bob", u["input_tokens"], u["input_tokens_details"]["cached_tokens"],
                u["output_tokens"])  # fmt: skip
            metrics = (await client.get("/metrics")).text
    finally:
        await app.state.ingress.aclose()
    r = redis.Redis.from_url(valkey_session.url)
    counted = {
        u.key: [u.get("requests"), u.get("prompt_tokens"), u.get("cached_tokens"),
                u.get("completion_tokens")]
        for u in read_total_sync(r, Keys(PREFIX)).values()
    }  # fmt: skip
    assert counted == sums
    assert sums["alice"][2] > 0  # the second chat found its prompt cached: counted as sent
    tenants = {"alice": "acme", "bob": "beta"}
    for key, (requests, prompt, _cached, completion) in sums.items():
        labels = f'{{key="{key}",model="{MODEL}",tenant="{tenants[key]}"}}'
        assert f"kvrelay:tenant_requests_total{labels} {float(requests)}" in metrics
        assert f"kvrelay:tenant_prompt_tokens_total{labels} {float(prompt)}" in metrics
        assert f"kvrelay:tenant_completion_tokens_total{labels} {float(completion)}" in metrics
