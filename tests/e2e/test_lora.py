"""`kvrelay up` with a LoRA adapter (KVRELAY_WORKER_LORA_MODULES) and run-time updates allowed:
a long prompt naming the adapter goes through the prefill worker and hands off to a decode
worker with its adapter; a decode worker SIGKILLed mid-stream is resumed by the other with the
tokens of an uninterrupted run; an adapter loaded at run time reaches every worker and is
served, then unloaded."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.chat_stream import openai_client
from tests.e2e.stack import MODEL, Stack
from tests.lora_files import write_adapter

# over the route threshold (64 uncached tokens): prefill worker, then a decode worker
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper, " * 8}]
SAMPLING = {"max_tokens": 24, "temperature": 0.8, "seed": 77}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return write_adapter(root / "t1", 1), write_adapter(root / "t2", 2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, adapters):
    env = {
        "KVRELAY_WORKER_LORA_MODULES": f"t1={adapters[0]}",
        "KVRELAY_INGRESS_ALLOW_RUNTIME_LORA_UPDATING": "true",
    }
    s = Stack(tmp_path_factory.mktemp("run"), prefill=1, decode=2, env=env)
    s.up()
    yield s
    s.down()


def _stream(client, model: str, request_id: str, on_token=None) -> str:
    stream = client.chat.completions.create(
        model=model, messages=STORY, stream=True, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id}, **SAMPLING,
    )  # fmt: skip
    text, n = "", 0
    for event in stream:
        if event.choices:
            text += event.choices[0].delta.content or ""
            n += 1
            if on_token:
                on_token(n)
    return text


def test_adapter_through_prefill_handoff_and_a_decode_worker_kill(stack):
    client = openai_client(stack)
    base = _stream(client, MODEL, "lora-base")
    ref = _stream(client, "t1", "lora-ref")
    ref_tokens = stack.out_tokens("lora-ref")
    assert len(ref_tokens) == SAMPLING["max_tokens"] and ref != base
    record = stack.redis.hgetall(stack.keys.of("lora-ref").request("lora-ref"))
    assert int(record[b"prompt_tokens"]) > 64  # computed by the prefill worker
    killed: dict[str, int] = {}

    def kill_owner(n: int) -> None:
        if n == 6 and not killed:
            key = stack.keys.of("lora-victim").request("lora-victim")
            owner = stack.redis.hget(key, "owner").decode()
            assert owner.startswith("decode-")
            killed[owner] = stack.kill(owner)

    assert _stream(client, "t1", "lora-victim", kill_owner) == ref
    assert killed and stack.out_tokens("lora-victim") == ref_tokens
    [(program, pid)] = killed.items()
    stack.wait_restarted(program, pid)


def test_runtime_load_and_unload(stack, adapters):
    load = {"lora_name": "t2", "lora_path": str(adapters[1])}
    resp = httpx.post(stack.url + "/v1/load_lora_adapter", json=load, timeout=120)
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 't2' added successfully.")
    models = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"]
    assert {m["id"]: m.get("parent") for m in models if m["id"] in ("t1", "t2")} == {
        "t1": MODEL, "t2": MODEL,
    }  # fmt: skip
    body = {"model": "t2", "messages": STORY, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["model"] == "t2", resp.text
    unload = {"lora_name": "t2"}
    resp = httpx.post(stack.url + "/v1/unload_lora_adapter", json=unload, timeout=120)
    assert resp.status_code == 200, resp.text
    resp = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
