"""SessionRetention: the pages a named session (a conversation, an agent) keeps until its TTL.

A worker that finishes a request of a session (`prompt_cache_key`, `user`, a Responses chain)
sends the keys of its pages with the session's name and TTL (`Retain`); the node keeps them
ahead of every page no live session holds: in the arena they are evicted last (demoted to disk,
not dropped), on disk they are kept while any page no session holds can go. Each later request
of the session extends its TTL (never shortens it). When the TTL ends the session's pages are
plain pages again, the first the arena evicts (a session that did not come back is the least
likely reuse). Deadlines are wall-clock seconds, so the table survives a restart: the node
saves it beside its disk tier (`save`, atomic) and loads it at start.

Holds are counted per key: a page two sessions share (a common system prompt) stays retained
until both have ended. Not thread-safe on its own: the node's store lock guards it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

FILE_NAME = "retention.msgpack"
MAX_TTL_S = 86400.0  # the default bound on a session's TTL (StoreConfig.max_retention_s)
MAX_SESSION_CHARS = 256  # a longer name is cut (it is only the session's label)


@dataclass(slots=True)
class Session:
    until: float  # wall-clock seconds
    keys: dict[bytes, None] = field(default_factory=dict)  # in the order retained


class _Saved(msgspec.Struct, array_like=True):
    """One session on disk: its name, deadline and page keys."""

    name: str
    until: float
    keys: list[bytes]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[_Saved])


class SessionRetention:
    """Sessions, their deadlines and pages; the holds each page has."""

    def __init__(self, max_ttl_s: float):
        self.max_ttl_s = max_ttl_s
        self.sessions: dict[str, Session] = {}
        self._holds: dict[bytes, int] = {}
        self.dirty = False  # changed since the last save

    def __len__(self) -> int:
        return len(self.sessions)

    def held(self, key: bytes) -> bool:
        return key in self._holds

    @property
    def num_keys(self) -> int:
        return len(self._holds)

    def retain(self, name: str, keys: list[bytes], ttl_s: float, now: float) -> list[bytes]:
        """Hold `keys` for session `name` until at least `now + ttl_s` (bounded by the node's
        maximum); returns the keys that were held by no session before."""
        name = name[:MAX_SESSION_CHARS]
        until = now + min(max(ttl_s, 0.0), self.max_ttl_s)
        session = self.sessions.get(name)
        if session is None:
            session = self.sessions[name] = Session(until)
        session.until = max(session.until, until)
        fresh = []
        for key in keys:
            if key in session.keys:
                continue
            session.keys[key] = None
            n = self._holds.get(key, 0)
            if n == 0:
                fresh.append(key)
            self._holds[key] = n + 1
        self.dirty = True
        return fresh

    def expire(self, now: float) -> list[bytes]:
        """End the sessions past their deadline; returns the keys no session holds any more."""
        ended = [name for name, s in self.sessions.items() if s.until <= now]
        return self._end(ended)

    def forget(self, keys: list[bytes]) -> None:
        """Pages that left the node: no session holds them any more."""
        for key in keys:
            if self._holds.pop(key, None) is not None:
                for s in self.sessions.values():
                    s.keys.pop(key, None)
                self.dirty = True

    def _end(self, names: list[str]) -> list[bytes]:
        released = []
        for name in names:
            for key in self.sessions.pop(name).keys:
                n = self._holds[key] - 1
                if n:
                    self._holds[key] = n
                else:
                    del self._holds[key]
                    released.append(key)
            self.dirty = True
        return released

    def clear(self) -> list[bytes]:
        """End every session (the operator's `kv evict --tier all`)."""
        return self._end(list(self.sessions))

    # -- persistence --------------------------------------------------------------------------
    def dump(self) -> bytes:
        """The table as `save` writes it; the table counts as saved from here."""
        saved = [_Saved(name, s.until, list(s.keys)) for name, s in self.sessions.items()]
        self.dirty = False
        return _ENCODER.encode(saved)

    @staticmethod
    def save(path: Path, data: bytes) -> None:
        """Write a `dump` atomically (temporary file, fsync, rename)."""
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path, present: Callable[[bytes], bool], now: float) -> int:
        """Read a saved table (`load_bytes`); a missing or unreadable file loads nothing
        (retention is a hint: losing it costs only evictions)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            logger.warning("ignoring unreadable session table %s: %s", path, exc)
            return 0
        return self.load_bytes(data, present, now)

    def load_bytes(self, data: bytes, present: Callable[[bytes], bool], now: float) -> int:
        """Take the live sessions of a `dump`, keeping the keys `present(key)` says the node
        still holds; returns the sessions loaded."""
        try:
            saved = _DECODER.decode(data)
        except msgspec.MsgspecError as exc:
            logger.warning("ignoring a corrupt session table: %s", exc)
            return 0
        for s in saved:
            if s.until > now:
                self.retain(s.name, [k for k in s.keys if present(k)], s.until - now, now)
        self.dirty = False
        return len(self.sessions)
