"""Page format and the disk tier on their own."""

from __future__ import annotations

import os

import pytest

from kvrelay.kvstore.disk import DiskTier
from kvrelay.kvstore.errors import IncompatiblePageError, PageFormatError, StoreError
from kvrelay.kvstore.page import HEADER_BYTES, checksum, pack_header, unpack_header, verify_page
from tests.kvstore.conftest import SMALL, keys_for, payload


def make_page(i: int, key: bytes) -> bytearray:
    body = payload(SMALL, i).tobytes()
    return bytearray(pack_header(SMALL, key, checksum(body)) + body)


def test_header_round_trip():
    key = keys_for(1)[0]
    page = make_page(0, key)
    assert len(page) == HEADER_BYTES + 1024
    h = verify_page(page, key, 1024, SMALL.fingerprint)
    assert (h.key, h.fingerprint, h.dtype, h.shape) == (key, "f" * 32, "float32", (2, 2, 4, 2, 8))
    assert (h.num_tokens, h.payload_bytes, h.checksum) == (4, 1024, checksum(page[256:]))


def test_verify_rejects_damage():
    key, other = keys_for(2)
    page = make_page(0, key)
    with pytest.raises(PageFormatError, match="expected " + other.hex()):
        verify_page(page, other)
    with pytest.raises(PageFormatError, match="truncated"):
        verify_page(page[:-1], key)
    with pytest.raises(IncompatiblePageError, match="fingerprint"):
        verify_page(page, key, fingerprint="e" * 32)
    flipped = bytearray(page)
    flipped[HEADER_BYTES + 100] ^= 1
    with pytest.raises(PageFormatError, match="payload checksum"):
        verify_page(flipped, key)
    flipped = bytearray(page)
    flipped[40] ^= 1  # inside the fingerprint field
    with pytest.raises(PageFormatError, match="header checksum"):
        unpack_header(flipped)
    with pytest.raises(PageFormatError, match="not a kvrelay page"):
        unpack_header(b"x" * 300)


def test_disk_tier_lru_restart_and_corruption(tmp_path):
    keys = keys_for(5)
    disk = DiskTier(tmp_path, 3 * (HEADER_BYTES + 1024), 1024)
    assert disk.capacity == 3
    dropped = [disk.put(k, make_page(i, k)) for i, k in enumerate(keys)]
    assert dropped == [[], [], [], [keys[0]], [keys[1]]]
    assert disk.put(keys[2], make_page(2, keys[2])) == []  # write-once: no-op, touches LRU
    assert disk.keys() == [keys[3], keys[4], keys[2]]
    os.utime(disk._path(keys[3]), (1, 1))  # restart order comes from modification times
    os.utime(disk._path(keys[4]), (2, 2))
    os.utime(disk._path(keys[2]), (3, 3))

    again = DiskTier(tmp_path, 3 * (HEADER_BYTES + 1024), 1024)
    assert again.keys() == [keys[3], keys[4], keys[2]]
    buf = bytearray(HEADER_BYTES + 1024)
    assert again.read_into(keys[4], memoryview(buf))
    assert bytes(buf[HEADER_BYTES:]) == payload(SMALL, 4).tobytes()

    path = again._path(keys[3])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x40
    path.write_bytes(data)
    assert not again.read_into(keys[3], memoryview(buf))
    assert again.num_corrupt == 1 and keys[3] not in again and not path.exists()

    path = again._path(keys[2])
    path.write_bytes(path.read_bytes()[:500])  # truncated
    assert not again.read_into(keys[2], memoryview(buf))
    assert again.num_corrupt == 2 and again.keys() == [keys[4]]


def test_disk_tier_too_small(tmp_path):
    with pytest.raises(StoreError, match="holds no"):
        DiskTier(tmp_path, 100, 1024)
