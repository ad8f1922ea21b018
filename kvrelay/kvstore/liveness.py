"""NodeLiveness: whether the local store node is up, told by its socket, not by request timeouts.

A killed node's sockets close with it, so a ZeroMQ connection to its IPC socket sees the peer
go at once (EVENT_DISCONNECTED), and the reconnects that follow are refused (CONNECT_RETRIED)
until a new node binds the socket (EVENT_CONNECTED). One watcher per node socket per process
holds such a connection (it sends nothing) on a daemon thread and turns the monitor's events
into a state every `StoreClient` of that node reads without a lock: a request to a node known
to be down fails at once, and a request waiting for its reply fails as soon as the node is
lost. A slow node is not down: its connection stays up however long a request takes.

Each transition is logged once per process (a warning when the node goes and when it is back),
not once per request.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
import time

logger = logging.getLogger(__name__)

RECONNECT_MS = 50  # how often the watcher tries a node that is down (zmq's default: 100)


class NodeState(enum.StrEnum):
    UNKNOWN = "unknown"  # no connection yet, no refusal yet
    UP = "up"  # connected: a process listens on the socket
    DOWN = "down"  # the connection closed, or connecting is refused


class NodeLiveness:
    """The state of the store node listening at `url`, kept by a watcher thread.

    `losses` counts the times the node was lost (up -> down), so a caller that remembers it
    can tell whether the node went away since, even if it is back already."""

    _registry: dict[str, NodeLiveness] = {}
    _registry_lock = threading.Lock()

    def __init__(self, url: str):
        self.url = url
        self.state = NodeState.UNKNOWN
        self.losses = 0
        self.changed_at = time.monotonic()  # of the last state change
        self._pid = os.getpid()
        self._users = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # release() wakes the watcher to stop it
        self._thread = threading.Thread(target=self._run, name="kvstore-liveness", daemon=True)
        self._thread.start()

    # -- sharing ----------------------------------------------------------------------------
    @classmethod
    def acquire(cls, url: str) -> NodeLiveness:
        """The process's watcher of `url` (started on first use); `release()` it when done."""
        with cls._registry_lock:
            live = cls._registry.get(url)
            if live is None or live._pid != os.getpid():  # a forked child starts its own
                live = cls._registry[url] = cls(url)
            live._users += 1
            return live

    def release(self) -> None:
        """One user fewer; the last one stops the watcher."""
        with self._registry_lock:
            self._users -= 1
            if self._users > 0:
                return
            if self._registry.get(self.url) is self:
                del self._registry[self.url]
        self._stop.set()
        os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)  # its sockets closed before the process exits
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- state ------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.state is NodeState.UP

    @property
    def down(self) -> bool:
        return self.state is NodeState.DOWN

    def listening(self) -> bool:
        """Whether a process listens on the node's socket right now (one connect attempt):
        a node restarted a moment ago is up before the watcher's next reconnect sees it."""
        if not self.url.startswith("ipc://"):
            return not self.down
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.url.removeprefix("ipc://"))
            except OSError:
                return False
        return True

    def wait_up(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the node to be up (tests, operators)."""
        deadline = time.monotonic() + timeout
        while not self.up and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.up

    def _set(self, state: NodeState) -> None:
        old = self.state
        if state is old:
            return
        now = time.monotonic()
        if state is NodeState.DOWN and old is NodeState.UP:
            self.losses += 1
            logger.warning(
                "store node at %s went away; calls to it fail at once (workers recompute "
                "instead of fetching) until it is back",
                self.url,
            )
        elif state is NodeState.UP and self.losses:
            logger.warning(
                "store node at %s is back after %.1fs down", self.url, now - self.changed_at
            )
        elif state is NodeState.DOWN:
            logger.info("store node at %s is not listening", self.url)
        else:
            logger.debug("store node at %s is up", self.url)
        self.state, self.changed_at = state, now

    def _on_event(self, event: int) -> None:
        import zmq

        if event == zmq.EVENT_CONNECTED:
            self._set(NodeState.UP)
        elif event == zmq.EVENT_DISCONNECTED:
            self._set(NodeState.DOWN)
        elif event == zmq.EVENT_CONNECT_RETRIED and self.state is not NodeState.UP:
            self._set(NodeState.DOWN)  # nobody listens on the socket (refused or no file)

    def _run(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        monitor = probe.get_monitor_socket(events)
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            probe.connect(self.url)
            while not self._stop.is_set():
                if dict(poller.poll()).get(monitor) and not self._stop.is_set():
                    self._on_event(recv_monitor_message(monitor)["event"])
        except zmq.ContextTerminated:
            pass
        except Exception:  # never take the process down; clients fall back to timeouts
            logger.exception("store node watcher for %s failed", self.url)
            self.state = NodeState.UNKNOWN
        finally:
            with contextlib.suppress(zmq.ZMQError):
                probe.disable_monitor()
            monitor.close(0)
            probe.close(0)
