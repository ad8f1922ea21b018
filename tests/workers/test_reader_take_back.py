"""A worker's reader takes back the entries pending under its own live consumer that it does
not hold after a Redis error: a reply lost after the server ran the call (an XREADGROUP's, a
claim's, an admission's) leaves them there, and nobody claims a live consumer's entries (a
stall until the worker restarts). Real Valkey and scripts behind a TCP proxy that lets one
call through to the server and then closes the connection instead of passing its reply on."""

from __future__ import annotations

import hashlib
import queue
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import redis

from kvrelay.core.enums import Stage
from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask
from kvrelay.core.redis_client import sync_redis, worker_options
from kvrelay.pipeline.queue import scripts
from kvrelay.pipeline.queue.progress import new_progress
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.config import WorkerConfig
from kvrelay.workers.emitter import Emitter, Inflight
from kvrelay.workers.reader import Admission, read_loop

KEYS = Keys("tb:")
P = KEYS.prefill_stream


class ReplyDropper:
    """A TCP proxy to Valkey that, once armed with a command's bulk-string form, forwards the
    next request containing it, waits for the server's reply and closes the client's
    connection without it."""

    def __init__(self, port: int):
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed: bytes | None = None
        self.dropped: list[bytes] = []  # the replies dropped
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, command: bytes) -> None:
        self.armed = b"$%d\r\n%s\r\n" % (len(command), command)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        dropping = False  # the armed request went: its reply is read, then both close
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [])
                if client in ready and not dropping:
                    data = client.recv(65536)
                    if not data:
                        return
                    if self.armed is not None and self.armed in data:
                        self.armed, dropping = None, True
                    server.sendall(data)
                if server in ready:
                    data = server.recv(65536)
                    if not data:
                        return
                    if dropping:
                        self.dropped.append(data)  # the server ran it
                        return
                    client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self.listener.close()


@dataclass
class Host:
    """A reader thread's worker shard (`workers.reader.ReaderHost`): real Streams, Inflight and
    Emitter (not started) over the proxy; no engine (no structured output here)."""

    streams: Streams
    config: WorkerConfig
    inflight: Inflight = field(default_factory=Inflight)
    admissions: queue.Queue[Admission] = field(default_factory=queue.Queue)
    stop_event: threading.Event = field(default_factory=threading.Event)
    shard: int = 0
    role: Stage = Stage.PREFILL
    message: type[PrefillTask] = PrefillTask
    name: str = "w"
    stream: str = P
    group: str = PREFILL_GROUP
    dead: list[str] = field(default_factory=list)
    heartbeat: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(draining=False))
    engine: None = None
    metrics: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(dead_letters=SimpleNamespace(inc=lambda: None))
    )

    def __post_init__(self) -> None:
        self.emitter = Emitter(self.streams, P, PREFILL_GROUP, self.inflight)

    @property
    def r(self) -> redis.Redis:
        return self.streams.r

    def room(self) -> int:
        return 8 - len(self.inflight)


@pytest.fixture
def proxy(valkey_session) -> Iterator[ReplyDropper]:
    direct = redis.Redis.from_url(valkey_session.url)
    direct.flushdb()
    direct.close()
    dropper = ReplyDropper(valkey_session.port)
    yield dropper
    dropper.close()


def add_task(r: redis.Redis, request_id: str) -> str:
    task = PrefillTask(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling={})
    r.hset(KEYS.progress, request_id, new_progress(""))
    return r.xadd(P, {MESSAGE_FIELD: task.encode()}).decode()


ADMIT_SHA = hashlib.sha1(scripts.with_progress("admit").encode()).hexdigest().encode()


def _first_admission(host):
    """Run the reader thread until it admits an entry; that admission."""
    reader = threading.Thread(target=read_loop, args=(host,), daemon=True)
    reader.start()
    try:
        return host.admissions.get(timeout=20)
    finally:
        host.stop_event.set()
        reader.join(10)


@pytest.mark.parametrize("lost", [b"XREADGROUP", ADMIT_SHA], ids=["read", "admission"])
def test_a_lost_reply_leaves_no_entry_pending_unheld(proxy, valkey_session, lost):
    direct = redis.Redis.from_url(valkey_session.url)
    # the worker's client (`Worker.__init__`), through the proxy
    client = sync_redis(
        f"redis://127.0.0.1:{proxy.port}/0",
        cluster=False,
        health_check_interval=10,
        **worker_options(5.0, 5),
    )
    streams = Streams(client, KEYS, "a")
    streams.ensure_group(P, PREFILL_GROUP)
    direct.script_load(scripts.with_progress("admit"))  # (EVALSHA is the call whose reply goes)
    entry = add_task(direct, "r1")
    host = Host(streams, WorkerConfig(block_ms=50, lease_ms=60000))
    proxy.arm(lost)
    admission = _first_admission(host)
    assert len(proxy.dropped) == 1  # the server ran the call; its reply never came
    assert (admission.task.request_id, admission.entry_id, admission.delivery) == (
        "r1",
        entry,
        1,
    )
    assert host.inflight.snapshot() == {"r1": entry}
    # still this consumer's, delivered once: taking it back counted no delivery
    [row] = direct.xpending_range(P, PREFILL_GROUP, "-", "+", 10)
    assert (row["consumer"], row["times_delivered"]) == (b"a", 1)
    assert direct.hget(KEYS.progress, "r1").endswith(f"a/{entry}".encode())
    assert host.admissions.empty()
    direct.close()
    client.close()


def test_a_lost_claim_reply_leaves_no_entry_pending_unheld(proxy, valkey_session):
    """The claim of a dead consumer's entry ran (the entry is `a`'s, the dead one fenced) and
    its reply was lost: `a` takes the entry back as a claim: its second delivery."""
    direct = redis.Redis.from_url(valkey_session.url)
    client = sync_redis(
        f"redis://127.0.0.1:{proxy.port}/0", cluster=False, **worker_options(5.0, 5)
    )
    streams = Streams(client, KEYS, "a")
    streams.ensure_group(P, PREFILL_GROUP)
    entry = add_task(direct, "r1")
    direct.xreadgroup(PREFILL_GROUP, "z", {P: ">"})  # z read it, and died
    direct.hset(KEYS.consumers, "z", 0)
    claim = direct.script_load(scripts.source("claim"))
    proxy.arm(claim.encode() if isinstance(claim, str) else claim)
    host = Host(streams, WorkerConfig(block_ms=50, lease_ms=60000))
    admission = _first_admission(host)
    assert len(proxy.dropped) == 1
    assert (admission.entry_id, admission.delivery) == (entry, 2)
    [row] = direct.xpending_range(P, PREFILL_GROUP, "-", "+", 10)
    assert (row["consumer"], row["times_delivered"]) == (b"a", 2)
    assert direct.get(KEYS.fence("z")) == b"f"
    direct.close()
    client.close()
