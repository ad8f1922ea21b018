"""A worker name's slot on its host: one process serves a name at a time.

A worker process takes its name's slot, an exclusive `flock` on a file named after the stack
(Redis URL, key prefix, pipeline) and the worker name, before it joins the streams. The kernel
drops the lock the moment its holder dies, SIGKILL included, so:
- A second process of the same name on the host waits for the slot, loaded (weights, kernels,
  engine): a warm standby (`kvrelay up --standby`). When the holder dies it takes the slot
  within milliseconds and serves.
- The process that takes the slot knows that every earlier process of its name on this host is
  gone. Their consumers' entries are claimed at once (`dead_predecessors`, the `dead` names
  `lua/claim.lua` takes), instead of after the lease (`lease_ms`, 10 s) a worker silent on
  another host needs to be declared dead.

A worker that names itself like a live worker on ANOTHER host (its `worker:{name}` record says
so) is a configuration error: its consumers are left to the lease, and a warning says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.record import as_str
from kvrelay.core.worker_record import WorkerRecord

if TYPE_CHECKING:
    from kvrelay.workers.config import WorkerConfig

logger = logging.getLogger(__name__)


def slot_path(redis_url: str, key_prefix: str, pipeline: str, name: str, base: str = "") -> Path:
    """The slot file of worker `name` in the stack at (redis_url, key_prefix, pipeline), in
    `base` (the worker's `slot_dir`; "": <temp dir>/kvrelay-slots)."""
    stack = hashlib.sha1(f"{redis_url}|{key_prefix}|{pipeline}".encode()).hexdigest()[:16]
    base = base or os.path.join(tempfile.gettempdir(), "kvrelay-slots")
    return Path(base) / f"{stack}-{name}.lock"


class WorkerSlot:
    """The exclusive lock of one worker name on this host (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self.acquired_at: float | None = None  # time.monotonic() when taken

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _taken(self, fd: int) -> None:
        self._fd = fd
        self.acquired_at = time.monotonic()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())

    def holder(self) -> int | None:
        """The pid that wrote the slot file last (the holder, while it is held)."""
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def try_acquire(self) -> bool:
        """Take the slot if it is free; False when another process holds it."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._taken(fd)
        return True

    def wait(self, stop: threading.Event) -> bool:
        """Block until the slot is ours (True) or `stop` is set (False). The blocking flock
        runs on a thread, so signals reach the caller, which polls `stop`; the kernel wakes
        the thread when the holder dies."""
        fd = self._open()
        got = threading.Event()

        def take() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            got.set()

        thread = threading.Thread(target=take, name="worker-slot", daemon=True)
        thread.start()
        while not got.wait(0.2):
            if stop.is_set():
                # the thread may still be blocked in flock: the fd stays open (and the lock,
                # if it comes, dies with the process, which is stopping)
                return False
        self._taken(fd)
        return True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the last descriptor drops the lock
            self._fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def dead_predecessors(
    r: redis.Redis | redis.cluster.RedisCluster,
    keys: Keys,
    name: str,
    consumer: str,
    slot_held: bool,
) -> list[str]:
    """The consumers of earlier workers named `name` that are known dead, to be claimed at
    once; read before this worker's first heartbeat overwrites `worker:{name}`.

    Known dead: no record of the name says another host, and this process holds the name's
    slot (`slot_held`); without the slot (workers run in-process), the record's pid must be
    this host's and gone. A record of another host leaves its consumers to the lease (with a
    warning: one name, two hosts)."""
    record = WorkerRecord.decode(r.hgetall(keys.worker(name)))
    if record is not None and record.host and record.host != socket.gethostname():
        logger.warning(
            "worker name %s was last used on host %s: its entries wait for the lease "
            "(give each worker its own name)",
            name,
            record.host,
        )
        return []
    if not slot_held and (
        record is None or record.pid is None or record.pid == os.getpid() or _pid_alive(record.pid)
    ):
        return []
    # `Worker.new_consumer`'s names: NAME.MILLIS, NAME.MILLIS.1 after a rejoin in the same ms
    own = re.compile(re.escape(name) + r"\.\d+(\.1)?")
    names = [as_str(c) for c in r.hkeys(keys.consumers)]
    return sorted(c for c in names if own.fullmatch(c) and c != consumer)


def announce_standby(
    config: WorkerConfig, name: str, stop: threading.Event, taken: threading.Event
) -> None:
    """While this process waits for `name`'s slot: `standby:{name}` = its pid, renewed every
    heartbeat (TTL heartbeat_ttl_s), deleted when it stops or takes the slot. Redis errors
    are retried: a standby outlives an outage."""
    from kvrelay.core.redis_client import sync_redis

    key = Keys(config.key_prefix).standby(name)
    client = None
    while not (stop.is_set() or taken.is_set()):
        try:
            client = client or sync_redis(config.redis_url, socket_timeout=5)
            client.set(key, os.getpid(), ex=config.heartbeat_ttl_s)
        except redis.RedisError as exc:
            logger.warning("standby announcement failed: %s", exc)
        if stop.wait(config.heartbeat_s) or taken.is_set():
            break
    if client is not None:
        with contextlib.suppress(redis.RedisError):
            if client.get(key) == str(os.getpid()).encode():
                client.delete(key)
