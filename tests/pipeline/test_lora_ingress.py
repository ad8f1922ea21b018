"""LoRA adapters through the ingress (real decode worker: SmolLM2 on CPU, real Valkey): an
adapter is a model of /v1/models (with its parent), a chat naming it is served with it (the
tokens of the engine with that adapter), an unknown one is 404 model_not_found; run-time
load/unload (vLLM's endpoints) reach the worker through Valkey; a task naming an adapter the
worker lacks is dead-lettered; a resumed task keeps its adapter."""

from __future__ import annotations

import threading

import pytest
import redis

from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.server.app import create_app
from tests.lora_files import write_adapter
from tests.pipeline.ingress_support import MODEL, http, make_config, unique_prefix
from tests.queue_state import final_chunks

pytestmark = pytest.mark.anyio

PREFIX = unique_prefix()
CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(valkey_session, tmp_path_factory):
    """A decode worker holding adapter t1 (t2 is loaded at run time), and the tokens the engine
    gives the chat with each adapter and without, computed before it serves."""
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    root = tmp_path_factory.mktemp("adapters")
    t1, t2 = write_adapter(root / "t1", 1), write_adapter(root / "t2", 2, rank=8)
    engine = Engine(
        EngineConfig(kv_cache_bytes=32 << 20, num_threads=1, lora_modules=(f"t1={t1}",))
    )
    prompt = engine.tokenizer.apply_chat_template(CHAT)
    engine.loras.load("t2", t2)
    expected = {}
    for lora in ("", "t1", "t2"):
        engine.add_request(f"ref-{lora}", prompt, SamplingParams(**GREEDY), lora=lora)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        expected[lora] = tokens
    engine.loras.unload("t2")
    config = WorkerConfig(redis_url=valkey_session.url, key_prefix=PREFIX, name="decode-lora",
                          heartbeat_s=0.2, metrics_port=-1, block_ms=20)  # fmt: skip
    worker = DecodeWorker(config, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(120)
    yield worker, prompt, expected, root
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()


async def test_adapters_served_loaded_and_unloaded(valkey_session, smollm_tokenizer, served):
    worker, prompt, expected, root = served
    assert len({tuple(v) for v in expected.values()}) == 3  # each adapter changes the answer
    config = make_config(valkey_session.url, key_prefix=PREFIX, allow_runtime_lora_updating=True)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})

    async def chat(client, model: str):
        body = {"model": model, "messages": CHAT, "logprobs": True, **GREEDY}
        return await client.post("/v1/chat/completions", json=body)

    def tokens(resp) -> list[int]:
        content = resp.json()["choices"][0]["logprobs"]["content"]
        return [smollm_tokenizer.token_to_id(c["token"]) for c in content]

    try:
        async with http(app) as client:
            models = (await client.get("/v1/models")).json()["data"]
            cards = {m["id"]: m for m in models}
            assert cards["t1"]["parent"] == MODEL and "parent" not in cards[MODEL]
            assert (await client.get("/v1/models/t1")).json()["parent"] == MODEL
            for model, lora in ((MODEL, ""), ("t1", "t1")):
                resp = await chat(client, model)
                assert resp.status_code == 200, resp.text
                assert resp.json()["model"] == model
                assert resp.json()["choices"][0]["message"]["content"] == (
                    smollm_tokenizer.decode(expected[lora])
                )
            unknown = await chat(client, "nope")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"

            # run time: load t2, serve it, refuse bad loads, unload it
            load = {"lora_name": "t2", "lora_path": str(root / "t2")}
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert (resp.status_code, resp.text) == (
                200, "Success: LoRA adapter 't2' added successfully."
            )  # fmt: skip
            assert worker.engine.loras.names() == ["t1", "t2"]
            ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            assert {"t1", "t2"} <= set(ids)
            resp = await chat(client, "t2")
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == (
                smollm_tokenizer.decode(expected["t2"])
            )
            again = await client.post("/v1/load_lora_adapter", json=load)
            assert again.status_code == 400
            assert (
                again.json()["error"]["message"] == "The lora adapter 't2' has already been loaded."
            )
            bad = {"lora_name": "t3", "lora_path": str(root / "missing")}
            resp = await client.post("/v1/load_lora_adapter", json=bad)
            assert resp.status_code == 400
            assert "is not a directory" in resp.json()["error"]["message"]
            assert (await chat(client, "t3")).status_code == 404
            resp = await client.post("/v1/load_lora_adapter", json={"lora_name": "t3"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"

            resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "t2"})
            assert (resp.status_code, resp.text) == (
                200, "Success: LoRA adapter 't2' removed successfully."
            )  # fmt: skip
            assert worker.engine.loras.names() == ["t1"]
            assert (await chat(client, "t2")).status_code == 404
            resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "t2"})
            assert resp.status_code == 404
            assert resp.json()["error"]["message"] == "The lora adapter 't2' cannot be found."
    finally:
        await app.state.ingress.aclose()

    # without the setting the endpoints do not exist
    plain = create_app(make_config(valkey_session.url, key_prefix=PREFIX),
                       tokenizers={MODEL: smollm_tokenizer})  # fmt: skip
    try:
        async with http(plain) as client:
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert resp.status_code == 404
    finally:
        await plain.state.ingress.aclose()


def test_worker_dead_letters_unknown_adapter_and_resumes_with_its_own(valkey_session, served):
    worker, prompt, expected, _root = served
    r = redis.Redis.from_url(valkey_session.url)
    keys = Keys(PREFIX)
    for rid, lora, outputs in (("dl-nope", "nope", []), ("resume-t1", "t1", expected["t1"][:2])):
        task = DecodeTask(request_id=rid, prompt_token_ids=prompt, output_token_ids=outputs,
                          sampling=GREEDY, lora=lora)  # fmt: skip
        r.xadd(keys.decode_stream, {MESSAGE_FIELD: task.encode()})
    refused = final_chunks(r, keys, "dl-nope")
    assert refused[-1].finish_reason == "error"
    assert refused[-1].error == (
        "rejected by the engine: LoRA adapter 'nope' is not loaded on this worker"
    )
    # a worker resuming after a kill: the task carries its adapter, so the same tokens follow
    resumed = final_chunks(r, keys, "resume-t1")
    assert resumed[0].index == 2
    assert [t for c in resumed for t in c.token_ids] == expected["t1"][2:]
