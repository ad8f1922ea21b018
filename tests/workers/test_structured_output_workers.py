"""Structured output through real workers (SmolLM2, real Valkey): the spec rides in the tasks,
the prefill worker's first token is constrained, the decode worker replays the emitted tokens
into its matcher (hand-off, resume from token k) and continues exactly; a grammar no engine can
compile is dead-lettered by the reader, before admission."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest
import redis

from kvrelay.core.keys import MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk, frame
from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import StructuredOutput
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import emitted_chunks

PREFIX = "sow:"
KEYS = Keys(PREFIX)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["name", "tags", "score"],
    "additionalProperties": False,
}
SAMPLING = SamplingParams(
    max_tokens=80,
    temperature=0.8,
    seed=21,
    structured=StructuredOutput("json", json.dumps(SCHEMA)),
)


@pytest.fixture(scope="module")
def stack(valkey_session, loaded_model):
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.prefill import PrefillWorker

    def engine():
        return Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1), loaded=loaded_model)

    reference = engine()
    prompt = reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a product review as JSON."}]
    )
    [ref] = reference.generate([prompt], SAMPLING)
    workers = []
    for cls, name in ((PrefillWorker, "prefill-so"), (DecodeWorker, "decode-so")):
        config = WorkerConfig(
            redis_url=valkey_session.url,
            key_prefix=PREFIX,
            name=name,
            heartbeat_s=0.2,
            metrics_port=-1,
            block_ms=20,
        )
        worker = cls(config, engine())
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        workers.append((worker, thread))
    yield redis.Redis.from_url(valkey_session.url), prompt, ref, workers[1][0]
    for worker, thread in workers:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive()


def final_chunks(r, request_id: str, timeout_s: float = 120) -> list[TokenChunk]:
    """Every chunk of the request once its final chunk is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = emitted_chunks(r, KEYS, request_id)
        if got and got[-1].finished:
            return got
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        time.sleep(0.02)


def tokens(got: list[TokenChunk]) -> list[int]:
    return [t for chunk in got for t in chunk.token_ids]


def test_reference_output_fits_the_schema(stack):
    _r, _prompt, ref, _decode = stack
    assert ref.finish_reason == "stop" and len(ref.output_token_ids) > 10
    jsonschema.validate(json.loads(ref.text_delta), SCHEMA)


def test_prefill_then_decode_gives_the_reference_tokens(stack):
    r, prompt, ref, _decode = stack
    task = PrefillTask(request_id="so-split", prompt_token_ids=prompt, sampling=SAMPLING)
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    got = final_chunks(r, "so-split")
    assert got[0].token_ids == ref.output_token_ids[:1]  # the prefill worker's, constrained
    assert tokens(got) == ref.output_token_ids
    assert "".join(c.text for c in got) == ref.text_delta
    assert got[-1].finish_reason == "stop"


@pytest.mark.parametrize("k", [3, 8])
def test_decode_task_resumed_at_token_k_continues_exactly(stack, k):
    """As after a crash: out:{id} holds k tokens and the task carries them."""
    r, prompt, ref, _decode = stack
    rid = f"so-resume-{k}"
    done = ref.output_token_ids[:k]
    r.xadd(KEYS.out(rid), {MESSAGE_FIELD: frame(TokenChunk(0, done).encode())})
    r.hset(KEYS.progress, rid, Progress(emitted=k, hist=k).encode())
    task = DecodeTask(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=done,
        sampling=SAMPLING,
        prefilled=True,
    )
    r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
    got = final_chunks(r, rid)
    assert got[1].index == k
    assert tokens(got) == ref.output_token_ids
    assert got[-1].finish_reason == "stop"


def test_a_grammar_no_engine_compiles_is_dead_lettered_before_admission(stack):
    r, prompt, _ref, decode = stack
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "a(b"))
    task = DecodeTask(request_id="so-bad", prompt_token_ids=prompt, sampling=bad)
    r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
    [chunk] = final_chunks(r, "so-bad")
    assert chunk.finish_reason == "error" and chunk.token_ids == []
    assert chunk.error.startswith("rejected by the engine: invalid structured output: ")
    [(_id, entry)] = [e for e in r.xrange(KEYS.dlq) if e[1][b"request_id"] == b"so-bad"]
    assert entry[b"reason"].decode() == chunk.error
    assert "so-bad" not in decode.active
