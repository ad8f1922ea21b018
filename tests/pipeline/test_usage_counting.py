"""Usage accounting on a real Valkey: the step script that ends a request counts it (per shard,
hour hash and total hash), once under a repeated step, never for a fenced consumer's step; the
readers sum every shard; the ingress's /metrics exposition of the counters."""

from __future__ import annotations

from redis.cluster import RedisCluster

from kvrelay.core.enums import RequestStatus
from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk, frame
from kvrelay.core.record import RequestRecord
from kvrelay.core.usage import USAGE_TTL_S, Usage, account, period_start
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.streams import StepStatus, StepWrite, Streams, WriteMode
from kvrelay.pipeline.queue.usage import hours, read_period, read_total_sync
from kvrelay.pipeline.server.usage_metrics import exposition
from tests.pipeline.test_streams import KEYS, P, make, step
from tests.queue_state import ValkeyClock, expires_at

ALICE = account("alice", "acme", "smol")


def submit(r, rid: str, prompt: int = 5, cached: int = 0, **fields) -> str:
    """What the submit script leaves: the record (with its account), progress and the entry."""
    record = RequestRecord(status=RequestStatus.QUEUED, model="smol", prompt_tokens=prompt,
                           cached_tokens=cached, **fields)  # fmt: skip
    r.hset(KEYS.request(rid), mapping=record.changes())
    r.hset(KEYS.progress, rid, new_progress(""))
    task = PrefillTask(request_id=rid, prompt_token_ids=[1] * prompt, sampling={})
    return r.xadd(P, {MESSAGE_FIELD: task.encode()}).decode()


def admit_all(s) -> dict[str, str]:
    """Read and admit every waiting entry: request id -> entry id."""
    entries = s.read(P, PREFILL_GROUP, 100, None)
    ids = {PrefillTask.decode(e.payload).request_id: e.entry_id for e in entries}
    s.admit([(eid, rid, 0, {}) for rid, eid in ids.items()])
    return ids


def end(eid: str, rid: str, tokens: list[int], prompt: int, cached: int, status=None):
    """The final write of a request as the worker sends it (workers/base.py `_emit`)."""
    usage = {"prompt_tokens": prompt, "completion_tokens": len(tokens), "cached_tokens": cached}
    chunk = TokenChunk(0, tokens, finish_reason="stop", usage=usage)
    fields = RequestRecord(status=status or RequestStatus.FINISHED, finish_reason="stop",
                           cached_tokens=cached, prompt_tokens=prompt).changes()  # fmt: skip
    write = StepWrite(eid, rid, chunk, WriteMode.DONE, req_fields=fields)
    write.history = frame(chunk.encode())
    return write


def counted(r, keys: Keys = KEYS) -> dict[str, int]:
    """The total hash of `keys`' shard as field -> count."""
    return {k.decode(): int(v) for k, v in r.hgetall(keys.usage_total).items()}


def hour_keys(r, keys: Keys = KEYS) -> list[str]:
    total = keys.usage_total
    return sorted(k.decode() for k in r.scan_iter(f"{{{keys.tag}}}:usage:*") if k.decode() != total)


def test_the_step_that_ends_a_request_counts_it_once_in_its_hour_and_total(r):
    a = make(r, "a")
    submit(r, "r1", prompt=5, account=ALICE)
    ids = admit_all(a)
    with ValkeyClock(r) as clock:
        assert step(a, end(ids["r1"], "r1", [7, 8, 9], 5, 2)).status == StepStatus.OK
    want = {
        f"requests {ALICE}": 1,
        f"prompt_tokens {ALICE}": 5,
        f"cached_tokens {ALICE}": 2,
        f"completion_tokens {ALICE}": 3,
    }
    assert counted(r) == want
    [hour] = hour_keys(r)
    assert hour in {KEYS.usage(period_start(clock.before / 1000)),
                    KEYS.usage(period_start(clock.after / 1000))}  # fmt: skip
    assert {k.decode(): int(v) for k, v in r.hgetall(hour).items()} == want
    assert expires_at(r, hour) in clock.window(USAGE_TTL_S)
    assert expires_at(r, KEYS.usage_total) == -1
    # the reply was lost: the same step (same number) again counts nothing
    assert a.step(end(ids["r1"], "r1", [7, 8, 9], 5, 2), repeat=True).status == (
        StepStatus.REPEATED
    )
    assert counted(r) == want
    [u] = read_period(r, KEYS, clock.before / 1000 - 1, clock.after / 1000 + 1).values()
    assert (u.key, u.tenant, u.model) == ("alice", "acme", "smol")
    assert u.public() == {"key": "alice", "tenant": "acme", "model": "smol", **{
        "requests": 1, "prompt_tokens": 5, "cached_tokens": 2, "completion_tokens": 3,
        "failed_requests": 0, "failed_prompt_tokens": 0, "failed_cached_tokens": 0,
        "failed_completion_tokens": 0}}  # fmt: skip
    # an hour range that does not reach it reads nothing
    assert read_period(r, KEYS, clock.before / 1000 - 7200, clock.before / 1000 - 3600) == {}


def test_a_fenced_consumers_end_counts_nothing_and_the_claimants_counts_once(r):
    a, b = make(r, "a"), make(r, "b")
    submit(r, "r1", prompt=4, account=ALICE)
    ids = admit_all(a)
    r.hset(KEYS.consumers, "a", 0)  # a's lease is long past: b claims and fences it
    [claimed] = b.claim(P, PREFILL_GROUP, 10_000, 1)
    b.admit([(claimed.entry_id, "r1", 0, {})])
    assert step(a, end(ids["r1"], "r1", [1, 2], 4, 0)).status == StepStatus.FENCED
    assert counted(r) == {} and hour_keys(r) == []
    assert step(b, end(claimed.entry_id, "r1", [1, 2], 4, 0)).status == StepStatus.OK
    assert counted(r) == {f"requests {ALICE}": 1, f"prompt_tokens {ALICE}": 4,
                          f"completion_tokens {ALICE}": 2}  # fmt: skip


def test_choices_count_the_request_once_and_each_prompt_once_and_failures_apart(r):
    a = make(r, "a")
    # two prompts x best_of 2: choices q.0, q.1 (prompt 0, 3 tokens), q.2, q.3 (prompt 1, 6)
    for k, prompt in enumerate([3, 3, 6, 6]):
        submit(r, f"q.{k}", prompt=prompt, account=ALICE, per_prompt=2, parent="q")
    submit(r, "x", prompt=9)  # the producer client's: no account
    ids = admit_all(a)
    writes = [end(ids[f"q.{k}"], f"q.{k}", [1] * (k + 1), p, c)
              for k, (p, c) in enumerate([(3, 2), (3, 3), (6, 4), (6, 5)])]  # fmt: skip
    failed = end(ids["x"], "x", [4], 9, 1, status=RequestStatus.FAILED)
    assert step(a, *writes, failed).status == StepStatus.OK
    anonymous = '["","","smol"]'
    assert counted(r) == {
        f"requests {ALICE}": 1,
        f"prompt_tokens {ALICE}": 3 + 6,  # each prompt once, as the client's usage
        f"cached_tokens {ALICE}": 2 + 4,  # the first choice of each prompt's
        f"completion_tokens {ALICE}": 1 + 2 + 3 + 4,  # every choice generated
        f"failed_requests {anonymous}": 1,
        f"failed_prompt_tokens {anonymous}": 9,
        f"failed_cached_tokens {anonymous}": 1,
        f"failed_completion_tokens {anonymous}": 1,
    }


def test_each_shard_counts_in_its_own_keys_and_the_readers_sum_them(r):
    keys = Keys("t:", shards=2)
    one = keys.at(1)
    assert (one.usage(3600), one.usage_total) == ("{t.1}:usage:3600", "{t.1}:usage:total")
    assert keys.usage(3600) == "{t}:usage:3600"
    bob = account("bob", "acme", "smol")
    r.hset(keys.usage_total, f"requests {ALICE}", 2)
    r.hset(one.usage_total, mapping={f"requests {ALICE}": 3, f"prompt_tokens {bob}": 7})
    r.hset(one.usage(7200), f"completion_tokens {bob}", 4)
    r.hset(keys.usage(3600), mapping={f"completion_tokens {bob}": 5, "junk": 1})
    total = read_total_sync(r, keys)
    assert {d: (u.get("requests"), u.get("prompt_tokens")) for d, u in total.items()} == {
        ("alice", "acme", "smol"): (5, 0),
        ("bob", "acme", "smol"): (0, 7),
    }
    [bobs] = read_period(r, keys, 3600, 10_800).values()
    assert bobs.get("completion_tokens") == 9
    assert hours(3599, 7201) == [0, 3600, 7200] and hours(10, 10) == []


def shard_step(r, keys: Keys) -> None:
    """Request z queued, admitted and ended on `keys`' shard by consumer a."""
    s = Streams(r, keys, "a")
    s.ensure_group(keys.prefill_stream, PREFILL_GROUP)
    s.beat(keys.worker("a"), {"name": "a"}, 10)
    r.hset(keys.request("z"), mapping=RequestRecord(prompt_tokens=2, account=ALICE).changes())
    r.hset(keys.progress, "z", new_progress(""))
    task = PrefillTask(request_id="z", prompt_token_ids=[1, 2], sampling={})
    eid = r.xadd(keys.prefill_stream, {MESSAGE_FIELD: task.encode()}).decode()
    s.read(keys.prefill_stream, PREFILL_GROUP, 1, None)
    s.admit([(eid, "z", 0, {})])
    res = s.step(keys.prefill_stream, PREFILL_GROUP, keys.decode_stream,
                 [end(eid, "z", [3], 2, 0)], {}, 1)  # fmt: skip
    assert res.status == StepStatus.OK


def test_a_shard_ones_step_writes_its_usage_under_its_own_tag(r):
    keys = Keys("t:", shards=2).at(1)
    shard_step(r, keys)
    assert counted(r, keys)[f"prompt_tokens {ALICE}"] == 2
    assert len(hour_keys(r, keys)) == 1 and counted(r) == {}  # shard 0 has nothing


def test_on_a_cluster_the_usage_keys_share_the_step_scripts_slot(shared_cluster):
    r = RedisCluster.from_url(shared_cluster.url)
    try:
        keys = Keys("t:", shards=3)
        shard_step(r, keys.at(2))
        [u] = read_total_sync(r, keys).values()  # every shard's node asked
        assert (u.key, u.get("prompt_tokens"), u.get("completion_tokens")) == ("alice", 2, 1)
        now = r.time()[0]
        assert len(read_period(r, keys, now - 3600, now + 1)) == 1
    finally:
        r.close()


def test_metrics_export_one_series_per_field_and_account():
    u = Usage("alice", "acme", "smol")
    u.counts.update(requests=2, prompt_tokens=10, completion_tokens=4)
    text = exposition([u]).decode()
    labels = '{key="alice",model="smol",tenant="acme"}'
    for line in (
        f"kvrelay:tenant_requests_total{labels} 2.0",
        f"kvrelay:tenant_prompt_tokens_total{labels} 10.0",
        f"kvrelay:tenant_cached_tokens_total{labels} 0.0",
        f"kvrelay:tenant_completion_tokens_total{labels} 4.0",
        f"kvrelay:tenant_failed_requests_total{labels} 0.0",
    ):
        assert line in text.splitlines(), text
    assert exposition([]) == b""


def test_an_unreachable_valkey_leaves_the_series_out():
    import asyncio

    import redis.asyncio as aioredis

    from kvrelay.pipeline.server.usage_metrics import usage_exposition

    async def scrape() -> bytes:
        client = aioredis.Redis(port=1, socket_connect_timeout=0.2)
        try:
            return await usage_exposition(client, KEYS)
        finally:
            await client.aclose()

    assert asyncio.run(scrape()) == b""
