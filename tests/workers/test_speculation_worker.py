"""Speculative decoding as an operator sees it: a DecodeWorker on the real SmolLM2 engine with
prompt lookup (`speculation="ngram"`) emits plain decoding's tokens, counts drafts in its
Prometheus series, records each request's acceptance and names its mode in the heartbeat."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from prometheus_client import generate_latest

from kvrelay.cli.status_data import WORKER_SERIES, parse_metrics
from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask, TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import emitted_chunks

KEYS = Keys("spec:")
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# prompts whose answers repeat their own words, so prompt lookup drafts get accepted
QUESTIONS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Copy exactly: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from tests.conftest import ValkeyServer

    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    plain = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1, speculation="off"))
    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1, speculation="ngram"))
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    # one at a time (the worker below serves them one at a time too): a draft's length depends
    # on how many sequences decode together
    plains = [plain.generate([p], SamplingParams(**GREEDY))[0] for p in prompts]
    refs = [engine.generate([p], SamplingParams(**GREEDY))[0] for p in prompts]
    del plain
    config = WorkerConfig(
        redis_url=server.url,
        key_prefix="spec:",
        name="decode-spec",
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
        engine=engine.config,  # the settings of the engine it runs (speculation ngram)
    )
    worker = DecodeWorker(config, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    r = redis.Redis.from_url(server.url)
    yield r, worker, prompts, plains, refs
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()
    server.stop()


def run_request(r, request_id: str, prompt: list[int], timeout: float = 120) -> list[TokenChunk]:
    task = DecodeTask(
        request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY, prefilled=False
    )
    r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = emitted_chunks(r, KEYS, request_id)
        if got and got[-1].finished and r.hget(KEYS.request(request_id), "status") == b"finished":
            return got
        time.sleep(0.02)
    raise AssertionError(f"{request_id} did not finish")


def sample(worker, name: str) -> float:
    value = worker.metrics.base.registry.get_sample_value(name, {"model_name": MODEL})
    return 0.0 if value is None else value


def test_speculating_worker_emits_plain_tokens_and_counts_acceptance(stack):
    r, worker, prompts, plains, refs = stack
    # the reference runs: the same tokens with and without speculation, drafts accepted
    for plain, ref in zip(plains, refs, strict=True):
        assert ref.output_token_ids == plain.output_token_ids
        assert plain.metrics["num_draft_tokens"] == 0
    assert refs[0].metrics["num_accepted_tokens"] > 0
    assert worker.heartbeat.info.speculation == "ngram"
    before = worker.engine.stats.num_draft_tokens  # the reference runs are not the worker's
    assert sample(worker, "kvrelay:spec_decode_num_draft_tokens_total") == 0
    steps = 0
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        got = run_request(r, f"s{i}", prompt)
        tokens = [t for c in got for t in c.token_ids]
        assert tokens == ref.output_token_ids
        # a chunk per step (the last one finishes), several tokens where drafts were accepted
        assert len(got) == len(tokens) - ref.metrics["num_accepted_tokens"]
        steps += len(tokens) - ref.metrics["num_accepted_tokens"]
        record = r.hmget(KEYS.request(f"s{i}"), "draft_tokens", "accepted_tokens")
        assert [int(v) for v in record] == [
            ref.metrics["num_draft_tokens"],
            ref.metrics["num_accepted_tokens"],
        ]
        # the client's usage is unchanged
        assert set(got[-1].usage) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    drafted = sum(ref.metrics["num_draft_tokens"] for ref in refs)
    accepted = sum(ref.metrics["num_accepted_tokens"] for ref in refs)
    drafts = sum(ref.metrics["num_verifications"] for ref in refs)
    assert worker.engine.stats.num_draft_tokens - before == drafted
    assert sample(worker, "kvrelay:spec_decode_num_draft_tokens_total") == drafted
    assert sample(worker, "kvrelay:spec_decode_num_accepted_tokens_total") == accepted
    assert sample(worker, "kvrelay:spec_decode_num_drafts_total") == drafts
    # tokens per step: generation_tokens / generation_steps
    assert sample(worker, "kvrelay:generation_tokens_total") == 2 * GREEDY["max_tokens"]
    assert sample(worker, "kvrelay:generation_steps_total") == steps
    assert steps == 2 * GREEDY["max_tokens"] - accepted
    beat = r.hget(KEYS.worker("decode-spec"), "speculation")
    assert beat == b"ngram"
    # what `kvrelay status --json` scrapes from the worker's /metrics
    scraped = parse_metrics(generate_latest(worker.metrics.base.registry).decode(), WORKER_SERIES)
    assert (scraped["spec_draft_tokens"], scraped["spec_accepted_tokens"]) == (drafted, accepted)
    assert scraped["generation_steps"] == steps
