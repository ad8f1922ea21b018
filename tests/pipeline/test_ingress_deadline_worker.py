"""A deadline ends a request the same way streaming or not, with a real decode worker (SmolLM2 on
CPU, real Valkey): `failed`/`timeout` in req:{id}, 504 (or the SSE error event) to the client,
counted as a timeout, never as a cancel.

At the deadline the ingress answers and sets the cancel flag. A worker whose engine step is
still running then reads the flag before its own deadline check: it must still record a timeout.
The engine's step is held until the flag has reached the worker, so that order is certain.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from kvrelay.pipeline.server.app import create_app
from tests.pipeline.ingress_support import MODEL, http, make_config, parse_sse, unique_prefix

pytestmark = pytest.mark.anyio

PREFIX = unique_prefix()
DEADLINE = "the request passed its deadline"
TIMEOUT_S = 0.5
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def decode_worker(valkey_session):
    """A real decode worker whose engine steps wait until a cancel flag has reached it."""
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    config = WorkerConfig(
        redis_url=valkey_session.url,
        key_prefix=PREFIX,
        name="decode-deadline",
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
    )
    worker = DecodeWorker(config, engine)
    step = engine.step

    def held_step():
        # a step that outlasts the deadline, ending once the ingress's cancel flag (set at the
        # deadline) is queued for the compute loop: it is applied before the deadline check
        end = time.monotonic() + 10
        while worker.cancels.empty() and time.monotonic() < end:
            time.sleep(0.005)
        return step()

    engine.step = held_step
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(120), "the worker did not start"  # announced before any request
    yield worker
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()


async def _ended(app, request_id: str) -> dict[bytes, bytes]:
    """req:{id} once a worker has ended the request (fails the test after 20 s)."""
    ing = app.state.ingress
    for _ in range(1000):
        record = await ing.redis.hgetall(ing.keys.request(request_id))
        if record.get(b"status") in (b"finished", b"cancelled", b"failed"):
            return record
        await asyncio.sleep(0.02)
    raise AssertionError(f"request {request_id} did not end")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_deadline_is_a_timeout_streaming_or_not(
    valkey_session, smollm_tokenizer, decode_worker, stream
):
    rid = f"deadline-{'stream' if stream else 'whole'}"
    app = create_app(
        make_config(valkey_session.url, key_prefix=PREFIX, request_timeout_s=TIMEOUT_S),
        tokenizers={MODEL: smollm_tokenizer},
    )
    try:
        async with http(app) as client:
            resp = await client.post(
                "/v1/completions", json={**BODY, "stream": stream}, headers={"X-Request-Id": rid}
            )
            if stream:
                assert resp.status_code == 200
                events = parse_sse(resp.content)
                assert events[-1] == (None, "[DONE]")
                assert json.loads(events[-2][1]) == {
                    "error": {
                        "message": DEADLINE,
                        "type": "timeout",
                        "param": None,
                        "code": "request_timeout",
                    }
                }
            else:
                assert (resp.status_code, resp.json()["error"]) == (
                    504,
                    {
                        "message": DEADLINE,
                        "type": "timeout",
                        "param": None,
                        "code": "request_timeout",
                    },
                )
            record = await _ended(app, rid)
            state = (await client.get(f"/v1/requests/{rid}")).json()
        assert (record[b"status"], record[b"finish_reason"], record.get(b"error")) == (
            b"failed",
            b"timeout",
            DEADLINE.encode(),
        )
        # ended: the flag is gone with its progress, its end says a deadline cancelled it
        assert (state["status"], state["finish_reason"], state["cancel_requested"]) == (
            "failed",
            "timeout",
            True,
        )
        metrics = app.state.ingress.metrics.registry
        label = {"model_name": MODEL}
        success = "kvrelay:request_success_total"
        timeout = metrics.get_sample_value(success, {**label, "finished_reason": "timeout"})
        cancelled = metrics.get_sample_value(success, {**label, "finished_reason": "cancelled"})
        assert (timeout, cancelled) == (1.0, None)
    finally:
        await app.state.ingress.aclose()
