"""Workers on three pipeline shards (real SmolLM2 engine, real Valkey): a prefill worker that
serves shards 1 and 2 hands off within each request's shard to a decode worker serving all
three, and a consumer fenced on one shard rejoins that shard alone, its requests resumed
exactly once."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import DecodeTask, PrefillTask
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.config import WorkerConfig
from tests.queue_state import emitted_chunks, final_chunks, ids_on_every_shard, tokens_of

PREFIX = "lanes:"
KEYS = Keys(PREFIX, shards=3)
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LONG = {**GREEDY, "max_tokens": 40}
QUESTION = "Name a color."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.prefill import PrefillWorker
    from tests.conftest import ValkeyServer

    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    [short] = engine.generate([prompt], SamplingParams(**GREEDY))
    [long] = engine.generate([prompt], SamplingParams(**LONG))
    common = dict(redis_url=server.url, key_prefix=PREFIX, shards=3, heartbeat_s=0.2)
    common.update(metrics_port=-1, block_ms=20, lease_ms=1500)
    decode = DecodeWorker(WorkerConfig(name="lanes-d", **common), engine)
    prefill_engine = Engine(
        EngineConfig(kv_cache_bytes=32 << 20, num_threads=1), loaded=engine.loaded
    )
    prefill = PrefillWorker(
        WorkerConfig(name="lanes-p", serve_shards="1,2", **common), prefill_engine
    )
    threads = [threading.Thread(target=w.run, daemon=True) for w in (decode, prefill)]
    for thread in threads:
        thread.start()
    r = redis.Redis.from_url(server.url)
    yield r, decode, prefill, prompt, short.output_token_ids, long.output_token_ids
    for worker in (decode, prefill):
        worker.stop()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    server.stop()


def test_workers_serve_their_shards_and_hand_off_within_one(stack):
    r, decode, prefill, prompt, short, _ = stack
    assert (list(decode.lanes), list(prefill.lanes)) == ([0, 1, 2], [1, 2])
    for shard in (1, 2):
        rid = ids_on_every_shard("pf")[shard]
        task = PrefillTask(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY)
        r.xadd(KEYS.at(shard).prefill_stream, {MESSAGE_FIELD: task.encode()})
        assert tokens_of(final_chunks(r, KEYS, rid)) == short
        # handed off to its own shard's decode stream, read and finished there
        [group] = r.xinfo_groups(KEYS.at(shard).decode_stream)
        assert (group["entries-read"], group["pending"]) == (1, 0)
        assert [r.exists(k.out(rid)) for k in KEYS.all()] == [
            int(k.shard == shard) for k in KEYS.all()
        ]
    # shard 0 has no prefill worker: its task waits there, untouched
    rid = ids_on_every_shard("pf0")[0]
    task = PrefillTask(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY)
    r.xadd(KEYS.at(0).prefill_stream, {MESSAGE_FIELD: task.encode()})
    time.sleep(0.5)  # several of the prefill worker's reads
    [group] = r.xinfo_groups(KEYS.at(0).prefill_stream)
    assert (group["name"], group["entries-read"], group["lag"]) == (PREFILL_GROUP.encode(), None, 1)
    # each worker beats on every shard it serves (its lease there), published once
    assert [r.exists(k.worker("lanes-p")) for k in KEYS.all()] == [0, 1, 1]
    assert [r.exists(k.worker("lanes-d")) for k in KEYS.all()] == [1, 1, 1]


def test_a_consumer_fenced_on_one_shard_rejoins_that_shard_alone(stack):
    # shard 0: no prefill worker there, whose claim scan would drop the fenced decode consumer
    # from the shard's consumers hash before the decode worker claims its entry (claim.lua
    # reads one consumers hash for both streams; the entry then waits for the next prune)
    r, decode, _, prompt, _, long = stack
    one, two = decode.lanes[0], decode.lanes[2]
    old_one, old_two = one.consumer, two.consumer
    gen_one, gen_two = one.streams.generation, two.streams.generation
    rids = {shard: ids_on_every_shard("fence")[shard] for shard in (0, 2)}
    for shard, rid in rids.items():
        task = DecodeTask(request_id=rid, prompt_token_ids=prompt, sampling=LONG)
        r.xadd(KEYS.at(shard).decode_stream, {MESSAGE_FIELD: task.encode()})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(len(c.token_ids) for c in emitted_chunks(r, KEYS.at(0), rids[0])) >= 2:
            break
        time.sleep(0.005)
    r.set(KEYS.at(0).fence(old_one), "f")  # as a claim does when shard 0's lease ran out
    got = {shard: final_chunks(r, KEYS, rid) for shard, rid in rids.items()}
    for shard in (0, 2):
        assert tokens_of(got[shard]) == long
        assert [c.finish_reason for c in got[shard]].count("length") == 1
    # shard 0 came back as a new consumer; shard 2 kept its consumer and its requests
    assert one.consumer != old_one and one.streams.generation == gen_one + 1
    assert (two.consumer, two.streams.generation) == (old_two, gen_two)
    assert r.get(KEYS.at(0).fence(one.consumer)) not in (None, b"f")
    assert r.get(KEYS.at(2).fence(old_two)) not in (None, b"f")
    for shard in (0, 2):
        [group] = r.xinfo_groups(KEYS.at(shard).decode_stream)
        assert group["pending"] == 0
