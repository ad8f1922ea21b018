"""StoreNode: the per-host store server (`kvrelay store`).

Local workers send batched requests (msgspec Structs as msgpack, `messages`) over a ZeroMQ IPC
socket (`<run_dir>/kvstore.sock`): hello, put (reserve slots) -> commit/abort, get (pin a
prefix) -> release, contains, stats, ls, evict. Page bytes move through the shared arena, never
through ZeroMQ. Peers fetch over TCP (server threads) and UCX (the process's UCX loop,
`ucx_runtime`); the page directory and heartbeat live in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.kvstore.arena import HostArena
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.messages import BadRequest, NodeRequest, Reply, decode_request, encode
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.protocol import Later, handle_request
from kvrelay.kvstore.retention import FILE_NAME as RETENTION_FILE
from kvrelay.kvstore.retention import SessionRetention
from kvrelay.kvstore.store import NodeStore
from kvrelay.kvstore.transport import Transport

if TYPE_CHECKING:
    import zmq

    from kvrelay.kvstore.directory import Directory
    from kvrelay.kvstore.prefetch import Prefetcher
    from kvrelay.kvstore.remote import Remote
    from kvrelay.kvstore.transport.tcp import TcpServer
    from kvrelay.kvstore.transport.ucx import UcxServer

logger = logging.getLogger(__name__)

FETCH_THREADS = 4  # concurrent remote fetches; local requests never wait for them
SAVE_RETENTION_S = 5.0  # the session table is written at most this often (and at stop)


def arena_path(config: StoreConfig) -> Path:
    """The arena file for this node and run dir (under /dev/shm when it exists)."""
    tag = hashlib.blake2b(str(Path(config.run_dir).resolve()).encode(), digest_size=4).hexdigest()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(config.run_dir)
    return base / f"kvrelay-{config.node_id}-{tag}.arena"


class StoreNode:
    """One store node: arena + disk tiers, local socket, remote listeners, directory."""

    store: NodeStore | None  # set by start(), None again after close()

    def __init__(self, config: StoreConfig, page_bytes: int):
        self.config = config
        self.page_bytes = page_bytes
        self.metrics = StoreMetrics()
        self.directory: Directory | None = None
        self.remote: Remote | None = None
        self.prefetcher: Prefetcher | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[UcxServer] = []  # UCX listeners (closed in the event loop)
        self._tcp: TcpServer | None = None
        self.addresses: dict[str, str] = {}
        self.ready = threading.Event()
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kv-fetch")
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (ident, reply) from the pool

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Open tiers, bind the socket, start listeners and register in Redis."""
        import zmq

        from kvrelay.kvstore.disk import DiskTier

        cfg = self.config
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        self.arena, reused = HostArena.create(arena_path(cfg), cfg.arena_bytes, self.page_bytes)
        self.arena_gen = os.stat(self.arena.path).st_ino  # workers remap when this changes
        disk = None
        if cfg.disk_dir:
            disk = DiskTier(Path(cfg.disk_dir), cfg.disk_bytes, self.page_bytes)
        if cfg.redis_url:
            from kvrelay.kvstore.directory import Directory

            self.directory = Directory(
                cfg.redis_url,
                cfg.key_prefix,
                cfg.node_id,
                cfg.node_ttl_s,
                cfg.heartbeat_s,
                shards=cfg.shards,
            )
        self.store = NodeStore(
            self.arena,
            disk,
            self.metrics,
            cfg.fingerprint,
            cfg.pin_timeout_s,
            on_present=self.directory.add if self.directory else lambda k: None,
            on_gone=self.directory.remove if self.directory else lambda k: None,
            retention=SessionRetention(cfg.max_retention_s),
        )
        if reused:
            logger.info(
                "reused arena %s: %d pages", self.arena.path, self.store.rebuild_from_arena()
            )
        if self.retention_path is not None:
            n = self.store.load_retention(self.retention_path)
            if n:
                logger.info("retaining the pages of %d sessions (%s)", n, self.retention_path)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        cfg.socket_path.unlink(missing_ok=True)  # a stale socket from a killed node
        self._sock.bind(cfg.socket_url)
        self._wake_r, self._wake_w = os.pipe()  # pool threads wake the request loop
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if self.directory is not None:
            self._start_remote()
            self.directory.start(
                {
                    "node_id": cfg.node_id,
                    "pid": os.getpid(),
                    "page_bytes": self.page_bytes,
                    **self.addresses,
                },
                self.store.all_keys(),
            )
            if cfg.prefetch != "off":
                from kvrelay.kvstore.prefetch import Prefetcher

                remote = cfg.prefetch == "remote"
                self.prefetcher = Prefetcher(
                    self.directory.redis,
                    self.directory.keys.prefetch,
                    cfg.fingerprint,
                    lambda keys: self.prefetch(keys, remote),
                )
                self.prefetcher.start()
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            registry = self.metrics.prometheus(self.store.counts, self.page_bytes)
            start_http_server(cfg.metrics_port, registry=registry)
        logger.info(
            "store node %s serving %s (arena %d slots, disk %s, remote %s)",
            cfg.node_id,
            cfg.socket_url,
            self.arena.num_slots,
            cfg.disk_dir,
            {str(k): v for k, v in self.addresses.items()} or "off",  # plain keys
        )
        self.ready.set()

    def _start_remote(self) -> None:
        from kvrelay.kvstore.remote import Remote
        from kvrelay.kvstore.transport.tcp import TcpServer

        cfg = self.config
        # start() calls this once the store exists, and only with a directory
        assert self.store is not None and self.directory is not None
        if not cfg.secret:
            logger.warning("no --secret: store-to-store transfers use an empty shared secret")
        secret = (cfg.secret or "").encode()
        ucx_ok = False
        if cfg.ucx_port >= 0 or cfg.transport == Transport.UCX:
            from kvrelay.kvstore.transport import ucx as ucx_transfer
            from kvrelay.kvstore.transport import ucx_runtime

            ucx_ok = ucx_transfer.available()
            if not ucx_ok:
                logger.warning("ucxx is not installed; remote fetches use TCP")
        if ucx_ok:
            self._loop = ucx_runtime.loop()  # shared by the process (one ucxx context)
            self.metrics.sources["ucx_loop"] = ucx_runtime.wakeups
        remote = self.remote = Remote(
            self.store,
            self.arena,
            self.directory,
            self.metrics,
            secret,
            cfg.transport,
            cfg.transfer_timeout_s,
            self._loop,
            ucx_ok,
            cfg.peer_retry_s,
        )
        remote.same_host = cfg.ucx_same_host
        # in `stats` only while fetches are under way
        self.metrics.sources["remote_fetches"] = lambda: (
            {"in_flight": n} if (n := remote.num_in_flight) else {}
        )
        host = cfg.advertise_host or cfg.listen_host

        async def listen() -> None:
            if ucx_ok and cfg.ucx_port >= 0:
                from kvrelay.kvstore.transport.ucx import start_ucx_server
                from kvrelay.kvstore.transport.ucx_local import LocalUcx, host_id

                local = remote.local = LocalUcx(secret, cfg.transfer_timeout_s)
                local.start(remote.serve)
                remote.host_id = host_id()
                self.addresses["ucx_addr"] = local.address
                self.addresses["host_id"] = remote.host_id

                lis = await start_ucx_server(
                    cfg.ucx_port, secret, remote.serve, cfg.transfer_timeout_s
                )
                self._servers.append(lis)
                self.addresses[Transport.UCX] = f"{host}:{lis.port}"

        if cfg.tcp_port >= 0:
            tcp = self._tcp = TcpServer(
                cfg.listen_host, cfg.tcp_port, secret, remote.serve, cfg.transfer_timeout_s
            )
            self.addresses[Transport.TCP] = f"{host}:{tcp.port}"
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(listen(), self._loop).result(30)

    @property
    def retention_path(self) -> Path | None:
        """The session table, beside the disk tier's pages (None: no disk tier)."""
        return Path(self.config.disk_dir) / RETENTION_FILE if self.config.disk_dir else None

    def prefetch(self, keys: list[bytes], remote: bool) -> int:
        """Bring the leading `keys` into the arena: from disk, then (`remote`) from the peers
        that hold the rest; returns how many lead the arena now."""
        store = self.store
        if store is None:
            return 0
        n = store.prefetch_local(keys)
        if n < len(keys) and remote and self.remote is not None:
            fetched = self.remote.fetch(keys[n:])  # the slots of the run fetched, pinned
            store.mark_prefetched(fetched)
            n += len(fetched)
        return n

    def save_retention(self) -> None:
        if self.store is not None and self.retention_path is not None:
            try:
                self.store.save_retention(self.retention_path)
            except OSError as exc:
                logger.warning("could not save the session table: %s", exc)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Flush arena pages to disk, unregister, close listeners and the socket."""
        store: NodeStore | None = getattr(self, "store", None)
        if store is None:
            return
        if self.prefetcher is not None:
            self.prefetcher.stop()
        self._pool.shutdown(wait=True)  # fetches in flight end within the transfer timeout
        n = store.flush_to_disk()
        if n:
            logger.info("flushed %d arena pages to disk", n)
        self.save_retention()
        if self.directory is not None:
            self.directory.stop()
        if self._tcp is not None:
            self._tcp.close()  # open TCP sessions end with the node
        if self.remote is not None:
            self.remote.close()  # our cached sessions to peers (UCX ones end on the UCX loop)
        if self._loop is not None:

            async def shut() -> None:
                remote = self.remote
                assert remote is not None  # the UCX loop is only set up along with Remote
                tasks = []
                if remote.local is not None:
                    tasks += remote.local.close()
                for srv in self._servers:
                    srv.close()
                if tasks:
                    await asyncio.wait(tasks, timeout=2)

            try:  # the loop itself is the process's UCX loop: it keeps running
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
            except TimeoutError:
                logger.warning("remote listeners did not close within 5s; stopping anyway")
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.config.socket_path.unlink(missing_ok=True)
        self.arena.close()
        if not self.config.keep_arena:
            self.arena.path.unlink(missing_ok=True)
        self.store = None
        logger.info("store node %s stopped", self.config.node_id)

    def serve_forever(self) -> None:
        """Answer local requests until `stop()` (or SIGTERM via the CLI).

        Requests that may wait on a peer or Redis (a `get` or `contains` that goes remote) run
        on a small thread pool; their replies come back through `_done` (a pipe wakes the
        poller), so one slow fetch never holds up other workers' local requests."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_save = time.monotonic() + SAVE_RETENTION_S
        while not self._stop.is_set():
            if time.monotonic() >= next_save:
                self.save_retention()
                next_save = time.monotonic() + SAVE_RETENTION_S
            if not poller.poll(100):
                continue
            self._send_done()
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                ident, body = frames[0], frames[-1]
                reply = self._handle(ident, body)
                if reply is not None:
                    self._sock.send_multipart([ident, b"", reply])
            self._send_done()

    def _send_done(self) -> None:
        """Send the replies finished by pool threads."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        while True:
            try:
                ident, reply = self._done.get_nowait()
            except queue.Empty:
                return
            self._sock.send_multipart([ident, b"", reply])

    def _finish(self, ident: bytes, req: NodeRequest, later: Later) -> None:
        """Run deferred work on a pool thread and queue its reply for the request loop."""
        reply = self._reply(req, later.run)
        self._done.put((ident, reply))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    # -- requests ---------------------------------------------------------------------------
    def _handle(self, ident: bytes, body: bytes) -> bytes | None:
        """The reply to one request; None when there is none yet (deferred) or none wanted."""
        try:
            req = decode_request(body)
        except BadRequest as exc:  # bad input gets an error reply, never a crash
            if exc.noreply:
                return None
            return encode(Reply(id=exc.req_id, error=str(exc), kind="StoreError"))
        reply = self._reply(req, lambda: handle_request(self, req))
        if isinstance(reply, Later):
            self._pool.submit(self._finish, ident, req, reply)
            return None
        return None if req.noreply else reply  # noreply: fire-and-forget (release)

    def _reply(self, req: NodeRequest, fn: Callable[[], Reply | Later]) -> bytes | Later:
        try:
            reply = fn()
            if isinstance(reply, Later):
                return reply
            reply.ok = True
        except StoreError as exc:
            reply = Reply(error=str(exc), kind=type(exc).__name__)
        except Exception as exc:  # noqa: BLE001
            logger.exception("store request %r failed", type(req).__name__.lower())
            reply = Reply(error=f"internal error: {exc!r}", kind="StoreError")
        reply.id = req.id
        return encode(reply)
