"""HostArena: a node-wide shared-memory file (under /dev/shm) of fixed-size page slots.

The store node creates it and owns the index (which key lives in which slot); worker processes
map the same file and copy page bytes in and out of slots directly, so a page crosses between
processes with one copy. Each slot holds one page exactly as `page.py` lays it out.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path

from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.page import HEADER_BYTES

logger = logging.getLogger(__name__)

ARENA_MAGIC = b"KVRA"
ARENA_HEADER = 4096
ALIGN = 4096
_HDR = struct.Struct("<4sIQQQ")  # magic, version, slot_stride, num_slots, page_bytes


def _map(fd: int, size: int) -> mmap.mmap:
    # Populate the page tables up front so the first copy into each slot does not fault.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


def slot_stride(page_bytes: int) -> int:
    """Bytes per slot: header + payload rounded up to 4 KiB (page-aligned slots)."""
    return -(-(HEADER_BYTES + page_bytes) // ALIGN) * ALIGN


class HostArena:
    """A mapped arena file; `slot(i)` is a writable memoryview of slot `i`."""

    def __init__(self, path: Path, mm: mmap.mmap, num_slots: int, page_bytes: int):
        self.path = path
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        self.stride = slot_stride(page_bytes)
        self._mm = mm
        self._view = memoryview(mm)
        self._cuda_registered = False

    @classmethod
    def create(cls, path: Path, arena_bytes: int, page_bytes: int) -> tuple[HostArena, bool]:
        """Open `path` if it has this geometry (returns reused=True), otherwise create it anew."""
        stride = slot_stride(page_bytes)
        num_slots = (arena_bytes - ARENA_HEADER) // stride
        if num_slots < 1:
            raise StoreError(
                f"arena of {arena_bytes} bytes holds no {page_bytes}-byte page "
                f"(one slot needs {stride + ARENA_HEADER} bytes)"
            )
        size = ARENA_HEADER + num_slots * stride
        header = _HDR.pack(ARENA_MAGIC, 1, stride, num_slots, page_bytes)
        try:
            existing = cls.open(path)
            if existing.num_slots == num_slots and existing.page_bytes == page_bytes:
                return existing, True
            existing.close()
        except (StoreError, OSError):
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                # Reserve the memory now: writing into a sparse file on a full tmpfs is SIGBUS.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(tmp)
                raise StoreError(f"cannot allocate a {size}-byte arena at {path}: {exc}") from exc
            os.pwrite(fd, header, 0)
            os.rename(tmp, path)  # readers never see a half-initialised arena
            mm = _map(fd, size)
        finally:
            os.close(fd)
        logger.info("created arena %s: %d slots of %d bytes", path, num_slots, stride)
        return cls(path, mm, num_slots, page_bytes), False

    @classmethod
    def open(cls, path: Path) -> HostArena:
        """Map an existing arena file (workers do this with the path the node gives them)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < ARENA_HEADER:
                raise StoreError(f"{path} is not a kvrelay arena (too small)")
            mm = _map(fd, size)
        finally:
            os.close(fd)
        magic, _version, stride, num_slots, page_bytes = _HDR.unpack(mm[: _HDR.size])
        if (
            magic != ARENA_MAGIC
            or stride != slot_stride(page_bytes)
            or size < ARENA_HEADER + num_slots * stride
        ):
            mm.close()
            raise StoreError(f"{path} is not a valid kvrelay arena")
        return cls(path, mm, num_slots, page_bytes)

    def slot(self, index: int) -> memoryview:
        """Header + payload bytes of slot `index` (a view into shared memory)."""
        if not 0 <= index < self.num_slots:
            raise StoreError(f"slot {index} out of range (arena has {self.num_slots})")
        start = ARENA_HEADER + index * self.stride
        return self._view[start : start + HEADER_BYTES + self.page_bytes]

    def payload(self, index: int) -> memoryview:
        start = ARENA_HEADER + index * self.stride + HEADER_BYTES
        return self._view[start : start + self.page_bytes]

    def register_cuda(self) -> bool:
        """Pin the mapping for asynchronous host<->GPU DMA (per process); False without CUDA."""
        if self._cuda_registered:
            return True
        try:
            import numpy as np
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        ptr = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(self._mm), 0)
        if int(getattr(err, "value", err)) != 0:
            logger.warning(
                "cudaHostRegister of %s failed (%s); copies stay synchronous", self.path, err
            )
            return False
        self._cuda_registered = True
        return True

    def close(self) -> None:
        try:
            self._view.release()
            self._mm.close()
        except BufferError:
            logger.debug("arena %s still has views; leaving the mapping to the GC", self.path)
