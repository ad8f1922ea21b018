"""The store's one base exception and its specific kinds (messages say what to do)."""

from __future__ import annotations

from kvrelay.core.errors import KvrelayError


class StoreError(KvrelayError):
    """Base class of every kvstore error."""


class PageFormatError(StoreError):
    """A page header or payload is malformed, truncated or fails its checksum."""


class IncompatiblePageError(StoreError):
    """A request's model fingerprint or page geometry does not match this store node."""


class AuthError(StoreError):
    """A peer failed the shared-secret challenge (or we did)."""


class TransferError(StoreError):
    """A remote page transfer failed or timed out; the caller recomputes the pages."""


class StoreUnavailableError(StoreError):
    """The local store node did not answer within the timeout."""


class StoreNodeDownError(StoreUnavailableError):
    """The local store node is down (its socket closed or refuses connections): not a slow node."""


class TransferTimeoutError(TransferError):
    """A remote transfer did not finish within its time bound."""
