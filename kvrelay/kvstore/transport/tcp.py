"""The TCP transport for store-to-store page transfers (the session is in `session.py`).

TCP frames messages with a 4-byte length; pages go raw. The client side is a `Peer`
(`transport/peer.py`): blocking calls from the node's fetch pool threads.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

from kvrelay.kvstore.errors import AuthError, StoreError, TransferError, TransferTimeoutError
from kvrelay.kvstore.transport.session import (
    NONCE,
    PeerClosedError,
    ServeFn,
    check_client,
    client_proof,
    pack,
    unpack,
)

logger = logging.getLogger(__name__)

MAX_MSG = 1 << 20
_LEN = struct.Struct("<I")
# An idle session waits for the peer's next request without a bound; TCP keepalive ends it
# (its thread and socket) once the peer is gone without a word: a host that died, or a link
# cut while the peer closed its end. About KEEPIDLE + KEEPINTVL * KEEPCNT seconds.
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 30, 10, 3


def _frame(raw: bytes) -> bytes:
    return _LEN.pack(len(raw)) + raw


# -- TCP server (blocking, a thread per peer session) -------------------------------------------
class TcpServer:
    """Answers peers' fetches on `host:port` (0 picks a port); `port` is the bound port.

    Blocking sockets on threads: pages go from arena slots to the kernel with `sendall`, no
    user-space copy (an asyncio transport copies whatever the socket does not take at once)."""

    def __init__(self, host: str, port: int, secret: bytes, serve: ServeFn, timeout_s: float):
        self.secret, self.serve, self.timeout_s = secret, serve, timeout_s
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-tcp", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._session, args=(conn, peer), name="kv-tcp-peer", daemon=True
            ).start()

    def _session(self, conn: socket.socket, peer) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(conn)
            conn.settimeout(self.timeout_s)
            nonce = os.urandom(NONCE)
            conn.sendall(_frame(nonce))
            msg = _recv_msg(conn, time.monotonic() + self.timeout_s)
            try:
                proof = check_client(self.secret, nonce, msg)
            except AuthError as exc:
                conn.sendall(_frame(pack({"ok": False, "error": str(exc)})))
                logger.warning("refused store peer %s: %s", peer, exc)
                return
            conn.sendall(_frame(pack({"ok": True, "proof": proof})))
            while True:
                try:
                    raw = _recv_msg(conn, None)  # a session may idle between fetches
                except PeerClosedError:
                    return
                reply, views, release = self.serve(unpack(raw))
                try:
                    conn.settimeout(self.timeout_s)
                    conn.sendall(_frame(pack(reply)))
                    for view in views:
                        conn.sendall(view)
                finally:
                    release()
        except (TimeoutError, OSError, StoreError) as exc:
            logger.info("store peer %s session ended: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop listening and end open sessions."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for sock in (self.sock, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv
        self.sock.close()
        self._thread.join(timeout=2)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPIDLE_S),
        ("TCP_KEEPINTVL", KEEPINTVL_S),
        ("TCP_KEEPCNT", KEEPCNT),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# -- TCP client (blocking, called from the node's request thread) --------------------------------
def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill `view`; `deadline` None waits as long as it takes (an idle session)."""
    while view:
        if deadline is None:
            sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError("transfer timed out")
            sock.settimeout(left)
        n = sock.recv_into(view)
        if n == 0:
            raise PeerClosedError("peer closed the connection mid-transfer")
        view = view[n:]


def _recv_msg(sock: socket.socket, deadline: float | None) -> bytes:
    head = bytearray(4)
    _recv_exact(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > MAX_MSG:
        raise TransferError(f"message of {n} bytes exceeds the {MAX_MSG}-byte limit")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body), deadline)
    return bytes(body)


def connect(address: str, secret: bytes, timeout_s: float) -> TcpPeer:
    """An authenticated TCP session to `address` ("host:port"), a `Peer`."""
    host, port = address.rsplit(":", 1)
    return TcpPeer(host, int(port), secret, timeout_s)


class TcpPeer:
    """An authenticated TCP session to one peer, reused across fetches (one caller at a time)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float):
        self.host, self.port = host, port
        deadline = time.monotonic() + timeout_s
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = _recv_msg(self.sock, deadline)
            hello, expect = client_proof(secret, nonce)
            self.sock.sendall(_frame(hello))
            reply = unpack(_recv_msg(self.sock, deadline))
        except TimeoutError as exc:
            self.close()
            raise TransferTimeoutError(f"TCP connect to {host}:{port} timed out") from exc
        except OSError as exc:
            self.close()
            raise TransferError(f"TCP connect to {host}:{port} failed: {exc}") from exc
        except StoreError:
            self.close()
            raise
        if not reply.get("ok"):
            self.close()
            raise AuthError(f"peer {host}:{port} refused us: {reply.get('error')}")
        if not hmac.compare_digest(reply.get("proof", b""), expect):
            self.close()
            raise AuthError(f"peer {host}:{port} failed the shared-secret challenge")

    def fetch(self, request: dict, dsts: list[memoryview], timeout_s: float) -> int:
        """Fetch pages into `dsts` (one whole-page view per key); returns how many arrived."""
        deadline = time.monotonic() + timeout_s
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(_frame(pack(request)))
            reply = unpack(_recv_msg(self.sock, deadline))
            if not reply.get("ok"):
                raise TransferError(f"peer {self.host}:{self.port}: {reply.get('error')}")
            found = int(reply.get("found", 0))
            if found > len(dsts):
                raise TransferError(f"peer sent {found} pages for {len(dsts)} keys")
            for view in dsts[:found]:
                _recv_exact(self.sock, view, deadline)
            return found
        except TimeoutError as exc:
            raise TransferTimeoutError(f"TCP fetch from {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise TransferError(f"TCP fetch from {self.host}:{self.port} failed: {exc}") from exc

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
