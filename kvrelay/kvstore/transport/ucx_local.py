"""UCX between store nodes on the same host: endpoints from exchanged worker addresses.

An endpoint made from a listener always runs over TCP; one made from the peer's worker address
(published in Redis as `ucx_addr`) lets UCX pick shared memory (posix/sysv/cma), several times
faster on one host. Error handling must be off for that, so UCX does not notice a dead peer:
every wait here is bounded by the transfer timeout instead, and receives land in private buffers.

Session (all tag messages; control messages are padded to CTRL bytes):
  B -> A  tag REQUEST_TAG:  {addr: B's worker address, reply_tag, nonce}
  A -> B  tag reply_tag:    {nonce, proof, session_tag}   (A proves the secret first)
  B -> A  tag session_tag:  {proof, request}
  A -> B  tag reply_tag:    {ok, found} then `found` whole pages
  B -> A  tag session_tag:  {request}    (later fetches reuse the session: one round trip)
A session serves one fetch at a time; after a failure B never reuses it (its tags may still
carry late messages), and A ends it after SESSION_IDLE_S without a request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvrelay.kvstore.errors import AuthError, StoreError, TransferError, TransferTimeoutError
from kvrelay.kvstore.transport.session import NONCE, ServeFn, mac, pack, unpack

logger = logging.getLogger(__name__)

CTRL = 8192
SESSION_IDLE_S = 30.0  # A drops a session idle this long; B reuses one for half of it
REQUEST_TAG = 0x6B7672656C6179  # "kvrelay"
_LEN = struct.Struct("<I")


class UcxEndpoint(Protocol):
    """What the transports use of a `ucxx` endpoint (ucxx ships no type information)."""

    async def send(self, buffer: Any, tag: int | None = None, force_tag: bool = False) -> None: ...

    async def recv(self, buffer: Any, tag: int | None = None, force_tag: bool = False) -> None: ...

    async def send_obj(self, obj: Any, tag: int | None = None) -> None: ...

    async def recv_obj(self, tag: int | None = None) -> Any: ...

    def abort(self) -> None: ...


def host_id() -> str:
    """Identifies this host (and boot): peers with the same id may use shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


def _ctrl(obj: dict) -> bytearray:
    raw = pack(obj)
    if len(raw) + 4 > CTRL:
        raise StoreError(f"control message of {len(raw)} bytes exceeds {CTRL}")
    buf = bytearray(CTRL)
    buf[:4] = _LEN.pack(len(raw))
    buf[4 : 4 + len(raw)] = raw
    return buf


def _parse(buf: bytearray) -> dict:
    (n,) = _LEN.unpack(buf[:4])
    if n > CTRL - 4:
        raise TransferError("malformed control message")
    return unpack(bytes(buf[4 : 4 + n]))


class RecvBuffers:
    """Reusable private receive buffers (pre-faulted, so a fetch does not pay page faults).

    A buffer whose receive failed or timed out is never reused nor freed: UCX may still write
    into it later (no endpoint error handling), so it is parked in `quarantine` for good."""

    def __init__(self) -> None:
        self._idle: list[bytearray] = []
        self.quarantine: list[bytearray] = []

    def take(self, nbytes: int) -> bytearray:
        for i, buf in enumerate(self._idle):
            if len(buf) >= nbytes:
                return self._idle.pop(i)
        return bytearray(nbytes)

    def give(self, buf: bytearray, ok: bool) -> None:
        if ok:
            self._idle = sorted([*self._idle, buf], key=len)[-4:]  # keep the 4 largest
        else:
            self.quarantine.append(buf)
            logger.warning(
                "parked a %d-byte receive buffer after a failed UCX fetch (%d parked)",
                len(buf),
                len(self.quarantine),
            )

    async def receive(self, recv, dsts: list[memoryview], found: int) -> None:
        """Receive `found` pages with `recv(view)` into a private buffer, then copy to `dsts`."""
        size = len(dsts[0]) if found else 0
        buf = self.take(size * found)
        ok = False
        try:
            view = memoryview(buf)
            parts = [view[i * size : (i + 1) * size] for i in range(found)]
            # Post every receive at once, then copy each page out as it lands (overlapping
            # the copies with the remaining transfers).
            tasks = [asyncio.ensure_future(recv(part)) for part in parts]
            try:
                for task, dst, part in zip(tasks, dsts, parts, strict=False):
                    await task
                    dst[:] = part
            finally:
                for task in tasks:
                    task.cancel()
            ok = True
        finally:
            self.give(buf, ok)


BUFFERS = RecvBuffers()  # one per process: all UCX fetches run on the node's event loop


async def _recv_ctrl(tag: int, timeout_s: float) -> dict:
    import ucxx

    buf = bytearray(CTRL)
    await asyncio.wait_for(ucxx.recv(buf, tag=tag), timeout_s)
    return _parse(buf)


@dataclass(slots=True)
class _Session:
    ep: UcxEndpoint
    session_tag: int
    reply_tag: int
    used: float = 0.0


class LocalUcx:
    """Both sides of same-host UCX transfers for one node (runs in the node's event loop)."""

    def __init__(self, secret: bytes, timeout_s: float):
        self.secret, self.timeout_s = secret, timeout_s
        self._eps: dict[bytes, UcxEndpoint] = {}
        self._task: asyncio.Task | None = None
        self._sessions: set[asyncio.Task] = set()  # served sessions (ended on close)
        self._idle: dict[str, list[_Session]] = {}  # peer address -> sessions ready for reuse

    @property
    def address(self) -> str:
        import ucxx

        return ucxx.get_worker_address().tobytes().hex()

    async def _endpoint(self, addr: bytes) -> UcxEndpoint:
        import ucxx

        ep = self._eps.get(addr)
        if ep is None:
            ep = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(addr), endpoint_error_handling=False
            )
            self._eps[addr] = ep
        return ep

    # -- server ------------------------------------------------------------------------------
    def start(self, serve: ServeFn) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept(serve))

    async def _accept(self, serve: ServeFn) -> None:
        import ucxx

        while True:
            buf = bytearray(CTRL)
            await ucxx.recv(buf, tag=REQUEST_TAG)
            task = asyncio.get_running_loop().create_task(self._session(buf, serve))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _session(self, first: bytearray, serve: ServeFn) -> None:
        try:
            hello = _parse(first)
            ep = await self._endpoint(bytes(hello["addr"]))
            reply_tag, session_tag = int(hello["reply_tag"]), secrets.randbits(63)
            nonce = os.urandom(NONCE)
            proof = mac(self.secret, b"kvrelay-server", bytes(hello["nonce"]), nonce)
            msg = {"nonce": nonce, "proof": proof, "session_tag": session_tag}
            await ep.send(_ctrl(msg), tag=reply_tag, force_tag=True)
            second = await _recv_ctrl(session_tag, self.timeout_s)
            expect = mac(self.secret, b"kvrelay-client", nonce, bytes(hello["nonce"]))
            if not hmac.compare_digest(second.get("proof", b""), expect):
                logger.warning("refused same-host UCX store peer: wrong secret")
                err = {"ok": False, "error": "peer failed the shared-secret challenge"}
                await ep.send(_ctrl(err), tag=reply_tag, force_tag=True)
                return
            while True:
                reply, views, release = serve(second.get("request") or {})
                try:
                    await ep.send(_ctrl(reply), tag=reply_tag, force_tag=True)
                    # Post every page at once: one rendezvous at a time pays a wake-up each.
                    sends = [ep.send(view, tag=reply_tag, force_tag=True) for view in views]
                    await asyncio.wait_for(asyncio.gather(*sends), self.timeout_s)
                finally:
                    release()
                try:
                    second = await _recv_ctrl(session_tag, SESSION_IDLE_S)
                except TimeoutError:
                    return  # idle: B stopped using it (B reuses sessions for half this time)
        except Exception as exc:  # noqa: BLE001 - one bad session must not stop the server
            logger.info("same-host UCX session ended: %r", exc)

    # -- client ------------------------------------------------------------------------------
    async def fetch(
        self, peer_addr: str, request: dict, dsts: list[memoryview], timeout_s: float | None = None
    ) -> int:
        """Fetch pages from the node whose worker address is `peer_addr` (hex)."""
        timeout_s = self.timeout_s if timeout_s is None else max(timeout_s, 0.05)
        try:
            return await asyncio.wait_for(self._fetch(peer_addr, request, dsts), timeout_s)
        except TimeoutError as exc:
            raise TransferTimeoutError(
                f"same-host UCX fetch timed out after {timeout_s:.1f}s"
            ) from exc

    async def _open(self, peer_addr: str) -> tuple[_Session, bytes]:
        """A new authenticated session (A proves the secret); returns it and our proof."""
        ep = await self._endpoint(bytes.fromhex(peer_addr))
        reply_tag, nonce = secrets.randbits(63), os.urandom(NONCE)
        me = bytes.fromhex(self.address)
        hello = {"addr": me, "reply_tag": reply_tag, "nonce": nonce}
        await ep.send(_ctrl(hello), tag=REQUEST_TAG, force_tag=True)
        first = await _recv_ctrl(reply_tag, self.timeout_s)
        expect = mac(self.secret, b"kvrelay-server", nonce, bytes(first.get("nonce", b"")))
        if not hmac.compare_digest(first.get("proof", b""), expect):
            raise AuthError("same-host UCX peer failed the shared-secret challenge")
        proof = mac(self.secret, b"kvrelay-client", bytes(first["nonce"]), nonce)
        return _Session(ep, int(first["session_tag"]), reply_tag), proof

    def _take(self, peer_addr: str) -> _Session | None:
        idle = self._idle.get(peer_addr, [])
        while idle:
            sess = idle.pop()
            if time.monotonic() - sess.used < SESSION_IDLE_S / 2:
                return sess
        return None

    async def _fetch(self, peer_addr: str, request: dict, dsts: list[memoryview]) -> int:
        import ucxx

        sess = self._take(peer_addr)
        msg: dict = {"request": request}
        if sess is None:
            sess, msg["proof"] = await self._open(peer_addr)
        ok = False
        try:
            await sess.ep.send(_ctrl(msg), tag=sess.session_tag, force_tag=True)
            reply = await _recv_ctrl(sess.reply_tag, self.timeout_s)
            if not reply.get("ok"):
                error = reply.get("error")
                if "secret" in str(error):
                    raise AuthError(f"same-host UCX peer refused us: {error}")
                raise TransferError(f"same-host UCX peer: {error}")
            found = int(reply.get("found", 0))
            if found > len(dsts):
                raise TransferError(f"peer sent {found} pages for {len(dsts)} keys")
            # Private buffer: after a timeout UCX may still write into it (module docstring).
            tag = sess.reply_tag
            await BUFFERS.receive(lambda part: ucxx.recv(part, tag=tag), dsts, found)
            ok = True
            return found
        finally:
            if ok:  # a failed session may still get late messages: never reuse it
                sess.used = time.monotonic()
                self._idle.setdefault(peer_addr, []).append(sess)

    def close(self) -> list[asyncio.Task]:
        """Stop serving (call in the loop); returns the cancelled tasks to await."""
        tasks = [t for t in (self._task, *self._sessions) if t is not None]
        for task in tasks:
            task.cancel()
        self._idle.clear()
        for ep in self._eps.values():
            ep.abort()
        self._eps.clear()
        return tasks
