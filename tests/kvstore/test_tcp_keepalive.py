"""A TCP transfer session that idles between fetches ends once its peer is gone without a
word (TCP keepalive), instead of holding its thread and socket forever."""

from __future__ import annotations

import socket
import time

from kvrelay.kvstore.transport import tcp
from kvrelay.kvstore.transport.tcp import TcpServer, connect


def test_server_sessions_use_tcp_keepalive():
    server = TcpServer(
        "127.0.0.1", 0, b"s", lambda req: ({"ok": True, "found": 0}, [], lambda: None), 5.0
    )
    try:
        peer = connect(f"127.0.0.1:{server.port}", b"s", 5.0)
        deadline = time.monotonic() + 5
        while not server._conns:  # the session thread registers its socket on accept
            assert time.monotonic() < deadline, "no session"
            time.sleep(0.01)
        [conn] = list(server._conns)
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == tcp.KEEPIDLE_S
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == tcp.KEEPINTVL_S
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == tcp.KEEPCNT
        assert peer.fetch({"op": "fetch", "keys": []}, [], 5.0) == 0  # and it serves
        peer.close()
    finally:
        server.close()
