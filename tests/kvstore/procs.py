"""Functions run in separate processes (spawned) by the store tests."""

from __future__ import annotations

import time
import zlib

from kvrelay.kvstore.client import StoreClient
from tests.kvstore.conftest import SMALL, keys_for, payload


def put_pages(run_dir: str, n: int) -> int:
    """Put pages 0..n-1 of the standard key chain; returns how many were new."""
    with StoreClient(run_dir, SMALL) as client:
        return client.put(keys_for(n), [payload(SMALL, i) for i in range(n)])


def read_crcs(run_dir: str, n: int) -> list[int]:
    """CRC-32 of each page of the standard chain that the store returns."""
    with StoreClient(run_dir, SMALL) as client:
        return [zlib.crc32(p) for p in client.get(keys_for(n))]


def hammer(run_dir: str, seed: int, seconds: float) -> tuple[int, int, int]:
    """Put and read overlapping keys for `seconds`; returns (puts, pages read, bad pages)."""
    keys = keys_for(24)
    expected = [payload(SMALL, i).tobytes() for i in range(24)]
    puts = reads = bad = 0
    deadline = time.monotonic() + seconds
    with StoreClient(run_dir, SMALL) as client:
        step = 0
        while time.monotonic() < deadline:
            lo = (seed * 5 + step) % 20
            hi = lo + 4
            puts += client.put(keys[lo:hi], [payload(SMALL, i) for i in range(lo, hi)])
            for offset, page in enumerate(client.get(keys[lo:hi], verify=True)):
                reads += 1
                bad += page != expected[lo + offset]
            bad += client.num_corrupt
            client.num_corrupt = 0
            step += 1
    return puts, reads, bad
