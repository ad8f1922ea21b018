"""Page keys: chained blake2b hashes of (parent key, token ids, model fingerprint, cache salt).

Torch-free on purpose: the engine's block pool, the store and the ingress (route decisions)
all compute the same keys. Equal prefixes give equal keys, so pages are shared across requests,
workers, hosts and restarts; `cache_salt` isolates tenants.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

DEFAULT_PAGE_SIZE = 16
KEY_BYTES = 16
_ROOT = b"kvrelay-page-root-v1"


def page_key(
    parent: bytes | None, token_ids: Sequence[int], model_fingerprint: str, cache_salt: str = ""
) -> bytes:
    """Key of one page given its parent page's key (None for the first page)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(model_fingerprint.encode())
    h.update(b"\x00")
    h.update(cache_salt.encode())
    return h.digest()


def lora_fingerprint(model_fingerprint: str, lora: str) -> str:
    """The fingerprint the pages of a LoRA adapter's requests are keyed by ("": the model's).
    `lora` is the adapter's identity (name and weights digest); it goes before the separator
    that the cache salt follows, so no salt makes an adapter's keys another's or the base's."""
    return f"{model_fingerprint}+lora:{lora}" if lora else model_fingerprint


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    model_fingerprint: str,
    cache_salt: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of every *full* page of `token_ids`; a partial last page has no key."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_key(
            parent, token_ids[start : start + page_size], model_fingerprint, cache_salt
        )
        keys.append(parent)
    return keys


def holders(value: bytes | str | None) -> list[str]:
    """The store node ids in a page directory value (`Keys.pages`: comma-separated)."""
    if not value:
        return []
    text = value.decode() if isinstance(value, bytes) else value
    return [node for node in text.split(",") if node]


MAX_HINT_KEYS = 4096  # a store request's bound: a longer prompt's hint names its first pages


class PrefetchHint(msgspec.Struct, array_like=True):
    """The leading pages of a request just queued (Keys.prefetch): `keys` of the model with
    `fingerprint`; store nodes of that model bring them up while the request waits."""

    fingerprint: str
    keys: list[bytes]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> PrefetchHint | None:
        """The hint in `data`, or None when it is not one (never raises on input)."""
        try:
            hint = msgspec.msgpack.decode(data, type=cls)
        except msgspec.MsgspecError:
            return None
        if len(hint.keys) > MAX_HINT_KEYS or any(len(k) != KEY_BYTES for k in hint.keys):
            return None
        return hint
