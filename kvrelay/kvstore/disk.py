"""DiskTier: content-addressed page files (`<dir>/<k0k1>/<key hex>.kvp`) with an LRU size cap.

Files are written atomically (temporary file, fsync except for demotions, rename) and the index
is rebuilt from the directory at start (oldest modification time = least recently used), so the
cache survives restarts. Every read verifies the page; a corrupt or truncated file is a miss,
counted and deleted. Over its cap it drops the least recently used page that `keep` (the node's
session retention) does not hold; a held page only when every page is held.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvrelay.kvstore.errors import PageFormatError, StoreError
from kvrelay.kvstore.page import HEADER_BYTES, verify_page

logger = logging.getLogger(__name__)

SUFFIX = ".kvp"


class DiskTier:
    """Page files under `root`, at most `capacity_bytes` in total."""

    def __init__(self, root: Path, capacity_bytes: int, page_bytes: int):
        self.root = Path(root)
        self.file_bytes = HEADER_BYTES + page_bytes
        self.page_bytes = page_bytes
        self.capacity = capacity_bytes // self.file_bytes  # pages
        if self.capacity < 1:
            raise StoreError(
                f"disk tier of {capacity_bytes} bytes holds no {self.file_bytes}-byte page"
            )
        self.num_corrupt = 0
        self.keep: Callable[[bytes], bool] = lambda key: False  # dropped last
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, Path]] = []
        for path in self.root.glob("*/*"):
            name = path.name
            if not name.endswith(SUFFIX):
                if ".tmp" in name:
                    path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
                st = path.stat()
            except (ValueError, OSError):
                continue
            if len(key) != 16 or st.st_size != self.file_bytes:
                path.unlink(missing_ok=True)  # another page size or a truncated file
                continue
            found.append((st.st_mtime, key, path))
        found.sort()
        for _, key, _ in found:
            self._lru[key] = None
        dropped = self._trim()
        logger.info(
            "disk tier %s: %d pages indexed (%d over the cap dropped)",
            self.root,
            len(self._lru),
            len(dropped),
        )

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._lru)

    def put(self, key: bytes, page, sync: bool = True) -> list[bytes]:
        """Store a page (no-op if present); returns the keys dropped to make room (LRU first).

        `sync=False` skips the fsync (demotions on the request path): a file a power cut tears
        fails its CRC on read and is a counted miss, so only durability is traded, never
        correctness."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return []
        if len(page) != self.file_bytes:
            raise StoreError(f"page is {len(page)} bytes, disk tier holds {self.file_bytes}")
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(page)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._lru[key] = None
        return self._trim()

    def _trim(self) -> list[bytes]:
        dropped = []
        while len(self._lru) > self.capacity:
            # A held page met on the way goes to the back (as if used): each is passed over
            # once per trim, and once all are held, the least recent of them goes.
            for _ in range(len(self._lru)):
                key = next(iter(self._lru))
                if not self.keep(key):
                    break
                self._lru.move_to_end(key)
            else:  # all held: back in their order, the first is the least recent
                key = next(iter(self._lru))
            del self._lru[key]
            self._path(key).unlink(missing_ok=True)
            dropped.append(key)
        return dropped

    def read_into(self, key: bytes, dst: memoryview, fingerprint: str | None = None) -> bool:
        """Copy a verified page into `dst`; False (and the file deleted) if missing or corrupt."""
        if key not in self._lru:
            return False
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(dst[: self.file_bytes])
            if n != self.file_bytes:
                raise PageFormatError(f"page file truncated to {n} bytes")
            verify_page(dst, key=key, page_bytes=self.page_bytes, fingerprint=fingerprint)
        except FileNotFoundError:
            self._lru.pop(key, None)
            return False
        except (PageFormatError, StoreError, OSError) as exc:
            logger.warning("dropping corrupt page file %s: %s", path, exc)
            self.num_corrupt += 1
            self.remove(key)
            return False
        self._lru.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return True

    def remove(self, key: bytes) -> bool:
        """Delete a page; True if it was there."""
        present = key in self._lru
        self._lru.pop(key, None)
        self._path(key).unlink(missing_ok=True)
        return present
