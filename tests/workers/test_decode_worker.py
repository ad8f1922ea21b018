"""DecodeWorker on the real SmolLM2 engine and a real Valkey: batching, resume after a claim,
fencing of the stale owner, cancellation."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import redis

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, Keys
from kvrelay.core.messages import DecodeTask, TokenChunk, frame
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.queue.progress import Progress
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, Streams
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import (
    ValkeyClock,
    emitted_chunks,
    expires_at,
    final_chunks,
    set_cancelled,
    tokens_of,
)

KEYS = Keys("dw:")
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
QUESTIONS = ["Name a color.", "What is 2+2? Answer briefly.", "Say hello in French."]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from tests.conftest import ValkeyServer

    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    refs = engine.generate(prompts, SamplingParams(**GREEDY))
    config = WorkerConfig(
        redis_url=server.url,
        key_prefix="dw:",
        name="decode-t",
        lease_ms=1500,
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
    )
    worker = DecodeWorker(config, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    r = redis.Redis.from_url(server.url)
    yield r, worker, prompts, refs
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()
    server.stop()


def submit(r, request_id: str, prompt: list[int], outputs: list[int], **fields) -> str:
    task = DecodeTask(
        request_id=request_id,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
        sampling=fields.pop("sampling", GREEDY),
        **fields,
    )
    return r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()}).decode()


def ghost(r, consumer: str) -> Streams:
    """A worker's streams that beat once (registered in the fence hash), then go silent."""
    streams = Streams(r, KEYS, consumer)
    streams.beat(KEYS.worker(consumer), {"name": consumer}, 1)
    return streams


_STEPS: dict[str, int] = {}  # consumer -> its last step number


def ghost_step(ghost: Streams, write: StepWrite) -> StepStatus:
    number = _STEPS[ghost.consumer] = _STEPS.get(ghost.consumer, 0) + 1
    stream = KEYS.decode_stream
    return ghost.step(stream, DECODE_GROUP, stream, [write], {}, number).status


def emitted(r, request_id: str) -> int:
    return sum(len(c.token_ids) for c in emitted_chunks(r, KEYS, request_id))


def test_batch_matches_generate(stack):
    r, _, prompts, refs = stack
    clock = ValkeyClock(r).start()
    for i, prompt in enumerate(prompts):  # decode prefills locally (ingress routed it here)
        submit(r, f"local{i}", prompt, [], prefilled=False)
    for i, prompt in enumerate(prompts):  # after a prefill worker emitted token 0
        first = TokenChunk(0, refs[i].output_token_ids[:1]).encode()
        r.xadd(KEYS.out(f"pre{i}"), {MESSAGE_FIELD: frame(first)})  # the hand-off flushes
        r.hset(KEYS.progress, f"pre{i}", Progress(emitted=1, hist=1).encode())
        submit(
            r, f"pre{i}", prompt, refs[i].output_token_ids[:1], prefilled=True, num_cached_tokens=32
        )
    for i, ref in enumerate(refs):
        local = final_chunks(r, KEYS, f"local{i}")
        assert tokens_of(local) == ref.output_token_ids
        assert "".join(c.text for c in local) == ref.text_delta
        assert local[-1].finish_reason == "length"
        # the reference run left the prompt's full pages in the device prefix cache
        assert local[-1].usage == {
            "prompt_tokens": len(prompts[i]),
            "completion_tokens": 8,
            "cached_tokens": len(prompts[i]) // 16 * 16,
        }
        pre = final_chunks(r, KEYS, f"pre{i}")
        assert tokens_of(pre) == ref.output_token_ids
        assert pre[-1].usage["cached_tokens"] == 32  # the prefill worker's report is kept
    clock.stop()
    assert r.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0
    assert expires_at(r, KEYS.out("local0")) in clock.window(600)  # from its last write
    assert r.hget(KEYS.request("local0"), "status") == b"finished"


def test_claimed_request_resumes_without_gaps_or_duplicates(stack):
    r, worker, prompts, refs = stack
    task = DecodeTask(
        request_id="resume",
        prompt_token_ids=prompts[1],
        sampling=GREEDY,
        output_token_ids=refs[1].output_token_ids[:1],
        prefilled=True,
    )
    pipe = r.pipeline(transaction=True)  # the ghost gets the entry before the live worker can
    pipe.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
    pipe.xreadgroup(DECODE_GROUP, "ghost", {KEYS.decode_stream: ">"}, count=1)
    eid_raw, [(_stream, [(got, _fields)])] = pipe.execute()
    eid = eid_raw.decode()
    assert got.decode() == eid
    dead = ghost(r, "ghost")  # a worker that dies after emitting three tokens
    done = refs[1].output_token_ids[:3]
    r.xadd(KEYS.out("resume"), {MESSAGE_FIELD: frame(TokenChunk(0, done[:1]).encode())})
    r.hset(KEYS.progress, "resume", Progress(emitted=1, hist=1).encode())
    dead.admit([(eid, "resume", 1, {})])
    em = StepWrite(eid, "resume", TokenChunk(1, done[1:]))
    assert ghost_step(dead, em) == StepStatus.OK
    r.hset(KEYS.consumers, "ghost", 0)  # its last beat is long past
    got = final_chunks(r, KEYS, "resume")
    assert tokens_of(got) == refs[1].output_token_ids
    assert [c.index for c in got[:2]] == [0, 1] and got[2].index == 3
    # the ghost's chunks carried no text (held back, say): the resumed worker sends all of it
    assert "".join(c.text for c in got) == refs[1].text_delta
    # the presumed-dead owner wakes up: the claim fenced it, its next step is refused
    em.chunk = TokenChunk(3, refs[1].output_token_ids[3:4])
    assert ghost_step(dead, em) == StepStatus.FENCED
    assert tokens_of(final_chunks(r, KEYS, "resume")) == refs[1].output_token_ids


def cancelled_after(r, request_id: str, prompt: list[int], tokens: int) -> list[TokenChunk]:
    """A long greedy request cancelled once `tokens` of it were emitted: all its chunks."""
    submit(r, request_id, prompt, [], sampling={**GREEDY, "max_tokens": 200})
    deadline = time.monotonic() + 60
    while emitted(r, request_id) < tokens and time.monotonic() < deadline:
        time.sleep(0.01)
    set_cancelled(r, KEYS, request_id)
    return final_chunks(r, KEYS, request_id)


def test_cancel_mid_request(stack):
    r, _, prompts, _ = stack
    got = cancelled_after(r, "stopme", prompts[0], 2)
    assert got[-1].finish_reason == "cancelled" and got[-1].token_ids == []
    n = len(tokens_of(got))
    assert 2 <= n < 200 and got[-1].usage["completion_tokens"] == n
    assert r.hget(KEYS.request("stopme"), "status") == b"cancelled"
    assert r.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0


@contextlib.contextmanager
def stream_interval(worker, seconds: float):
    """The worker's emitter holding further tokens for `seconds` (as `stream_interval_ms`)."""
    [lane] = worker.lanes.values()
    lane.emitter.interval_s = seconds
    try:
        yield
    finally:
        lane.emitter.interval_s = 0.0


def test_with_a_stream_interval_the_first_token_and_the_end_go_at_once_and_hold_the_rest(stack):
    r, worker, prompts, refs = stack
    ref = refs[1].output_token_ids
    with stream_interval(worker, 600.0):  # longer than the test: only first chunks and ends go
        submit(r, "held", prompts[1], [], prefilled=False)
        got = final_chunks(r, KEYS, "held")
    assert tokens_of(got) == ref
    assert [len(c.token_ids) for c in got] == [1, len(ref) - 1]
    assert got[-1].finish_reason == "length" and got[-1].usage["completion_tokens"] == len(ref)


def test_a_cancel_is_read_while_tokens_are_held(stack):
    r, worker, prompts, _ = stack
    with stream_interval(worker, 600.0):
        got = cancelled_after(r, "heldstop", prompts[0], 1)
    n = len(tokens_of(got))
    assert got[0].token_ids and got[-1].finish_reason == "cancelled"
    assert 1 <= n < 200 and got[-1].usage["completion_tokens"] == n
    assert r.hget(KEYS.request("heldstop"), "status") == b"cancelled"


def test_many_claims_with_progress_between_are_churn_not_poison(stack):
    r, _, prompts, refs = stack
    ref = refs[2].output_token_ids
    task = DecodeTask(
        request_id="churn", prompt_token_ids=prompts[2], sampling=GREEDY,
        output_token_ids=ref[:1], prefilled=True,
    )  # fmt: skip
    pipe = r.pipeline(transaction=True)  # the ghost gets the entry before the live worker can
    pipe.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
    pipe.xreadgroup(DECODE_GROUP, "ghost2", {KEYS.decode_stream: ">"}, count=1)
    eid = pipe.execute()[0].decode()
    r.hset(KEYS.request("churn"), mapping={"status": "decoding"})
    r.xadd(KEYS.out("churn"), {MESSAGE_FIELD: frame(TokenChunk(0, ref[:1]).encode())})
    r.hset(KEYS.progress, "churn", Progress(emitted=1, hist=1).encode())
    dead = ghost(r, "ghost2")  # holders that emit two tokens, then are killed
    dead.admit([(eid, "churn", 1, {})])
    assert ghost_step(dead, StepWrite(eid, "churn", TokenChunk(1, ref[1:3]))) == StepStatus.OK
    for _ in range(6):  # claimed by six more holders: 7 deliveries, more than max_deliveries
        r.xclaim(KEYS.decode_stream, DECODE_GROUP, "ghost2", 0, [eid])
    r.hset(KEYS.consumers, "ghost2", 0)
    got = final_chunks(r, KEYS, "churn")
    assert tokens_of(got) == ref and got[-1].finish_reason == "length"
    rec = r.hmget(KEYS.request("churn"), "status", "claim_emitted", "claim_delivery")
    assert rec == [b"finished", b"3", b"8"]  # progress seen at the 8th delivery: no strike
    assert [f[b"request_id"] for _, f in r.xrange(KEYS.dlq)].count(b"churn") == 0


def test_a_fenced_worker_drops_its_requests_rejoins_and_resumes_them_exactly_once(stack):
    r, worker, prompts, _ = stack
    sampling = {**GREEDY, "max_tokens": 40}
    submit(r, "fence-ref", prompts[2], [], sampling=sampling)
    ref = tokens_of(final_chunks(r, KEYS, "fence-ref"))
    assert len(ref) == 40
    old = worker.consumer
    submit(r, "fenced", prompts[2], [], sampling=sampling)
    deadline = time.monotonic() + 60
    while emitted(r, "fenced") < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    r.set(KEYS.fence(old), "f")  # as a claim does when the worker stalled past its lease
    got = final_chunks(r, KEYS, "fenced")
    # the next step was refused: the worker came back as a new consumer, its old entry was
    # claimed after the lease (by itself, the only worker) and resumed where it stopped
    assert worker.consumer != old and worker.streams.generation >= 1
    assert tokens_of(got) == ref and got[-1].finish_reason == "length"
    assert [c.finish_reason for c in got].count("length") == 1
    assert r.get(KEYS.fence(worker.consumer)) not in (None, b"f")
    assert r.hget(KEYS.request("fenced"), "status") == b"finished"
    assert r.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0


def test_an_idle_worker_learns_it_was_fenced_from_its_heartbeat(stack):
    r, worker, prompts, refs = stack
    old = worker.consumer
    r.set(KEYS.fence(old), "f")  # claimed from while it held nothing (it steps no more)
    deadline = time.monotonic() + 30
    while (
        worker.consumer == old or r.get(KEYS.fence(worker.consumer)) is None
    ) and time.monotonic() < deadline:
        time.sleep(0.01)  # rejoined, then registered by its first beat
    assert worker.consumer != old
    assert r.get(KEYS.fence(old)) == b"f" and r.get(KEYS.fence(worker.consumer)) == b"0"
    submit(r, "after-fence", prompts[0], [])
    assert tokens_of(final_chunks(r, KEYS, "after-fence")) == refs[0].output_token_ids
