"""A primary, its replicas and 3 Sentinels as children of the test (configs from `kvrelay up`'s
own `kvrelay.cli.up.valkey_sentinel`), for failover tests without a whole stack."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from kvrelay.cli.up.valkey_sentinel import (
    CONF,
    MASTER_NAME,
    data_node_conf,
    sentinel_conf,
    sentinel_url,
)
from tests.conftest import free_port, valkey_binary


class SentinelGroup:
    """Data nodes 0 (the first primary) .. `replicas` and 3 Sentinels, each a child process."""

    def __init__(self, root: Path, replicas: int = 1, down_after_ms: int = 500):
        self.root = root
        self.node_ports = [free_port() for _ in range(replicas + 1)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.down_after_ms = down_after_ms
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return sentinel_url(self.sentinel_ports)

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen([valkey_binary(), *args], stdout=log, stderr=log)
        log.close()

    def start_node(self, i: int, fresh: bool = True) -> None:
        """Start data node `i` (fresh: write its first config; else its rewritten one)."""
        data = self.root / f"node-{i}"
        data.mkdir(parents=True, exist_ok=True)
        if fresh:
            primary = None if i == 0 else self.node_ports[0]
            (data / CONF).write_text(data_node_conf(self.node_ports[i], data, primary))
        self._spawn(f"node-{i}", str(data / CONF))
        wait_answering(self.node_ports[i])

    def start(self) -> None:
        for i in range(len(self.node_ports)):
            self.start_node(i)
        for i, port in enumerate(self.sentinel_ports):
            data = self.root / f"sentinel-{i}"
            data.mkdir(parents=True, exist_ok=True)
            conf = sentinel_conf(port, data, self.node_ports[0], self.down_after_ms, 2000)
            (data / CONF).write_text(conf)
            self._spawn(f"sentinel-{i}", str(data / CONF), "--sentinel")
            wait_answering(port)
        for i in range(1, len(self.node_ports)):
            self.wait_role(i, "slave", link_up=True)
        # every Sentinel knows the other two and the replicas (a failover needs them)
        self.wait(lambda: all(self.sentinels_see(p) for p in self.sentinel_ports), "sentinels")

    def sentinels_see(self, port: int) -> bool:
        client = redis.Redis(port=port, socket_timeout=1)
        try:
            master = client.sentinel_master(MASTER_NAME)
            return (
                master["num-other-sentinels"] == 2
                and master["num-slaves"] == len(self.node_ports) - 1
            )
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.node_ports[i], socket_timeout=2)

    def role(self, i: int) -> tuple[str | None, bool]:
        """(role, replication link up) of node `i`; (None, False) when it does not answer."""
        client = self.client(i)
        try:
            info = client.info("replication")
            return info["role"], info.get("master_link_status") == "up"
        except redis.RedisError:
            return None, False
        finally:
            client.close()

    def wait_role(self, i: int, role: str, link_up: bool = False, timeout: float = 30) -> None:
        def ok() -> bool:
            got, up = self.role(i)
            return got == role and (up or not link_up)

        self.wait(ok, f"node {i} as {role}", timeout)

    def primary_port(self) -> int | None:
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        try:
            addr = client.sentinel_get_master_addr_by_name(MASTER_NAME)
            return int(addr[1]) if addr else None
        except redis.RedisError:
            return None
        finally:
            client.close()

    def wait(self, ok, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not after {timeout} s")
            time.sleep(0.05)

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped one would not die of TERM
                    proc.kill()
                    proc.wait(timeout=10)
                except ProcessLookupError:
                    pass


def wait_answering(port: int, timeout: float = 10) -> None:
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
    finally:
        client.close()
