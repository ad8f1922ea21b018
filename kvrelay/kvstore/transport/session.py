"""Store-to-store transfer session, independent of the transport (TCP or UCX).

Session: the server sends a nonce; the client answers with its own nonce and an HMAC of both
under the shared secret (the secret never crosses the wire); the server proves itself the same
way. Then requests `{"op": "fetch", "keys", "fp", "page_bytes"}` are answered with
`{"ok", "found"}` (or `{"ok": False, "error"}`) followed by `found` whole pages (header +
payload) for the leading keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable

import msgpack

from kvrelay.kvstore.errors import AuthError, TransferError

logger = logging.getLogger(__name__)

NONCE = 32
# serve(request) -> (reply, page views, release callback); provided by the node.
ServeFn = Callable[[dict], tuple[dict, list[memoryview], Callable[[], None]]]


def mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(message to send, the server proof we expect back)."""
    nonce = os.urandom(NONCE)
    return (
        nonce + mac(secret, b"kvrelay-client", server_nonce, nonce),
        mac(secret, b"kvrelay-server", nonce, server_nonce),
    )


def check_client(secret: bytes, server_nonce: bytes, msg: bytes) -> bytes:
    """Verify the client's proof; returns our proof for it, raises AuthError."""
    nonce, proof = msg[:NONCE], msg[NONCE:]
    if len(nonce) != NONCE or not hmac.compare_digest(
        proof, mac(secret, b"kvrelay-client", server_nonce, nonce)
    ):
        raise AuthError("peer failed the shared-secret challenge (wrong --secret?)")
    return mac(secret, b"kvrelay-server", nonce, server_nonce)


def fetch_request(keys: list[bytes], fingerprint: str | None, page_bytes: int) -> dict:
    return {"op": "fetch", "keys": keys, "fp": fingerprint, "page_bytes": page_bytes}


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class PeerClosedError(TransferError):
    """The peer closed the connection."""


def unpack(raw: bytes) -> dict:
    try:
        obj = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - any decode failure is a protocol error
        raise TransferError(f"malformed transfer message: {exc}") from exc
    if not isinstance(obj, dict):
        raise TransferError("malformed transfer message: not a map")
    return obj
