"""Shared pieces for the ingress and client tests (no tests here; their fixtures, `harness`,
`smollm_tokenizer` and `anyio_backend`, are in tests/conftest.py).

`WorkerRole` plays a worker over the real protocol: XREADGROUP the task from its stream, XADD
TokenChunks to out:{id}, XACK. Fixtures give a real Valkey, the real SmolLM2 tokenizer and an
ingress app per test under its own key prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk
from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.pipeline.server.config import IngressConfig
from tests.pipeline.queue_sim import emit_async

MODEL = DEFAULT_MODEL
TEST_TIMEOUT_S = 30.0  # a request whose worker never answers fails the test, not hangs it
MODEL_INFO = {"fingerprint": "f" * 32, "page_size": 16, "max_model_len": 8192, "vocab_size": 49152}


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@contextlib.contextmanager
def running_worker(
    redis_url: str,
    key_prefix: str,
    name: str,
    role=None,
    loaded=None,
    device="auto",
    max_num_seqs: int | None = None,
    **settings,
):
    """A real worker (`role`: its class, DecodeWorker by default, which prefills locally) on
    its own thread, with a quick heartbeat and no metrics port (`settings`: more of its
    WorkerConfig; `device`: its engine's, when it loads the model; `max_num_seqs`: its
    engine's and reader's); stopped on exit."""
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    seqs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    engine_config = EngineConfig(kv_cache_bytes=32 << 20, num_threads=1, device=device, **seqs)
    engine = Engine(engine_config, loaded=loaded)
    if seqs:
        settings["engine"] = engine_config
    config = WorkerConfig(
        redis_url=redis_url,
        key_prefix=key_prefix,
        name=name,
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
        **settings,
    )
    worker = (role or DecodeWorker)(config, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # announced before the first request: an ingress that saw no decode worker would route
        # a long prompt to prefill, where no worker of this test reads
        assert worker.ready.wait(120), f"worker {name} did not start"
        yield worker
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()


def make_config(valkey_url: str, **overrides) -> IngressConfig:
    values = dict(
        redis_url=valkey_url,
        key_prefix=unique_prefix(),
        models=(MODEL,),
        state_refresh_s=0.0,
        read_block_ms=200,
        request_timeout_s=TEST_TIMEOUT_S,
    )
    values.update(overrides)
    return IngressConfig(**values)


@dataclass(slots=True)
class Taken:
    """A task a WorkerRole read from a work stream."""

    stage: str
    entry_id: bytes
    task: PrefillTask | DecodeTask


class WorkerRole:
    """Reads tasks and writes token chunks exactly where a real worker would."""

    def __init__(self, url: str, keys: Keys):
        self.r = aioredis.Redis.from_url(url)
        self.keys = keys

    async def setup(self) -> WorkerRole:
        for stream, group in (
            (self.keys.prefill_stream, PREFILL_GROUP),
            (self.keys.decode_stream, DECODE_GROUP),
        ):
            try:
                await self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        return self

    async def publish_model(self, info: dict | None = None, name: str = MODEL) -> None:
        await self.r.hset(self.keys.models, name, json.dumps(info or MODEL_INFO))

    async def heartbeat(self, worker_id: str, role: str, model: str = MODEL) -> None:
        await self.r.hset(
            self.keys.worker(worker_id), mapping={"role": role, "model": model, "pid": 1}
        )
        await self.r.expire(self.keys.worker(worker_id), 30)

    async def take(self, timeout_s: float = 5.0) -> Taken:
        """The next task from either stream."""
        streams = {self.keys.prefill_stream: ">", self.keys.decode_stream: ">"}
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            for stream, group, cls in (
                (self.keys.prefill_stream, PREFILL_GROUP, PrefillTask),
                (self.keys.decode_stream, DECODE_GROUP, DecodeTask),
            ):
                reply = await self.r.xreadgroup(
                    group, "w1", {stream: streams[stream]}, count=1, block=20
                )
                if reply:
                    entry_id, fields = reply[0][1][0]
                    stage = "prefill" if cls is PrefillTask else "decode"
                    task = cls.decode(fields[MESSAGE_FIELD])
                    # what a worker records when it admits a request
                    await self.r.hset(
                        self.keys.request(task.request_id),
                        mapping={
                            "status": "prefilling" if stage == "prefill" else "decoding",
                            "started": f"{time.time():.6f}",
                            "owner": "w1",
                        },
                    )
                    return Taken(stage, entry_id, task)
        raise TimeoutError("no task arrived")

    async def emit(self, request_id: str, chunk: TokenChunk) -> None:
        """The chunk written as a worker's step writes it (progress tail, history, feeds)."""
        await emit_async(self.r, self.keys, request_id, chunk)

    async def finish(self, taken: Taken, status: str = "finished") -> None:
        stream = self.keys.prefill_stream if taken.stage == "prefill" else self.keys.decode_stream
        group = PREFILL_GROUP if taken.stage == "prefill" else DECODE_GROUP
        await self.r.xack(stream, group, taken.entry_id)
        await self.r.hset(self.keys.request(taken.task.request_id), "status", status)

    async def serve_one(
        self,
        pieces: list[tuple[int, str]],
        finish_reason: str = "stop",
        usage: dict | None = None,
        logprobs: list[dict] | None = None,
        delay_s: float = 0.0,
    ) -> Taken:
        """Take one task and answer it with one chunk per (token id, text), the last final."""
        taken = await self.take()
        rid = taken.task.request_id
        for i, (tid, text) in enumerate(pieces):
            last = i == len(pieces) - 1
            await self.emit(
                rid,
                TokenChunk(
                    index=i,
                    token_ids=[tid],
                    text=text,
                    finish_reason=finish_reason if last else None,
                    usage=usage if last else None,
                    logprobs=[logprobs[i]] if logprobs else None,
                ),
            )
            if delay_s:
                await asyncio.sleep(delay_s)
        await self.finish(taken)
        return taken

    async def aclose(self) -> None:
        await self.r.aclose()


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


def parse_sse(body: bytes) -> list[tuple[str | None, str]]:
    """(id, data) per event; asserts every event ends with a blank line."""
    assert body.endswith(b"\n\n")
    events = []
    for block in body.decode().split("\n\n")[:-1]:
        event_id, data = None, None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "id":
                event_id = value
            else:
                assert key == "data", line
                data = value
        events.append((event_id, data))
    return events
