"""Network faults between a worker and Valkey (issue 48 item 3): a delayed, lossy link and a cut.

Decode worker A runs in its own network namespace, joined to ours by a point-to-point link
whose packets this test relays (`tests.netlink.Link`: a user-space netem over two TUN
devices, both directions); Valkey listens on our end, so every byte between A and Valkey
crosses it. Decode worker B runs here, draining (it reads and claims nothing) until the
partition test lets it claim. Requests go through the producer client (Redis only, not across
the link); greedy decoding makes every run's text comparable with an undisturbed one. Real
components only: valkey-server, `kvrelay worker` processes, the SmolLM2 model. Skipped (with
the reason) where network namespaces or TUN devices are unavailable, as
tests/kvstore/test_netns.py is. The store links' faults: tests/e2e/test_store_network_faults.py.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvrelay.core.keys import Keys
from kvrelay.pipeline.client.producer import Client
from tests.conftest import ValkeyServer
from tests.netlink import (
    Link,
    LoggedProcess,
    add_netns,
    del_netns,
    require_netns,
    wait_until,
)
from tests.queue_state import emitted_chunks

MODEL = "smollm2-135m-instruct"
KEYS = Keys("kvrelay:")
SAMPLING = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The history of the lighthouse on the rocky island",
    "Three reasons to learn to play the piano are",
    "Once upon a time, in a village by the sea,",
]
LONG = 96  # the partition test's request: still running when its link is cut
CUT_AT = 4  # tokens the client has seen when the partition test cuts the link


class WorkerProcess(LoggedProcess):
    """`kvrelay worker decode` as a child process (optionally inside a namespace)."""

    def __init__(self, name: str, redis_url: str, tmp: Path, prefix: tuple[str, ...] = (),
                 extra: tuple[str, ...] = ()):  # fmt: skip
        cmd = [*prefix, sys.executable, "-m", "kvrelay.cli.main", "worker", "decode",
               "--name", name, "--redis-url", redis_url, "--model", MODEL, "--threads", "1",
               "--kv-cache-bytes", str(96 << 20), "--metrics-port", "-1",
               "--slot-dir", str(tmp / "slots"), "--speculation", "off", *extra]  # fmt: skip
        super().__init__(name, cmd, tmp / f"{name}.log")


class Fleet:
    """Valkey, the link, worker A (in the namespace) and worker B (here, draining)."""

    def __init__(self, tmp: Path, link: Link):
        self.link = link
        self.valkey = ValkeyServer(tmp / "valkey", extra_binds=(link.ours,))
        self.valkey.start()
        self.r = redis.Redis.from_url(self.valkey.url)
        # B drains from its first heartbeat (it reads its worker hash's `drain` there)
        self.r.hset(KEYS.worker("net-b"), "drain", "1")
        self.a = WorkerProcess("net-a", f"redis://{link.ours}:{self.valkey.port}/0", tmp,
                               prefix=("ip", "netns", "exec", link.ns))  # fmt: skip
        self.b = WorkerProcess("net-b", self.valkey.url, tmp, extra=("--lease-ms", "2000"))
        for w in (self.a, self.b):
            wait_until(f"worker {w.name} did not start",
                  lambda w=w: self.r.hget(KEYS.worker(w.name), "consumer") is not None,
                  240, self.logs)  # fmt: skip
        wait_until(
            "worker net-b is not draining",
            lambda: self.r.hget(KEYS.worker("net-b"), "draining") == b"1",
            30,
            self.logs,
        )
        self.client = Client(self.valkey.url, model=MODEL)

    def logs(self) -> str:
        return "".join(f"\n== {w.name}\n{w.text()[-3000:]}" for w in (self.a, self.b))

    def close(self) -> None:
        self.client.close()
        for w in (self.a, self.b):
            w.stop()
        self.valkey.stop()

    def owner(self, request_id: str) -> bytes | None:
        """The worker that took the request last (req:{id}'s `owner`)."""
        return self.r.hget(KEYS.of(request_id).request(request_id), "owner")

    def tokens(self, request_id: str) -> list[int]:
        """The request's emitted tokens in Valkey (out:{id} and the tail): each index once."""
        tokens: list[int] = []
        for chunk in emitted_chunks(self.r, KEYS, request_id):
            assert chunk.index == len(tokens), f"chunk at {chunk.index}, expected {len(tokens)}"
            tokens.extend(chunk.token_ids)
        return tokens


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    require_netns()
    link = Link()
    add_netns(link.ns)
    fleet = None
    try:
        try:
            link.create()
        except OSError as exc:  # TUNSETIFF refused (no CAP_NET_ADMIN in a container)
            pytest.skip(f"cannot create TUN devices here: {exc}")
        fleet = Fleet(tmp_path_factory.mktemp("netfaults"), link)
        yield fleet
    finally:
        if fleet is not None:
            fleet.close()
        link.destroy()
        del_netns(link.ns)


def _stream(fleet: Fleet, request_id: str, on_tokens=None) -> tuple[str, list[int], str | None]:
    """Read a request through the producer client, checking each token index comes once, in
    order; (text, token ids, finish reason)."""
    text, tokens, reason = "", [], None
    for chunk in fleet.client.stream(request_id):
        assert chunk.index == len(tokens), f"{request_id}: chunk at {chunk.index}, {len(tokens)}"
        text += chunk.text
        tokens.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
        if on_tokens is not None:
            on_tokens(len(tokens))
    return text, tokens, reason


def _run_all(fleet: Fleet, tag: str) -> dict[str, tuple[str, list[int], str | None]]:
    """Every prompt at once, read in parallel."""
    ids = [fleet.client.submit(p, sampling=SAMPLING, request_id=f"{tag}-{i}")
           for i, p in enumerate(PROMPTS)]  # fmt: skip
    got: dict[str, tuple] = {}
    errors: list[BaseException] = []

    def read(rid: str) -> None:
        try:
            got[rid] = _stream(fleet, rid)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, f"{errors!r}{fleet.logs()}"
    return {rid.split("-", 1)[1]: got[rid] for rid in ids}


def test_delayed_lossy_link_changes_no_token(fleet):
    t0 = time.monotonic()
    ref = _run_all(fleet, "plain")
    plain_s = time.monotonic() - t0
    assert all(len(t) == SAMPLING["max_tokens"] and r == "length" for _, t, r in ref.values())
    dropped, relayed, t0 = fleet.link.dropped, fleet.link.relayed, time.monotonic()
    fleet.link.netem(delay_s=0.2, loss=0.05)
    try:
        got = _run_all(fleet, "netem")
    finally:
        fleet.link.clear()
    dropped, relayed = fleet.link.dropped - dropped, fleet.link.relayed - relayed
    print(
        f"\n200 ms each way, 5% loss: {len(PROMPTS)} requests in "
        f"{time.monotonic() - t0:.1f}s (undisturbed {plain_s:.1f}s), {relayed} packets "
        f"relayed, {dropped} dropped"
    )
    assert dropped >= 1  # the loss was in effect (seeded: the 4th packet is the first lost)
    assert got == ref
    for i in range(len(PROMPTS)):
        assert fleet.tokens(f"netem-{i}") == ref[str(i)][1]
        assert fleet.owner(f"netem-{i}") == b"net-a"  # across the link (B drains)


class FenceWatch:
    """MONITOR on Valkey, keeping the commands that touch `fence:` keys (in order), so the test
    sees each step and beat a fenced consumer sends, and its refusal."""

    def __init__(self, url: str):
        self.commands: list[str] = []
        self.conn = redis.Redis.from_url(url)
        self.monitor = self.conn.monitor()
        self.monitor.__enter__()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for cmd in self.monitor.listen():
                if "fence" in cmd["command"]:
                    self.commands.append(cmd["command"])
        except (redis.RedisError, OSError, AttributeError):  # closed by stop()
            pass

    def stop(self) -> list[str]:
        self.monitor.connection.disconnect()
        self.thread.join(5)
        return list(self.commands)


def _after_fence(commands: list[str], fence: str) -> tuple[int, int, int]:
    """(steps refused, beats refused, steps written) of a consumer whose fence key is `fence`,
    after a claim fenced it (`lua/claim.lua`: SET fence f EX): a refused step is its `SET fence
    N KEEPTTL GET` put back to `f` (`lua/step.lua`), a beat reads `GET fence` (`lua/beat.lua`)."""
    key = re.escape(fence)
    fenced = [i for i, c in enumerate(commands) if re.fullmatch(rf"SET {key} f EX \d+", c)]
    assert fenced, f"no claim fenced {fence}"
    later = commands[fenced[0] + 1 :]
    steps = [i for i, c in enumerate(later) if re.fullmatch(rf"SET {key} \d+ KEEPTTL GET", c)]
    refused = sum(1 for i in steps if later[i + 1 : i + 2] == [f"SET {fence} f KEEPTTL"])
    beats = sum(1 for c in later if c == f"GET {fence}")
    return refused, beats, len(steps) - refused


def test_partitioned_worker_cannot_emit_after_its_entries_moved(fleet):
    prompt = "Write a long story about a dragon who learns to bake bread."
    sampling = {**SAMPLING, "max_tokens": LONG}
    rid = fleet.client.submit(prompt, sampling=sampling, request_id="cut-ref")
    ref_text, ref_tokens, ref_reason = _stream(fleet, rid)
    assert (len(ref_tokens), ref_reason) == (LONG, "length")

    consumer = fleet.r.hget(KEYS.worker("net-a"), "consumer").decode()
    fence = KEYS.fence(consumer)
    watch = FenceWatch(fleet.valkey.url)
    cut: list[int] = []
    cut_at: list[float] = []

    def cut_link(n: int) -> None:
        if n >= CUT_AT and not cut:
            fleet.link.netem(loss=1.0)  # both directions: A hears nothing, says nothing
            cut.append(n)
            cut_at.append(time.monotonic())
            fleet.r.hset(KEYS.worker("net-b"), "drain", "0")  # B may claim A's entries now

    rid = fleet.client.submit(prompt, sampling=sampling, request_id="cut")
    restored = threading.Event()

    def restore() -> None:  # once B has claimed the request, the link comes back
        try:
            wait_until("B never claimed the request", lambda: fleet.owner("cut") == b"net-b", 120,
                  fleet.logs)  # fmt: skip
        finally:
            fleet.link.clear()
            cut_at.append(time.monotonic())
            restored.set()

    watcher = threading.Thread(target=restore, daemon=True)
    try:
        watcher.start()
        text, tokens, reason = _stream(fleet, rid, on_tokens=cut_link)
        assert cut and cut[0] < LONG, "the request finished before the link was cut"
        assert restored.wait(120) and fleet.owner("cut") == b"net-b", fleet.logs()
        rejoined = f"consumer {consumer} was fenced on shard 0; 1 requests dropped, rejoined as"
        # A learns it was fenced only when its connections carry again (TCP's retransmissions)
        wait_until("the partitioned worker never learned it was fenced",
              lambda: rejoined in fleet.a.text(), 120, fleet.logs)  # fmt: skip
        time.sleep(1.0)  # whatever else A had in flight reaches Valkey and is refused
    finally:
        fleet.link.clear()
        commands = watch.stop()
    assert (text, tokens, reason) == (ref_text, ref_tokens, ref_reason)
    assert fleet.tokens("cut") == ref_tokens  # out:{id} + tail: every index exactly once
    steps_refused, beats_refused, steps_written = _after_fence(commands, fence)
    print(
        f"\npartitioned consumer {consumer}: cut after {cut[0]} tokens for "
        f"{cut_at[1] - cut_at[0]:.1f}s; after the claim "
        f"{steps_refused} step(s) and {beats_refused} beat(s) refused, {steps_written} written"
    )
    assert steps_written == 0
    assert steps_refused + beats_refused >= 1
    assert fleet.a.text().count(rejoined) == 1
    print("\n".join(line for line in fleet.a.text().splitlines() if "fenced" in line))
