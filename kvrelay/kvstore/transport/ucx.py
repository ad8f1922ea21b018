"""UCX transport (ucxx) for store-to-store page transfers: same session as `session.py`
(HMAC challenge, fetch request, pages) carried over a UCX endpoint. Runs on CPU over TCP and
shared memory; CUDA/NVLink/RDMA transports apply where UCX finds them. Imported only when used.
The client side is a `Peer` (`transport/peer.py`, blocking calls from the fetch pool threads)
whose session coroutines run on the process's UCX loop (`ucx_runtime`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvrelay.kvstore.errors import AuthError, StoreError, TransferError, TransferTimeoutError
from kvrelay.kvstore.transport import ucx_runtime  # also sets the UCX environment for ucxx
from kvrelay.kvstore.transport.session import (
    NONCE,
    ServeFn,
    check_client,
    client_proof,
    pack,
    unpack,
)
from kvrelay.kvstore.transport.ucx_local import BUFFERS, UcxEndpoint

logger = logging.getLogger(__name__)

T = TypeVar("T")


def available() -> bool:
    """True if ucxx imports (the `ucxx-cu12` wheel is installed)."""
    try:
        import ucxx  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    return True


async def start_ucx_server(port: int, secret: bytes, serve: ServeFn, timeout_s: float) -> UcxServer:
    """A UCX listener answering fetches (`port` 0 picks one); returns it (`.port`)."""
    import ucxx

    eps: set[UcxEndpoint] = set()

    async def handler(ep: UcxEndpoint) -> None:
        eps.add(ep)
        try:
            nonce = os.urandom(NONCE)
            await ep.send_obj(nonce)
            msg = bytes(await asyncio.wait_for(ep.recv_obj(), timeout_s))
            try:
                proof = check_client(secret, nonce, msg)
            except AuthError as exc:
                await ep.send_obj(pack({"ok": False, "error": str(exc)}))
                logger.warning("refused UCX store peer: %s", exc)
                return
            await ep.send_obj(pack({"ok": True, "proof": proof}))
            while True:
                raw = bytes(await ep.recv_obj())
                reply, views, release = serve(unpack(raw))
                try:
                    await ep.send_obj(pack(reply))
                    sends = [ep.send(view) for view in views]  # all posted at once
                    await asyncio.wait_for(asyncio.gather(*sends), timeout_s)
                finally:
                    release()
        except (TimeoutError, ucxx.exceptions.UCXError, StoreError) as exc:
            logger.debug("UCX store peer session ended: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a broken peer must not kill the listener
            logger.info("UCX store peer session ended: %r", exc)
        finally:
            eps.discard(ep)
            ep.abort()

    return UcxServer(ucxx.create_listener(handler, port=port or None), eps)


class UcxServer:
    """A UCX listener and its open peer endpoints."""

    def __init__(self, listener: Any, eps: set[UcxEndpoint]):
        self.listener, self.eps = listener, eps
        self.port = listener.port

    def close(self) -> None:
        for ep in list(self.eps):
            ep.abort()  # fails the session's pending receive, which ends its handler
        self.eps.clear()
        self.listener.close()


def connect(address: str, secret: bytes, timeout_s: float) -> UcxPeer:
    """An authenticated UCX endpoint to `address` ("host:port"), a `Peer` (blocking)."""
    host, port = address.rsplit(":", 1)
    peer = UcxPeer(UcxSession(host, int(port)), ucx_runtime.loop())
    try:
        peer.wait(peer.session.connect(secret, timeout_s), timeout_s, "connect to")
    except BaseException:
        peer.close()
        raise
    return peer


class UcxPeer:
    """A `Peer`: a `UcxSession` driven from a fetch pool thread on the UCX loop."""

    def __init__(self, session: UcxSession, loop: asyncio.AbstractEventLoop):
        self.session, self.loop = session, loop

    def wait(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        """Run `coro` on the UCX loop and wait for it; the coroutine bounds itself (a backstop)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s + 1)
        except TimeoutError as exc:
            fut.cancel()
            where = f"{self.session.host}:{self.session.port}"
            raise TransferTimeoutError(f"UCX {what} {where} timed out") from exc

    def fetch(self, request: dict, dsts: list[memoryview], timeout_s: float) -> int:
        try:
            return self.wait(self.session.fetch(request, dsts, timeout_s), timeout_s, "fetch from")
        except BaseException:
            self.close()  # a failed session is never reused
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.session.close)


class UcxSession:
    """An authenticated UCX endpoint to one peer, reused across fetches (use from one loop)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.ep: UcxEndpoint | None = None

    async def connect(self, secret: bytes, timeout_s: float) -> None:
        import ucxx

        try:
            ep: UcxEndpoint = await asyncio.wait_for(
                ucxx.create_endpoint(self.host, self.port, connect_timeout=timeout_s), timeout_s
            )
            self.ep = ep
            nonce = bytes(await asyncio.wait_for(ep.recv_obj(), timeout_s))
            hello, expect = client_proof(secret, nonce)
            await ep.send_obj(hello)
            reply = unpack(bytes(await asyncio.wait_for(ep.recv_obj(), timeout_s)))
        except TimeoutError as exc:
            self.close()
            raise TransferTimeoutError(f"UCX connect to {self.host}:{self.port} timed out") from exc
        except ucxx.exceptions.UCXError as exc:
            self.close()
            raise TransferError(f"UCX connect to {self.host}:{self.port} failed: {exc!r}") from exc
        if not reply.get("ok"):
            self.close()
            raise AuthError(f"peer {self.host}:{self.port} refused us: {reply.get('error')}")
        if not hmac.compare_digest(reply.get("proof", b""), expect):
            self.close()
            raise AuthError(f"peer {self.host}:{self.port} failed the shared-secret challenge")

    async def fetch(self, request: dict, dsts: list[memoryview], timeout_s: float) -> int:
        """Fetch pages into `dsts`; returns how many arrived. Raises TransferError."""
        import ucxx

        ep = self.ep
        assert ep is not None, "connect() first"

        async def session() -> int:
            await ep.send_obj(pack(request))
            reply = unpack(bytes(await ep.recv_obj()))
            if not reply.get("ok"):
                raise TransferError(f"peer {self.host}:{self.port}: {reply.get('error')}")
            found = int(reply.get("found", 0))
            if found > len(dsts):
                raise TransferError(f"peer sent {found} pages for {len(dsts)} keys")
            # Receive into a private buffer: after a timeout UCX may still write into it, and
            # it must not be an arena slot that holds another page by then.
            await BUFFERS.receive(ep.recv, dsts, found)
            return found

        try:
            return await asyncio.wait_for(session(), timeout_s)
        except TimeoutError as exc:
            raise TransferTimeoutError(
                f"UCX fetch from {self.host}:{self.port} timed out after {timeout_s}s"
            ) from exc
        except ucxx.exceptions.UCXError as exc:
            raise TransferError(f"UCX fetch from {self.host}:{self.port} failed: {exc!r}") from exc

    def close(self) -> None:
        if self.ep is not None:
            self.ep.abort()
            self.ep = None
