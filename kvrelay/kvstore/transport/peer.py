"""The `Peer` protocol every store-to-store transport implements, and the transport registry.

One concurrency model: a peer's methods are plain blocking calls, made from the node's fetch
pool threads (`remote.py`), never from an event loop. A transport that runs on asyncio (UCX, on
the process's UCX loop) hands its coroutines to that loop and waits for them on the calling
thread, so no loop ever blocks; TCP blocks on its sockets directly (no user-space copy, no
thread hop on the hot path: a hop to a loop and back costs more than a small fetch).

`TRANSPORTS` maps a `Transport` (the key of a node's listener address in the directory) to the
function that opens an authenticated session to such an address; `remote.py` looks transports
up here instead of switching on their names. UCX is imported only when a UCX session is opened.
"""

from __future__ import annotations

from typing import Protocol

from kvrelay.kvstore.errors import TransferError
from kvrelay.kvstore.transport import Transport


class Peer(Protocol):
    """An authenticated session to one peer node, reused across fetches (one fetch at a time)."""

    def fetch(self, request: dict, dsts: list[memoryview], timeout_s: float) -> int:
        """Fetch pages into `dsts` (one whole-page view per key); returns how many arrived.

        Blocks the calling thread for at most about `timeout_s`; raises TransferError
        (TransferTimeoutError past the bound, AuthError)."""
        ...

    def close(self) -> None:
        """End the session; never blocks, safe from any thread and more than once."""
        ...


class PeerFactory(Protocol):
    """Opens an authenticated session to `address` ("host:port") within `timeout_s` (blocking)."""

    def __call__(self, address: str, secret: bytes, timeout_s: float) -> Peer: ...


def _connect_tcp(address: str, secret: bytes, timeout_s: float) -> Peer:
    from kvrelay.kvstore.transport.tcp import connect

    return connect(address, secret, timeout_s)


def _connect_ucx(address: str, secret: bytes, timeout_s: float) -> Peer:
    from kvrelay.kvstore.transport.ucx import connect  # imports ucxx: only when used

    return connect(address, secret, timeout_s)


TRANSPORTS: dict[Transport, PeerFactory] = {
    Transport.TCP: _connect_tcp,
    Transport.UCX: _connect_ucx,
}


def register_transport(kind: Transport, connect: PeerFactory) -> None:
    """Add (or replace) the session factory for `kind`."""
    TRANSPORTS[kind] = connect


def connector(kind: Transport | str) -> PeerFactory:
    """The session factory for `kind`; TransferError if there is no such transport."""
    try:
        return TRANSPORTS[Transport(kind)]
    except (KeyError, ValueError) as exc:
        raise TransferError(f"no store-to-store transport {str(kind)!r}") from exc
