"""Network namespaces joined by user-space netem links, for the network-fault tests.

`Link` is a point-to-point link between two namespaces (ours by default and a new one) made
of two TUN devices whose packets a thread of the test relays: each packet, either way, waits
`delay_s` and is dropped with a seeded probability `loss` (1.0: the link is cut). A user-space
`tc netem`, because the kernels of this project's VMs are built without `sch_netem` (`tc qdisc
... netem` fails with "unknown qdisc"). Used by tests/e2e/test_network_faults.py,
tests/e2e/test_store_network_faults.py and tests/kvstore/test_netns.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import random
import select
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


def tcp_ports(packet: bytes) -> tuple[int, int] | None:
    """(source port, destination port) of an IPv4 TCP packet; None for anything else."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != 6:
        return None
    start = (packet[0] & 0x0F) * 4
    if len(packet) < start + 4:
        return None
    src, dst = struct.unpack_from("!HH", packet, start)
    return src, dst


def on_port(port: int) -> Callable[[bytes], bool]:
    """Matches the TCP packets from or to `port` (one listener's connections)."""
    return lambda packet: port in (tcp_ports(packet) or ())


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def require_netns() -> None:
    """Skip (with the reason) where namespaces or TUN devices cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        pytest.skip("no /dev/net/tun: the link is made of TUN devices")


def add_netns(name: str) -> None:
    """Create namespace `name` (its loopback up), or skip the test where that is refused."""
    if run("ip", "netns", "add", name, check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    run("ip", "-n", name, "link", "set", "lo", "up")


def del_netns(name: str) -> None:
    run("ip", "netns", "del", name, check=False)


class LoggedProcess:
    """A child process (a `kvrelay` command, maybe inside a namespace), its output in `log`."""

    def __init__(self, name: str, cmd: list[str], log: Path):
        self.name, self.log = name, log
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until(what: str, predicate: Callable[[], object], timeout: float,
               logs: Callable[[], str] = lambda: "") -> None:  # fmt: skip
    """Poll `predicate` every 0.1 s; fail with `what` and `logs()` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}{logs()}"
        time.sleep(0.1)


class Link:
    """A point-to-point link from namespace `near` (None: ours) to `far` (default: a new name,
    `ns`, which the caller creates), subnet 10.`net`.<pid-derived>.0/24: `ours` is the near
    end's address, `theirs` the far end's. Each packet, either way, waits `delay_s` and is
    dropped with probability `loss` (1.0: the link is cut; packets already waiting still go).
    `seed` fixes which packets are lost (59: the 4th, 8th and 24th first)."""

    def __init__(
        self,
        tag: str = "f",
        net: int = 232,
        near: str | None = None,
        far: str | None = None,
        seed: int = 59,
    ) -> None:
        pid = f"{os.getpid() % 100000}"
        self.near = near
        self.ns = far or f"kv{tag}{pid}"
        self.here, self.there = f"kv{tag}h{pid}", f"kv{tag}t{pid}"  # 15 characters at most
        octet = os.getpid() % 200 + 20
        self.ours, self.theirs = f"10.{net}.{octet}.1", f"10.{net}.{octet}.2"
        self.delay_s, self.loss = 0.0, 0.0
        self.rng = random.Random(seed)
        self.dropped = self.relayed = 0
        self.fds: dict[int, int] = {}  # fd -> the fd its packets are written to
        self._trip: tuple[int, Callable[[bytes], bool]] | None = None  # see cut_after()
        self.cut_at: float | None = None  # when cut_after() cut the link (time.monotonic())
        self.cut_wall: float | None = None  # the same moment by time.time() (to read logs)
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self.thread = threading.Thread(target=self._relay, name=f"link-{tag}", daemon=True)

    @staticmethod
    def _tun(name: str) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
        return fd

    def _ip(self, ns: str | None, *args: str) -> None:
        run("ip", *(("-n", ns) if ns else ()), *args)

    def create(self) -> None:
        """Make the devices (OSError where TUNSETIFF is refused) and start relaying."""
        here = self._tun(self.here)
        self.fds = {here: here}
        there = self._tun(self.there)
        self.fds = {here: there, there: here}
        # a device moves; this process's descriptor stays attached to it
        if self.near is not None:
            run("ip", "link", "set", self.here, "netns", self.near)
        run("ip", "link", "set", self.there, "netns", self.ns)
        self._ip(self.near, "addr", "add", f"{self.ours}/24", "dev", self.here)
        self._ip(self.near, "link", "set", self.here, "up")
        self._ip(self.ns, "addr", "add", f"{self.theirs}/24", "dev", self.there)
        self._ip(self.ns, "link", "set", self.there, "up")
        self.thread.start()

    def netem(self, delay_s: float = 0.0, loss: float = 0.0) -> None:
        self.delay_s, self.loss = delay_s, loss

    def cut(self) -> None:
        self.netem(loss=1.0)

    def cut_after(self, n: int, match: Callable[[bytes], bool]) -> None:
        """Cut the link once `n` more packets that `match` have crossed (the next such packet
        is the first lost): a cut at a chosen point of a transfer, whatever else crosses."""
        self.cut_at = None
        self._trip = (n, match)

    def _tripped(self, packet: bytes) -> bool:
        """Count a matching packet towards cut_after(); True once the link is cut by it."""
        if self._trip is None:
            return False
        left, match = self._trip
        if not match(packet):
            return False
        if left > 0:
            self._trip = (left - 1, match)
            return False
        self._trip, self.loss, self.cut_at = None, 1.0, time.monotonic()
        self.cut_wall = time.time()
        return True

    def clear(self) -> None:
        self.netem()

    def _relay(self) -> None:
        waiting: list[tuple[float, int, int, bytes]] = []  # (due, seq, fd, packet)
        seq = 0
        while not self._stop:
            timeout = max(0.0, waiting[0][0] - time.monotonic()) if waiting else None
            ready, _, _ = select.select([*self.fds, self._wake_r], [], [], timeout)
            for fd in ready:
                if fd == self._wake_r:
                    continue
                try:
                    packet = os.read(fd, 65536)
                except OSError:
                    continue
                if self._tripped(packet) or (self.loss and self.rng.random() < self.loss):
                    self.dropped += 1
                    continue
                seq += 1
                self.relayed += 1
                heapq.heappush(waiting, (time.monotonic() + self.delay_s, seq, fd, packet))
            now = time.monotonic()
            while waiting and waiting[0][0] <= now:
                _, _, fd, packet = heapq.heappop(waiting)
                with contextlib.suppress(OSError):
                    os.write(self.fds[fd], packet)

    def destroy(self) -> None:
        """Stop relaying and close the devices (the caller deletes the namespaces)."""
        self._stop = True
        os.write(self._wake_w, b"x")
        if self.thread.is_alive():
            self.thread.join(5)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.close(self._wake_r)
        os.close(self._wake_w)
