"""StoreClient: a worker's handle on its host's store node.

Requests go over the node's ZeroMQ IPC socket (`<run_dir>/kvstore.sock`); page bytes are copied
straight between the caller's memory and the shared arena the node names in its hello reply.
Whether the node is there at all comes from its socket (`liveness.NodeLiveness`), not from
timeouts: a request to a node that went away fails at once until it is back, one waiting for
its reply fails as soon as the node is lost (StoreNodeDownError), and `timeout_s` bounds only a
live node (or one not seen up yet: it may be starting).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from kvrelay.core.config import setting
from kvrelay.kvstore.arena import HostArena
from kvrelay.kvstore.config import SECTION as STORE_SECTION
from kvrelay.kvstore.config import StoreConfig, socket_url
from kvrelay.kvstore.errors import (
    AuthError,
    IncompatiblePageError,
    PageFormatError,
    StoreError,
    StoreNodeDownError,
    StoreUnavailableError,
    TransferError,
)
from kvrelay.kvstore.liveness import NodeLiveness
from kvrelay.kvstore.messages import (
    MAX_KEYS,
    Abort,
    Commit,
    CommitReply,
    Contains,
    CountReply,
    Demote,
    Evict,
    Get,
    Hello,
    HelloReply,
    Ls,
    LsReply,
    Paged,
    Prefetch,
    Put,
    R,
    Release,
    Reply,
    Request,
    Retain,
    SlotsReply,
    Stats,
    StatsReply,
    decode_reply,
    encode,
)
from kvrelay.kvstore.page import (
    HEADER_BYTES,
    PageSpec,
    check_header,
    checksum,
    pack_header,
    verify_page,
)

logger = logging.getLogger(__name__)

_KINDS = {
    c.__name__: c
    for c in (
        IncompatiblePageError,
        PageFormatError,
        AuthError,
        TransferError,
        StoreUnavailableError,
    )
}
Fill = Callable[[list[tuple[int, memoryview]]], None]
LOSS_CHECK_MS = 20  # a request waiting for its reply looks at the node's liveness this often
_ACQUIRE = threading.Lock()


class StoreClient:
    """Put and get pages of one model (`spec`) through the local store node."""

    def __init__(self, run_dir: str | Path, spec: PageSpec | None = None, timeout_s: float = 10.0):
        self.url = socket_url(run_dir)
        self.spec = spec
        self.timeout_ms = int(timeout_s * 1000)
        self.arena: HostArena | None = None
        self._gen: int | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._sock = None
        self._liveness: NodeLiveness | None = None
        self._release: weakref.finalize | None = None
        self.num_corrupt = 0

    @property
    def liveness(self) -> NodeLiveness:
        """The node's liveness (the process's one watcher of this socket, started on first use)."""
        live = self._liveness
        if live is None:
            with _ACQUIRE:  # the compute thread and a loader thread may ask first together
                live = self._liveness
                if live is None:
                    live = self._liveness = NodeLiveness.acquire(self.url)
                    self._release = weakref.finalize(self, live.release)
        return live

    # -- plumbing ---------------------------------------------------------------------------
    def _socket(self):
        import zmq

        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.url)
        return self._sock

    def _stamp(self, msg: Request) -> bytes:
        """The request with its id and (pages of our model) fingerprint and page size."""
        msg.id = next(self._ids)
        if self.spec is not None and isinstance(msg, Paged):
            if msg.fp is None:
                msg.fp = self.spec.fingerprint
            if msg.page_bytes is None:
                msg.page_bytes = self.spec.page_bytes
        return encode(msg)

    def request(self, msg: Request, reply: type[R]) -> R:
        """One request/reply; raises the node's error as a StoreError subclass, and
        StoreNodeDownError at once when the node is down or goes away meanwhile."""
        op = msg.__struct_config__.tag
        live = self.liveness
        with self._lock:
            # A node seen to go away is down until it is back; one never seen up may still be
            # starting (workers and node start together), so it is waited for as before.
            if live.down and live.losses and not live.listening():
                raise StoreNodeDownError(f"store node at {self.url} is down; {op!r} not sent")
            losses = live.losses
            sock = self._socket()
            body = self._stamp(msg)
            sock.send_multipart([b"", body])
            deadline = time.monotonic() + self.timeout_ms / 1000
            while True:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    self._sock = None  # drop it so a late reply cannot answer the next request
                    sock.close()
                    raise StoreUnavailableError(
                        f"store node at {self.url} did not answer {op!r} within "
                        f"{self.timeout_ms / 1000:.1f}s (is `kvrelay store` running?)"
                    )
                if not sock.poll(max(1, int(min(left_ms, LOSS_CHECK_MS)))):
                    if live.losses != losses:  # a node went away since the request was sent
                        if live.listening():
                            # another listens there already: the loss the watcher saw may be
                            # the one before it (a restart just before the send), so the reply
                            # is waited for (a request the lost node took times out as before)
                            losses = live.losses
                            continue
                        self._sock = None  # and what is still queued must not reach the next
                        sock.close()
                        raise StoreNodeDownError(
                            f"store node at {self.url} went away while answering {op!r}"
                        )
                    continue
                got = decode_reply(sock.recv_multipart()[-1], reply)
                if got.id == msg.id:
                    break
        if not got.ok:
            raise _KINDS.get(got.kind, StoreError)(got.error or "unknown error")
        return got

    def send(self, msg: Request) -> None:
        """Fire-and-forget request (`noreply`): saves a round trip; the node answers nothing."""
        import zmq

        live = self.liveness
        if live.down and not live.listening():  # what it releases or demotes went with it
            return
        with self._lock:
            msg.noreply = True
            body = self._stamp(msg)
            try:
                self._socket().send_multipart([b"", body], zmq.NOBLOCK)
            except zmq.Again:  # the node is gone; its pins expire with it
                logger.debug(
                    "store node at %s is not taking requests; %s dropped",
                    self.url,
                    msg.__struct_config__.tag,
                )

    def hello(self) -> HelloReply:
        """Say hello (the node checks fingerprint and page size) and map its arena."""
        reply = self.request(Hello(), HelloReply)
        self.map_arena(reply.gen, reply.arena)
        return reply

    def connect(self) -> dict:
        """`hello()` as a plain dict (node_id, arena, num_slots, page_bytes, ...)."""
        return _plain(self.hello())

    def map_arena(self, gen: int | None, arena: str = "") -> HostArena:
        """The node's arena mapped (again if its generation `gen` changed; `arena` its path)."""
        if self.arena is None or gen != self._gen:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            if not arena:
                hello = self.request(Hello(), HelloReply)
                arena, gen = hello.arena, hello.gen
            self.arena = HostArena.open(Path(arena))
            self._gen = gen
        return self.arena

    def _need_spec(self) -> PageSpec:
        if self.spec is None:
            raise StoreError("this StoreClient has no PageSpec; pass one to put or get pages")
        return self.spec

    # -- pages ------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes], remote: bool = True) -> int:
        """Length of the longest prefix of `keys` the store holds (here or on a peer)."""
        self._need_spec()
        if not keys:
            return 0
        return self.request(Contains(keys=list(keys), remote=remote), CountReply).n

    def put_with(self, keys: list[bytes], fill: Fill, num_tokens: int | None = None) -> int:
        """Reserve slots for new keys, let `fill([(i, payload view)])` write them, publish them.

        Keys already stored are skipped (write-once). Returns the number of new pages."""
        spec = self._need_spec()
        if not keys:
            return 0
        reply = self.request(Put(keys=list(keys)), SlotsReply)
        arena = self.map_arena(reply.gen)
        todo = [(i, k, s) for i, (k, s) in enumerate(zip(keys, reply.slots, strict=True)) if s >= 0]
        if not todo:
            return 0
        t_keys, t_slots = [k for _, k, _ in todo], [s for _, _, s in todo]
        try:
            fill([(i, arena.payload(s)) for i, _, s in todo])
            for _, key, slot in todo:
                arena.slot(slot)[:HEADER_BYTES] = pack_header(
                    spec, key, checksum(arena.payload(slot)), num_tokens
                )
        except BaseException:
            self.request(Abort(keys=t_keys, slots=t_slots), Reply)
            raise
        committed = self.request(Commit(keys=t_keys, slots=t_slots), CommitReply)
        errors = [e for e in committed.errors if e]
        if errors:
            raise StoreError(f"{len(errors)} of {len(todo)} pages refused: {errors[0]}")
        return len(todo)

    def put(self, keys: list[bytes], pages: list) -> int:
        """Store page payloads (buffers of `spec.page_bytes`); returns how many were new."""
        n = self._need_spec().page_bytes
        for p in pages:
            if memoryview(p).nbytes != n:
                raise StoreError(f"a page payload is {memoryview(p).nbytes} bytes, expected {n}")

        def fill(items: list[tuple[int, memoryview]]) -> None:
            for i, dst in items:
                dst[:] = memoryview(pages[i]).cast("B")

        return self.put_with(keys, fill)

    @contextmanager
    def pinned(
        self, keys: list[bytes], verify: bool = False, remote: bool = True
    ) -> Iterator[list[memoryview]]:
        """Payload views of the longest available prefix, pinned while inside.

        Every page's header is checked (key, size, fingerprint, header CRC); the node verified
        the payload CRC when the page entered the arena (put, disk promotion or remote fetch),
        so `verify=True` (recompute it here) is only for the paranoid."""
        spec = self._need_spec()
        if not keys:
            yield []
            return
        reply = self.request(Get(keys=list(keys), remote=remote), SlotsReply)
        slots = reply.slots
        try:
            arena = self.map_arena(reply.gen)
            views = []
            for key, slot in zip(keys, slots, strict=False):
                try:
                    if verify:
                        verify_page(arena.slot(slot), key, spec.page_bytes, spec.fingerprint)
                    else:
                        check_header(arena.slot(slot), key, spec.page_bytes, spec.fingerprint)
                except StoreError as exc:
                    self.num_corrupt += 1
                    logger.warning("store page %s failed verification: %s", key.hex(), exc)
                    break
                views.append(arena.payload(slot))
            yield views
        finally:
            if slots:  # the node handles one client's requests in order: no reply needed
                self.send(Release(slots=slots))

    def get_into(self, keys: list[bytes], dsts: list, verify: bool = False) -> int:
        """Copy the available prefix into writable buffers `dsts`; returns pages copied."""
        with self.pinned(keys, verify) as views:
            for view, dst in zip(views, dsts, strict=False):
                memoryview(dst).cast("B")[:] = view
            return len(views)

    def get(self, keys: list[bytes], verify: bool = False) -> list[bytes]:
        """Payload bytes of the available prefix of `keys`."""
        with self.pinned(keys, verify) as views:
            return [bytes(v) for v in views]

    # -- operators --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Page counts, counters and listener addresses of the node, as plain data."""
        return _plain(self.request(Stats(), StatsReply))

    def ls(self, limit: int = 1000) -> dict[str, list[str]]:
        """Hex keys per tier (host, disk), least recently used first."""
        return self.request(Ls(limit=limit), LsReply).tiers

    def evict(self, tier: str = "host") -> int:
        """Drop the unpinned pages of `tier`; returns how many."""
        return self.request(Evict(tier=tier), CountReply).n

    def demote(self, keys: list[bytes], wait: bool = False) -> int | None:
        """Make these pages the arena's first to evict; fire-and-forget unless `wait` (then
        how many the arena held)."""
        msg = Demote(keys=list(keys))
        if not wait:
            self.send(msg)
            return None
        return self.request(msg, CountReply).n

    def retain(
        self, keys: list[bytes], session: str, ttl_s: float, wait: bool = False
    ) -> int | None:
        """Keep these pages for `session` until `ttl_s` from now; fire-and-forget unless
        `wait` (then how many the node holds). Sent in requests of at most MAX_KEYS keys."""
        n = 0
        for i in range(0, max(len(keys), 1), MAX_KEYS):
            msg = Retain(keys=list(keys[i : i + MAX_KEYS]), session=session, ttl_s=ttl_s)
            if wait:
                n += self.request(msg, CountReply).n
            else:
                self.send(msg)
        return n if wait else None

    def prefetch(self, keys: list[bytes], remote: bool = False) -> int:
        """Bring the leading pages of `keys` into the arena (disk, and peers when `remote`);
        how many lead the arena now."""
        return self.request(Prefetch(keys=list(keys), remote=remote), CountReply).n

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=500)  # deliver a last fire-and-forget release
            self._sock = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._release is not None:
            self._release()  # a finalizer runs at most once
            self._release = self._liveness = None

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(reply: Reply) -> dict:
    """A reply's own fields as builtins (no id, ok, error, kind)."""
    out = msgspec.to_builtins(reply)
    for field in ("id", "ok", "error", "kind"):
        out.pop(field, None)
    return out


def default_run_dir() -> str:
    """`KVRELAY_STORE_RUN_DIR` or the StoreConfig default."""
    return str(setting(StoreConfig, "run_dir", STORE_SECTION))
