"""What `kvrelay up` prints while it waits: one stderr line each time a program's progress changes.

A program is `up` when it does its job: valkey and the ingress listen on their ports, the store
node has registered in Redis (`node:{id}` carrying its pid), a worker's heartbeat carries the pid
supervisord runs under its name. Before that a worker's phase comes from its own log (model
conversion, loading, engine start), read from where the log stood when `up` started.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.cli.up.launch import listens
from kvrelay.cli.up.models import state_stores
from kvrelay.cli.up.topology import is_ingress, worker_of
from kvrelay.cli.up.valkey import cluster_mode, valkey_ports
from kvrelay.core.enums import WorkerField
from kvrelay.core.worker_record import WorkerRecord

if TYPE_CHECKING:
    import redis
    import redis.cluster

REMIND_S = 30.0  # an unchanged line is repeated this often, so a long wait still shows life
# (text in a worker's log line, the phase it starts); the latest matching line wins
WORKER_PHASES: tuple[tuple[str, str], ...] = (
    ("model.loader: converting ", "loading model (converting weights)"),
    ("model.loader: preparing ", "loading model (preparing)"),
    ("model.loader: reading the tokenizer and config", "loading model (preparing: tokenizer)"),
    ("model.loader: loading tokenizer", "loading model (converting weights: tokenizer)"),
    ("model.loader: loading and dequantizing", "loading model (converting weights: dequantizing)"),
    ("model.loader: writing safetensors", "loading model (converting weights: writing)"),
    ("model.loader: hashing weights", "loading model (hashing weights)"),
    ("model.loader: loaded ", "starting engine"),
    ("llm_engine: engine ready", "connecting"),
)
LOADING = "loading model"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(slots=True)
class _WorkerLog:
    """Where a worker's log was last read and the phase its latest line showed."""

    pos: int
    pid: int | None = None
    phase: str = LOADING


@dataclass(slots=True)
class UpProgress:
    """Progress lines for one `kvrelay up`; create it before supervisord starts."""

    state: dict
    log_dir: Path
    write: Callable[[str], None] = _say
    started: float = field(default_factory=time.monotonic)
    last: str = ""
    last_at: float = float("-inf")
    workers: dict[str, _WorkerLog] = field(default_factory=dict)
    _redis: redis.Redis | redis.cluster.RedisCluster | None = None

    def __post_init__(self) -> None:
        for name in self.state["programs"]:
            if name.startswith(("prefill-", "decode-")):
                log = self.log_dir / f"{name}.log"
                self.workers[name] = _WorkerLog(log.stat().st_size if log.exists() else 0)

    def describe(self, status: dict[str, tuple[str, int | None]]) -> str:
        """`valkey up, store up, ingress starting, decode-0 loading model` for this status."""
        registered = self._registered_pids(status)
        parts = []
        for name in self.state["programs"]:
            program_state, pid = status.get(name, ("MISSING", None))
            if program_state != "RUNNING" or pid is None:
                what = program_state.lower()
            elif is_ingress(name) or name in self._valkeys:
                what = "starting" if listens(pid, self._port(name)) is False else "up"
            elif pid in registered.get(name, ()):
                what = "up"
            elif name in self._stores:
                what = "starting"
            else:
                what = self._worker_phase(name, pid)
            parts.append(f"{name} {what}")
        return ", ".join(parts)

    def update(self, status: dict[str, tuple[str, int | None]]) -> None:
        """Print a `waiting:` line when the progress changed (or every REMIND_S unchanged)."""
        if not status:  # supervisord is not answering yet: nothing to tell
            return
        line = self.describe(status)
        now = time.monotonic()
        if line != self.last or now - self.last_at >= REMIND_S:
            self.write(f"kvrelay up: waiting: {line} ({now - self.started:.0f} s)")
            self.last, self.last_at = line, now

    def ready(self) -> None:
        """The final line: every program is up."""
        took = time.monotonic() - self.started
        self.write(f"kvrelay up: ready in {took:.1f} s: {', '.join(self.state['programs'])} up")
        self.close()

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    @property
    def _stores(self) -> dict[str, str]:
        """Store program -> its node id (one per model)."""
        stores = state_stores(self.state)
        return {name: node for name, (node, _dir) in stores.items()} or {
            "store": self.state.get("store_node", "node0")
        }

    @property
    def _valkeys(self) -> dict[str, int]:
        return valkey_ports(self.state)

    def _port(self, name: str) -> int:
        return int(self.state["port"]) if is_ingress(name) else self._valkeys[name]

    def _registered_pids(self, status: dict) -> dict[str, set[int]]:
        """Pids in the store node's registration and in each worker's heartbeat or standby
        announcement (when present)."""
        import redis

        from kvrelay.core.keys import Keys
        from kvrelay.core.redis_client import sync_redis

        keys = Keys(self.state["key_prefix"])
        stores = self._stores
        names = [*stores, *self.workers]
        if self._redis is None:
            try:
                self._redis = sync_redis(
                    self.state["redis_url"],
                    cluster_mode(self.state),
                    socket_timeout=2,
                    socket_connect_timeout=2,
                )
            except redis.RedisError:  # a cluster client asks for the slot map at once
                return {}
        try:
            pipe = self._redis.pipeline(transaction=False)
            for node in stores.values():
                pipe.hget(keys.store_node(node), "pid")
            for name in self.workers:  # its heartbeat, or a standby's announcement
                pipe.hget(keys.worker(worker_of(name)), WorkerField.PID)
                pipe.get(keys.standby(worker_of(name)))
            replies = pipe.execute()
        except redis.RedisError:  # valkey still starting: nothing registered yet
            return {}
        store_pids, worker_pids = replies[: len(stores)], replies[len(stores) :]
        pids: list[set[int]] = [{int(p)} if p is not None else set() for p in store_pids]
        for beat, standby in zip(worker_pids[::2], worker_pids[1::2], strict=True):
            found = {WorkerRecord.partial(WorkerField.PID, x).pid for x in (beat, standby)}
            pids.append({p for p in found if p is not None})
        return dict(zip(names, pids, strict=True))

    def _worker_phase(self, name: str, pid: int) -> str:
        """The phase the worker's log shows since `up` started (or since its last restart)."""
        log = self.workers[name]
        if log.pid not in (None, pid):  # restarted: its earlier phases no longer hold
            log.phase = LOADING
        log.pid = pid
        try:
            with (self.log_dir / f"{name}.log").open("rb") as f:
                f.seek(log.pos)
                data = f.read()
        except OSError:
            return log.phase
        end = data.rfind(b"\n") + 1  # a half-written last line is read again next time
        log.pos += end
        for line in data[:end].decode(errors="replace").splitlines():
            for text, phase in WORKER_PHASES:
                if text in line:
                    log.phase = phase
        return log.phase
