"""PrefillWorker on the real SmolLM2 engine and Valkey: hand-off, poison, deadlines, drain."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import ValkeyClock, emitted_chunks, expires_at, progress, set_cancelled

KEYS = Keys("pw:")
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.prefill import PrefillWorker
    from tests.conftest import ValkeyServer

    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    [ref] = engine.generate([prompt], SamplingParams(**GREEDY))
    config = WorkerConfig(
        redis_url=server.url,
        key_prefix="pw:",
        name="prefill-t",
        lease_ms=1500,
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
    )
    worker = PrefillWorker(config, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    r = redis.Redis.from_url(server.url)
    yield r, worker, prompt, ref
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()
    server.stop()


def submit(r, request_id: str, prompt: list[int], **fields) -> bytes:
    """The task's stream entry id (its first part: when Valkey queued it, in unix ms)."""
    task = PrefillTask(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=fields.pop("sampling", GREEDY),
        **fields,
    )
    return r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})


def chunks(r, request_id: str, want: int = 1, timeout: float = 60) -> list[TokenChunk]:
    deadline = time.monotonic() + timeout
    while True:
        got = emitted_chunks(r, KEYS, request_id)
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def decode_tasks(r) -> dict[str, DecodeTask]:
    tasks = [DecodeTask.decode(f[MESSAGE_FIELD]) for _, f in r.xrange(KEYS.decode_stream)]
    return {t.request_id: t for t in tasks}


def test_handoff_emits_first_token_and_decode_task(stack, capsys):
    r, worker, prompt, ref = stack
    queued = submit(r, "h1", prompt, arrival_time=1.5, cache_salt="")
    [chunk] = chunks(r, "h1")
    assert (chunk.index, chunk.token_ids, chunk.finish_reason) == (
        0,
        ref.output_token_ids[:1],
        None,
    )
    deadline = time.monotonic() + 10
    while "h1" not in decode_tasks(r) and time.monotonic() < deadline:
        time.sleep(0.02)
    task = decode_tasks(r)["h1"]
    assert task.prompt_token_ids == prompt and task.output_token_ids == ref.output_token_ids[:1]
    assert task.prefilled and task.arrival_time == 1.5 and task.sampling.max_tokens == 4
    assert task.num_stored_pages == len(prompt) // 16
    # the reference run filled the device prefix cache with this prompt's full pages
    assert task.num_cached_tokens == (len(prompt) // 16) * 16
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0
    rec = r.hgetall(KEYS.request("h1"))
    assert rec[b"status"] == b"decoding" and progress(r, KEYS, "h1").emitted == 1
    # admitted (unix seconds, in ms) after Valkey queued the entry, before the hand-off's write
    started, updated = float(rec[b"started"]), float(rec[b"updated"])
    assert int(queued.split(b"-")[0]) <= round(started * 1000) and started <= updated
    info = r.hgetall(KEYS.worker("prefill-t"))
    assert info[b"role"] == b"prefill" and info[b"model"] == b"smollm2-135m-instruct"
    # the kernels and KV pages it runs, shown by `kvrelay status` (KERNELS, KV)
    isa, kv = worker.engine.kernel_isa, str(worker.engine.kv_dtype).removeprefix("torch.")
    assert (info[b"kernel_isa"].decode(), info[b"kv_dtype"].decode()) == (isa, kv)
    assert info[b"attention"].decode() == worker.engine.attention_precision
    # its start-up (`kvrelay status` START): this process's age when the worker was built
    from kvrelay.workers.base import process_age

    age = process_age()
    assert age is not None and 0 < float(info[b"startup_s"]) <= age
    # auto: an fp32 model on CPU pages bf16 where the C++ kernels run; on CUDA, the model's bf16
    on_cpu = worker.engine.loaded.device.type == "cpu"
    assert kv == ("bfloat16" if isa or not on_cpu else "float32")
    from kvrelay.cli.main import main

    capsys.readouterr()
    assert main(["status", "--redis-url", worker.config.redis_url, "--key-prefix", "pw:"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefill-t")]
    short = {"bfloat16": "bf16", "float32": "fp32"}[kv]
    assert info[b"speculation"] == b"ngram"  # auto without a draft model
    attn = worker.engine.attention_precision
    assert row.endswith(f"s  {isa or '-':<9}{short:<6}{attn:<6}{'ngram':<7}ok")
    assert b'"page_size": 16' in r.hget(KEYS.models, "smollm2-135m-instruct")


def test_first_token_finish_gets_final_chunk(stack):
    r, _, prompt, ref = stack
    with ValkeyClock(r) as clock:
        submit(r, "one", prompt, sampling={"max_tokens": 1, "temperature": 0.0})
        [chunk] = chunks(r, "one")
    assert (chunk.token_ids, chunk.finish_reason) == (ref.output_token_ids[:1], "length")
    assert chunk.usage["prompt_tokens"] == len(prompt) and chunk.usage["completion_tokens"] == 1
    assert "one" not in decode_tasks(r)
    assert expires_at(r, KEYS.out("one")) in clock.window(600)


def test_poison_entries_go_to_dlq_and_worker_keeps_serving(stack):
    r, _, prompt, ref = stack
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: b"\x93not a task"})
    r.xadd(KEYS.prefill_stream, {b"other": b"field"})
    submit(r, "badtok", [1, 999999])
    submit(r, "after", prompt, sampling={"max_tokens": 1, "temperature": 0.0})
    [chunk] = chunks(r, "after")
    assert chunk.token_ids == ref.output_token_ids[:1]
    deadline = time.monotonic() + 10
    while r.xlen(KEYS.dlq) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(KEYS.dlq)]
    assert reasons[0].startswith("invalid prefill task:")
    assert reasons[1] == "entry has no 'm' field"
    assert reasons[2].startswith("rejected by the engine:") and "999999" in reasons[2]
    [err] = chunks(r, "badtok")
    assert (err.finish_reason, err.index) == ("error", 0) and "999999" in err.error
    assert r.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0


def test_a_suspect_runs_alone_and_says_so_and_its_neighbours_go_on(stack, caplog):
    r, worker, prompt, ref = stack
    caplog.set_level("INFO", logger="kvrelay.workers.base")
    task = PrefillTask(request_id="sus", prompt_token_ids=prompt, sampling=GREEDY)
    r.hset(KEYS.request("sus"), mapping={"status": "queued"})
    pipe = r.pipeline(transaction=True)  # a ghost takes it first, then dies (it never beats)
    pipe.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    pipe.xreadgroup(PREFILL_GROUP, "ghost-s", {KEYS.prefill_stream: ">"}, count=1)
    pipe.execute()
    r.hset(KEYS.consumers, "ghost-s", 0)
    for k in range(3):  # plain neighbours, queued beside the suspect
        submit(r, f"nb{k}", prompt)
    [first] = chunks(r, "sus")
    assert first.token_ids == ref.output_token_ids[:1]
    for k in range(3):
        assert [c.token_ids for c in chunks(r, f"nb{k}")] == [ref.output_token_ids[:1]]
    # its first holder counts as having run it (one strike); the claimant ran it alone and
    # recorded its delivery first, so a death there would have been the second strike
    rec = r.hmget(KEYS.request("sus"), "claim_strikes", "claim_seen", "claim_ran")
    assert rec == [b"1", b"2", b"2"]
    assert "request sus: a suspect (delivery 2), running alone" in caplog.text
    assert b"sus" not in [f[b"request_id"] for _, f in r.xrange(KEYS.dlq)]


def test_deadline_cancel_and_delivery_limit(stack):
    r, worker, prompt, _ = stack
    submit(r, "late", prompt, deadline=time.time() - 1)
    set_cancelled(r, KEYS, "gone")
    submit(r, "gone", prompt)
    [late] = chunks(r, "late")
    assert (late.index, late.finish_reason, late.error) == (
        0, "timeout", "the request passed its deadline"
    )  # fmt: skip
    # ended by the system at its deadline: failed with the reason, never "finished"
    rec = r.hmget(KEYS.request("late"), "status", "finish_reason", "error")
    assert rec == [b"failed", b"timeout", b"the request passed its deadline"]
    assert [(c.index, c.finish_reason) for c in chunks(r, "gone")] == [(0, "cancelled")]
    assert r.hget(KEYS.request("gone"), "status") == b"cancelled"
    # an entry redelivered max_deliveries (5) times without progress is dead-lettered
    task = PrefillTask(request_id="poison", prompt_token_ids=prompt, sampling=GREEDY)
    pipe = r.pipeline(transaction=True)  # a ghost consumer gets it before the live worker can
    pipe.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    pipe.xreadgroup(PREFILL_GROUP, "ghost", {KEYS.prefill_stream: ">"}, count=1)
    eid = pipe.execute()[0]
    for _ in range(4):  # each XCLAIM counts one more delivery
        r.xclaim(KEYS.prefill_stream, PREFILL_GROUP, "ghost", 0, [eid])
    r.hset(KEYS.consumers, "ghost", 0)  # the ghost never beats
    [err] = chunks(r, "poison", timeout=30)
    assert err.finish_reason == "error"
    assert (
        err.error
        == "delivered 6 times, 5 times its holder died running it without progress (limit 5)"
    )


def test_drain_stops_reading_until_undone(stack):
    r, worker, prompt, ref = stack
    r.hset(KEYS.worker("prefill-t"), "drain", 1)
    try:
        deadline = time.monotonic() + 10
        while not worker.heartbeat.draining and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # let a read that was already blocking return
        assert r.hget(KEYS.worker("prefill-t"), "draining") == b"1"
        submit(r, "drained", prompt, sampling={"max_tokens": 1, "temperature": 0.0})
        time.sleep(0.5)
        assert emitted_chunks(r, KEYS, "drained") == []
        [group] = r.xinfo_groups(KEYS.prefill_stream)
        assert group["lag"] == 1
    finally:
        r.hset(KEYS.worker("prefill-t"), "drain", 0)
    [chunk] = chunks(r, "drained")
    assert chunk.token_ids == ref.output_token_ids[:1]
