"""No request lost under churn: 2 prefill + 2 decode workers and the store node, a random one
SIGKILLed every ~1.5 s and Valkey restarted at least once, while streaming chat requests (greedy
and seeded sampling) run 8 at a time. Every request must end exactly as it did undisturbed.

Also: an entry that kills every worker that takes it still ends in the DLQ after a bounded
number of crashes, every interface reports the same failure for it, and the workers live on.

The load is a closed loop of 8 streams that keeps sending new requests for the whole churn
window (KVRELAY_CHAOS_S, default 40 s, and at least KVRELAY_CHAOS_REQUESTS, default 16), so the
kill schedule runs its course however fast the engine is; afterwards the same requests run
undisturbed (another cache_salt) as the reference.

Replay a schedule with KVRELAY_CHAOS_SEED=<printed seed>; a harsher manual run:
KVRELAY_CHAOS_S=300 KVRELAY_CHAOS_REQUESTS=80 (more kills and Valkey restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrelay.cli.up.sentinel_status import current_primary
from kvrelay.cli.up.topology import STANDBY_SUFFIX, ingress_programs
from kvrelay.core.keys import DECODE_GROUP, PREFILL_GROUP
from kvrelay.core.usage import UsageField
from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.queue.usage import read_total_sync
from tests.e2e.chaos_client import StreamResult, stream_chat
from tests.e2e.stack import MODEL, Stack

SEED = int(os.environ.get("KVRELAY_CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
MIN_REQUESTS = int(os.environ.get("KVRELAY_CHAOS_REQUESTS", "16"))
CHAOS_S = float(os.environ.get("KVRELAY_CHAOS_S", "40"))  # new requests start for this long
CONCURRENCY = 8
# uniform: ~1.5 s on average; KVRELAY_CHAOS_KILL_EVERY="0.5,1.0" for a harsher run
KILL_EVERY = os.environ.get("KVRELAY_CHAOS_KILL_EVERY", "1.0,2.0").split(",")
KILL_EVERY_S = (float(KILL_EVERY[0]), float(KILL_EVERY[-1]))
VALKEY_EVERY_S = float(os.environ.get("KVRELAY_CHAOS_VALKEY_EVERY", "40"))  # one Valkey kill per
# Manual runs of the other recovery paths: KVRELAY_CHAOS_STANDBY=1 (`up --standby`: a loaded
# standby per worker, both processes among the victims), KVRELAY_CHAOS_REPLICAS=N (`up
# --valkey-replicas N`: the Valkey victim is the current primary, a replica is promoted)
STANDBY = os.environ.get("KVRELAY_CHAOS_STANDBY", "") == "1"
REPLICAS = int(os.environ.get("KVRELAY_CHAOS_REPLICAS", "0"))
CHAOS_MAX_S = CHAOS_S + 60  # then the churn stops, so the last requests can finish
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
VICTIMS = (*WORKERS, *(f"{w}{STANDBY_SUFFIX}" for w in WORKERS if STANDBY), "store")
# The churn here (a kill every ~1.5 s among 5 processes whose restart takes 3-10 s on a loaded
# 2-core machine) is far above what the default strike limit (5) is set for, so the stacks run
# with the raised limit docs/reliability.md advises for such failure rates; the poison test
# checks that limit.
MAX_DELIVERIES = 8
CHAOS_ENV = {"KVRELAY_WORKER_MAX_DELIVERIES": str(MAX_DELIVERIES)}
TOPICS = ["a lighthouse", "the moon", "a small dog", "rain in the city", "an old clock",
          "the ocean", "a mountain road", "a library at night"]  # fmt: skip


# Long enough, and different from the first words on, that no request's prompt is mostly
# cached: more than the 64-token route threshold stays uncached, so requests go through the
# prefill workers and their hand-off. Each run has its own cache_salt for the same reason.
BRIEF = ("You write for a children's magazine that likes gentle rhymes, simple words, bright "
         "colours and happy endings. Keep every line short, avoid the names of real people or "
         "places, never use more than four lines for one stanza, and end with a line that "
         "makes a small child smile before going to sleep on a quiet evening. ")  # fmt: skip


# Ingresses behind the stack's one address (`kvrelay up --ingresses`): with 2 or more, every
# one but the first is among the victims too; its clients reconnect to the same URL (another
# ingress takes the connection) and resume with Last-Event-ID (docs/reliability.md).
INGRESSES = int(os.environ.get("KVRELAY_CHAOS_INGRESSES", "2"))


def ingress_victims(stack: Stack) -> tuple[str, ...]:
    """The stack's ingresses that may be killed: all but the first (none with one ingress)."""
    return tuple(ingress_programs(stack.state)[1:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    extra = ["--ingresses", str(INGRESSES), *(["--standby"] if STANDBY else [])]
    if REPLICAS:
        extra += ["--valkey-replicas", str(REPLICAS)]
    s = Stack(tmp_path_factory.mktemp("chaos"), prefill=2, decode=2, env=CHAOS_ENV,
              extra=extra)  # fmt: skip
    s.up(timeout=300)
    yield s
    s.down()


def chat_body(i: int, salt: str = "") -> dict:
    """Request i: half greedy, half seeded sampling; varied lengths, some may stop early."""
    content = f"Poem number {i} is about {TOPICS[i % 8]}. {BRIEF}Write it now."
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24 + (i * 5) % 41,
    }
    if salt:  # an empty cache_salt is refused (400): no salt is the field left out
        body["cache_salt"] = salt
    if i % 2:
        body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
    else:
        body.update(temperature=0.0)
    return body


def run_all(
    stack: Stack, tag: str, indices: list[int], body: Callable[[int, str], dict] = chat_body
) -> dict[int, StreamResult]:
    """Requests `indices` (`body(i, salt)` each), 8 at a time."""
    with httpx.Client() as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = {
            i: pool.submit(stream_chat, client, stack.url, body(i, tag), f"{tag}-{SEED}-{i}")
            for i in indices
        }
        return {i: f.result() for i, f in futures.items()}


def run_for(
    stack: Stack,
    tag: str,
    seconds: float,
    min_requests: int,
    done: Callable[[], bool] = lambda: True,
    body: Callable[[int, str], dict] = chat_body,
) -> dict[int, StreamResult]:
    """A closed loop of 8 streams sending requests 0, 1, 2, ... until `seconds` have passed,
    at least `min_requests` were sent and `done()` says so; waits for every request to end."""
    results: dict[int, StreamResult] = {}
    lock, counter, t0 = threading.Lock(), iter(range(1 << 30)), time.monotonic()

    def stream() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    i = next(counter)
                    if time.monotonic() - t0 > seconds and i >= min_requests and done():
                        return
                results[i] = stream_chat(client, stack.url, body(i, tag), f"{tag}-{SEED}-{i}")

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for f in [pool.submit(stream) for _ in range(CONCURRENCY)]:
            f.result()
    return results


class Chaos:
    """Kills a random running victim every ~1.5 s and Valkey at random times, from one seed,
    for at least `min_kills` kills (Valkey among them) however slowly victims restart; new
    requests start for `chaos_s` seconds, the churn stops `CHAOS_MAX_S - CHAOS_S` after."""

    def __init__(
        self,
        stack: Stack,
        seed: int,
        min_kills: int,
        victims: tuple[str, ...] = VICTIMS,
        chaos_s: float = CHAOS_S,
    ):
        self.stack, self.rng, self.min_kills = stack, random.Random(seed), min_kills
        self.victims, self.max_s = victims, chaos_s + CHAOS_MAX_S - CHAOS_S
        self.valkeys = stack.valkeys  # a cluster: one of its nodes each time
        self.kills: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        # one Valkey restart per ~40 s of churn, the first early on
        self.valkey_at = sorted(self.rng.uniform(2, 5) + VALKEY_EVERY_S * k
                                for k in range(max(1, int(chaos_s // VALKEY_EVERY_S))))  # fmt: skip

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.rng.uniform(*KILL_EVERY_S)):
            now = time.monotonic() - t0
            if now > self.max_s:
                return
            states = self.stack.sup.status()
            victim = self.rng.choice(self.victims)
            if self.valkey_at and now >= self.valkey_at[0]:
                self.valkey_at.pop(0)
                victim = self.rng.choice(self.valkeys)
                if "sentinel" in self.stack.state:  # the primary: a replica is promoted
                    victim = current_primary(self.stack.state) or victim
            state, pid = states.get(victim, ("", None))
            if state == "RUNNING" and pid:  # one still starting is not killed again
                os.kill(pid, 9)
                self.kills.append((round(now, 1), victim))

    def enough(self) -> bool:
        """The churn this run asked for happened (or the churn has stopped: CHAOS_MAX_S)."""
        kills = list(self.kills)
        valkey = any(v.startswith("valkey") for _, v in kills)
        return (valkey and len(kills) >= self.min_kills) or not self.thread.is_alive()

    def __enter__(self) -> Chaos:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def test_no_request_lost_under_churn(stack):
    churn_and_compare(stack, VICTIMS + ingress_victims(stack))


def churn_and_compare(
    stack: Stack,
    victims: tuple[str, ...] = VICTIMS,
    body: Callable[[int, str], dict] = chat_body,
    chaos_s: float = CHAOS_S,
    chaos: type[Chaos] = Chaos,
) -> tuple[dict[int, StreamResult], list[tuple[float, str]]]:
    """Requests (`body(i, salt)`) under churn (`victims` and Valkey killed by `chaos`) end
    exactly as undisturbed; returns them and the kills (seconds into the churn, program)."""
    print(f"\nchaos seed {SEED} (replay: KVRELAY_CHAOS_SEED={SEED}), {chaos_s:.0f} s of churn")
    counted_before = usage_counted(stack)
    t0 = time.monotonic()
    with chaos(stack, SEED, int(chaos_s / 4), victims, chaos_s) as churn:
        got = run_for(stack, "chaos", chaos_s, MIN_REQUESTS, churn.enough, body)
    t_chaos = time.monotonic() - t0
    ref = run_all(stack, "ref", sorted(got), body)  # undisturbed: nothing is killed any more
    t_ref = time.monotonic() - t0 - t_chaos
    for i, r in ref.items():
        assert r.error is None and r.finish_reason and not r.index_errors, (i, r, stack.logs())
    kills = churn.kills
    identical = sum(
        (g.text, g.finish_reason, g.num_tokens) == (ref[i].text, ref[i].finish_reason,
                                                    ref[i].num_tokens)
        for i, g in got.items()
    )  # fmt: skip
    print(
        f"chaos {t_chaos:.0f}s, reference {t_ref:.0f}s; kills {len(kills)} "
        f"(valkey {sum(v.startswith('valkey') for _, v in kills)}): {kills}; identical "
        f"{identical}/{len(got)}; retries {sum(g.retries for g in got.values())}, "
        f"reattaches {sum(g.reattaches for g in got.values())}"
    )
    # the churn ran its course (new requests kept coming until it had): at least one kill per
    # 4 s of the window, Valkey among them; only a churn cut off at CHAOS_MAX_S falls short
    assert any(v.startswith("valkey") for _, v in kills) and len(kills) >= churn.min_kills, kills
    for i, g in got.items():
        assert not g.index_errors, (i, g.index_errors)
        assert g.error is None, (i, g.error)
        assert (g.text, g.finish_reason) == (ref[i].text, ref[i].finish_reason), i
    assert identical == len(got)
    assert sum(stack.redis.xlen(keys.dlq) for keys in stack.keys.all()) == 0
    # usage counted exactly once per request whatever was killed: every account's counters
    # moved by the sum of the usage its clients received (no API keys: one account a model)
    received: dict[tuple[str, str, str], list[int]] = {}
    for g in [*got.values(), *ref.values()]:
        assert g.usage is not None, g
        counts = received.setdefault(("", "", g.model), [0, 0, 0, 0])
        u = g.usage
        for k, value in enumerate((1, u["prompt_tokens"], u["prompt_tokens_details"]
                                   ["cached_tokens"], u["completion_tokens"])):  # fmt: skip
            counts[k] += value
    after = usage_counted(stack)
    moved = {a: [x - y for x, y in zip(after[a], counted_before.get(a, [0] * 4), strict=True)]
             for a in after}  # fmt: skip
    assert {a: c for a, c in moved.items() if any(c)} == received
    return got, kills


def usage_counted(stack: Stack) -> dict[tuple[str, str, str], list[int]]:
    """Every account's [requests, prompt, cached, completion] counted so far, all shards."""
    return {
        dims: [u.get(f) for f in (UsageField.REQUESTS, UsageField.PROMPT_TOKENS,
                                  UsageField.CACHED_TOKENS, UsageField.COMPLETION_TOKENS)]
        for dims, u in read_total_sync(stack.redis, stack.keys).items()
    }  # fmt: skip


def _kill_every_holder(stack: Stack, request_id: str, stop: threading.Event) -> list[str]:
    """SIGKILL each worker process that runs the request, once per process, as a poison entry
    would: the one whose consumer holds the pending entry and that wrote itself into
    req:{id}.owner, once it runs it (its first holder at once; a later one, which runs it alone
    as a suspect, when it has recorded its delivery in claim_ran)."""
    killed: list[str] = []
    r, keys = stack.redis, stack.keys.of(request_id)  # the request's shard
    streams = {b"prefilling": (keys.prefill_stream, PREFILL_GROUP),
               b"decoding": (keys.decode_stream, DECODE_GROUP)}  # fmt: skip
    while not stop.is_set():
        status, owner, ran = r.hmget(keys.request(request_id), "status", "owner", "claim_ran")
        if status in streams and owner:
            consumer, pid = r.hmget(keys.worker(owner.decode()), "consumer", "pid")
            pending = r.xpending_range(*streams[status], "-", "+", 100)
            held = {p["consumer"]: p["times_delivered"] for p in pending}
            running = consumer in held and (held[consumer] == 1 or int(ran or 0) == held[consumer])
            if running and consumer.decode() not in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
                killed.append(consumer.decode())
        time.sleep(0.01)
    return killed


def _all_running(stack: Stack, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while any(stack.sup.status()[p][0] != "RUNNING" for p in VICTIMS):
        assert time.monotonic() < deadline, stack.sup.status()
        time.sleep(0.5)


def test_entry_that_kills_every_holder_goes_to_dlq_and_workers_live_on(stack):
    rid = f"poison-{SEED}"
    # a long prompt: prefill takes seconds, so each holder dies before it can hand off
    long = " ".join(f"Item {n}: a line about {TOPICS[n % 8]}." for n in range(120))
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 4,
            "temperature": 0.0}  # fmt: skip
    _all_running(stack)  # after the churn test: every worker back
    time.sleep(3)  # and heartbeating, so the ingress routes the long prompt to prefill
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=lambda: killed.extend(_kill_every_holder(stack, rid, stop)))
    killer.start()
    try:
        with httpx.Client() as client:
            sse = stream_chat(client, stack.url, body, rid, give_up_s=400)
    finally:
        stop.set()
        killer.join(10)
    print(f"\npoison {rid}: {len(killed)} holders killed: {killed}")
    assert sse.error is not None and sse.error["code"] == "generation_failed", sse
    # bounded: one crash per strike, maybe one more of the claimant dead-lettering it
    assert MAX_DELIVERIES <= len(killed) <= MAX_DELIVERIES + 2, killed
    reason = sse.error["message"]
    limit = f"times its holder died running it without progress (limit {MAX_DELIVERIES})"
    assert limit in reason, reason
    [(_, dlq)] = stack.redis.xrange(stack.keys.of(rid).dlq)
    assert (dlq[b"request_id"].decode(), dlq[b"reason"].decode()) == (rid, reason)
    # every interface tells the same story: record, non-streaming reattach, producer client
    state = httpx.get(f"{stack.url}/v1/requests/{rid}").json()
    assert (state["status"], state["finish_reason"], state["error"]) == ("failed", "error", reason)
    whole = httpx.post(f"{stack.url}/v1/chat/completions", json={**body, "logprobs": True},
                       headers={"X-Request-Id": rid}, timeout=60)  # fmt: skip
    assert whole.status_code == 500, whole.text
    assert whole.json()["error"]["code"] == "generation_failed"
    assert whole.json()["error"]["message"] == reason

    async def produced():
        async with AsyncClient(stack.state["redis_url"], key_prefix=stack.state["key_prefix"]) as c:
            return await c.result(rid)

    done = asyncio.run(produced())
    assert (done.finish_reason, done.error) == ("error", reason)
    # the workers live on: each killed one came back and the stack serves
    _all_running(stack)
    with httpx.Client() as client:
        after = stream_chat(client, stack.url, chat_body(0), f"after-{SEED}")
    assert after.error is None and after.finish_reason in ("stop", "length")
