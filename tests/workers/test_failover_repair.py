"""Workers repair what a failover lost: a real primary, a replica and 3 Sentinels
(`tests.sentinel_group`), real SmolLM2 workers on the `redis+sentinel://` URL. The replica is
stopped (SIGSTOP, its link closed) just before a worker's write, so that write reaches the
primary alone; the
primary is then SIGKILLed and the replica resumed and promoted without it (asynchronous
replication loses it). The worker notices (its next step finds the server's fence below its
last step, or its heartbeat a new server run_id) and writes again from memory what was lost:
a hand-off (the prefill entry still pending under it, no decode task), or token flushes (holes
in out:{id}). The request completes with the tokens of an undisturbed run, each index once,
finished by its length, not by its deadline."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, TokenChunk
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.queue.streams import WriteMode
from kvrelay.workers import emitter as emitter_module
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import emitted_chunks
from tests.sentinel_group import SentinelGroup

KEYS = Keys("fr:")
GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines():
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    prefill = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    decode = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    prompt = prefill.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about lighthouses."}]
    )
    [ref] = decode.generate([prompt], SamplingParams(**GREEDY))
    assert len(ref.output_token_ids) == GREEDY["max_tokens"]
    return prefill, decode, prompt, ref.output_token_ids


@pytest.fixture
def group(tmp_path):
    g = SentinelGroup(tmp_path, replicas=1, down_after_ms=500)
    g.start()
    yield g
    g.stop()


def config(group: SentinelGroup, name: str) -> WorkerConfig:
    return WorkerConfig(
        redis_url=group.url,
        key_prefix="fr:",
        name=name,
        lease_ms=3000,
        heartbeat_s=0.2,
        metrics_port=-1,
        block_ms=20,
    )


class Running:
    """A worker running on its own thread (`run`), stopped by `stop`."""

    def __init__(self, worker):
        self.worker = worker
        self.thread = threading.Thread(target=worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def lose_with_the_primary(group: SentinelGroup, worker, first, writes_lost: int):
    """Make the worker's steps from the first one `first(writes)` picks on reach the primary
    alone, until `writes_lost` steps `first` picks did; then the primary dies and the
    replica, resumed, is promoted without them. Returns what the fault saw."""
    streams = worker._first.streams
    real = streams.step
    seen = {"lost": 0, "lost_indices": [], "steps": 0}

    def step(stream, group_name, next_stream, writes, *args, **kwargs):
        picked = first(writes)
        if (seen["steps"] == 0 and not picked) or seen["lost"] >= writes_lost:
            return real(stream, group_name, next_stream, writes, *args, **kwargs)
        if seen["steps"] == 0:
            primary = group.client(0)
            assert primary.wait(1, 5000) == 1  # everything before it is on the replica
            group.signal("node-1", signal.SIGSTOP)
            # the link closed too: a stopped replica's socket would still take in the writes
            # (the kernel buffers them), and it would read them once resumed
            assert primary.client_kill_filter(_type="replica") == 1
            primary.close()
        res = real(stream, group_name, next_stream, writes, *args, **kwargs)
        seen["steps"] += 1
        seen["lost"] += picked
        seen["lost_indices"] += [w.chunk.index for w in writes if w.mode != WriteMode.EMIT]
        if seen["lost"] == writes_lost:
            group.signal("node-0", signal.SIGKILL)
            group.signal("node-1", signal.SIGCONT)
        return res

    streams.step = step
    return seen


def final_history(r: redis.Redis, request_id: str, timeout: float = 120) -> list[TokenChunk]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = emitted_chunks(r, KEYS, request_id)
        except redis.ConnectionError:
            got = []
        if got and got[-1].finish_reason is not None:
            return got
        assert time.monotonic() < deadline, f"{request_id} did not end: {got}"
        time.sleep(0.05)


def assert_whole(chunks: list[TokenChunk], tokens: list[int], reason: str) -> None:
    """`chunks` hold `tokens` once each, in order: every chunk starts where the one before
    ended, the last one says `reason`."""
    at = 0
    for chunk in chunks:
        assert chunk.index == at, [(c.index, c.token_ids) for c in chunks]
        at += len(chunk.token_ids)
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert chunks[-1].finish_reason == reason


def test_a_hand_off_lost_with_the_primary_is_sent_again_and_the_request_completes(group, engines):
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.prefill import PrefillWorker

    prefill_engine, decode_engine, prompt, ref = engines
    prefill = PrefillWorker(config(group, "prefill-f"), prefill_engine)
    seen = lose_with_the_primary(
        group, prefill, lambda ws: any(w.mode == WriteMode.HANDOFF for w in ws), 1
    )
    running = [Running(prefill)]
    try:
        r = redis.Redis(port=group.node_ports[0])
        task = PrefillTask(
            request_id="ho-1",
            prompt_token_ids=prompt,
            sampling=GREEDY,
            deadline=time.time() + 600,  # a stall would end in "timeout"
        )
        r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
        assert r.wait(1, 5000) == 1
        r.close()
        group.wait(lambda: seen["lost"] == 1, "the hand-off written to the primary alone", 60)
        group.wait(lambda: group.primary_port() == group.node_ports[1], "a promotion", 60)
        promoted = redis.Redis(port=group.node_ports[1])
        # the worker sends the hand-off again: one decode task, the prefill entry acked
        group.wait(lambda: promoted.xlen(KEYS.decode_stream) >= 1, "the hand-off again", 60)
        assert promoted.xpending(KEYS.prefill_stream, PREFILL_GROUP)["pending"] == 0
        assert prefill.emitter.repairs >= 1
        running.append(Running(DecodeWorker(config(group, "decode-f"), decode_engine)))
        chunks = final_history(promoted, "ho-1")
        assert_whole(chunks, ref, "length")
        [(_, fields)] = promoted.xrange(KEYS.decode_stream)
        assert DecodeTask.decode(fields[MESSAGE_FIELD]).output_token_ids == ref[:1]
        group.wait(
            lambda: promoted.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0,
            "the decode entry acked",
        )
        assert promoted.hget(KEYS.request("ho-1"), "status") == b"finished"
        promoted.close()
    finally:
        for one in running:
            one.stop()


def test_token_flushes_lost_with_the_primary_are_written_again(group, engines, monkeypatch):
    from kvrelay.workers.decode import DecodeWorker

    # a flush every 2 chunks: the 3 flushes the fault loses hold 6 tokens of out:{id}
    monkeypatch.setattr(emitter_module, "FLUSH_CHUNKS", 2)
    _, decode_engine, prompt, ref = engines
    decode = DecodeWorker(config(group, "decode-g"), decode_engine)

    def flush_after_4(writes) -> bool:
        return any(w.mode == WriteMode.FLUSH and w.chunk.index >= 4 for w in writes)

    seen = lose_with_the_primary(group, decode, flush_after_4, 3)
    running = Running(decode)
    try:
        r = redis.Redis(port=group.node_ports[0])
        task = DecodeTask(
            request_id="fl-1",
            prompt_token_ids=prompt,
            sampling=GREEDY,
            deadline=time.time() + 600,
        )
        r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
        assert r.wait(1, 5000) == 1
        r.close()
        group.wait(lambda: seen["lost"] == 3, "3 steps written to the primary alone", 60)
        promoted = redis.Redis(port=group.node_ports[1])
        chunks = final_history(promoted, "fl-1")
        assert_whole(chunks, ref, "length")
        # the lost flushes were flushes of chunks past index 4, below the end
        assert len(seen["lost_indices"]) >= 3
        assert min(seen["lost_indices"]) >= 4 and max(seen["lost_indices"]) < len(ref) - 1
        assert decode.emitter.repairs >= 1
        group.wait(
            lambda: promoted.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0,
            "the decode entry acked",
        )
        promoted.close()
    finally:
        running.stop()


def test_an_end_lost_with_the_primary_is_written_again(group, engines):
    from kvrelay.workers.decode import DecodeWorker

    _, decode_engine, prompt, ref = engines
    decode = DecodeWorker(config(group, "decode-h"), decode_engine)
    seen = lose_with_the_primary(
        group, decode, lambda ws: any(w.mode == WriteMode.DONE for w in ws), 1
    )
    running = Running(decode)
    try:
        r = redis.Redis(port=group.node_ports[0])
        task = DecodeTask(request_id="end-1", prompt_token_ids=prompt, sampling=GREEDY)
        r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: task.encode()})
        assert r.wait(1, 5000) == 1
        r.close()
        group.wait(lambda: seen["lost"] == 1, "the end written to the primary alone", 60)
        group.wait(lambda: group.primary_port() == group.node_ports[1], "a promotion", 60)
        promoted = redis.Redis(port=group.node_ports[1])
        # nothing held any more: the heartbeat notices the new server, the end goes again
        chunks = final_history(promoted, "end-1")
        assert_whole(chunks, ref, "length")
        group.wait(
            lambda: promoted.xpending(KEYS.decode_stream, DECODE_GROUP)["pending"] == 0,
            "the decode entry acked",
        )
        assert promoted.hget(KEYS.request("end-1"), "status") == b"finished"
        assert decode.emitter.repairs >= 1
        promoted.close()
    finally:
        running.stop()
