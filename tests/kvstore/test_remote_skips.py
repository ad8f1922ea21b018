"""`Remote` skips a peer it could not reach for `retry_s`, and a fetch with no peer left to try
ends (it used to spin forever when every holder was out of time or skipped)."""

from __future__ import annotations

import pytest

from kvrelay.kvstore import remote as remote_module
from kvrelay.kvstore.errors import TransferTimeoutError
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.remote import Remote
from kvrelay.kvstore.transport import Transport

KEYS = [b"k0", b"k1", b"k2"]


class Directory:
    """Every key held by node A (and optionally B), as `Directory.locate` answers."""

    def __init__(self, holders: list[str]):
        self.holders = holders

    def locate(self, keys: list[bytes]) -> list[list[str]]:
        return [list(self.holders) for _ in keys]


def make_remote(fake_clock, holders=("A",), retry_s: float = 5.0) -> Remote:
    fake_clock.install(remote_module)
    return Remote(
        None,  # type: ignore[arg-type]  # not reached: _fetch_from is replaced
        None,  # type: ignore[arg-type]
        Directory(list(holders)),  # type: ignore[arg-type]
        StoreMetrics(),
        b"s",
        Transport.TCP,
        5.0,
        None,
        False,
        retry_s=retry_s,
    )


def test_an_unreachable_peer_is_skipped_for_retry_s_then_tried_again(fake_clock, monkeypatch):
    remote = make_remote(fake_clock)
    tried: list[tuple[str, int]] = []
    answers = [TransferTimeoutError("TCP fetch timed out"), 3]

    def fetch_from(node_id: str, keys: list[bytes], pinned: list[int]) -> int:
        tried.append((node_id, len(keys)))
        assert remote.num_in_flight == 1
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            remote._failed(node_id, answer)  # what _fetch_from does on a failed transfer
            return 0
        remote._reached(node_id)
        pinned.extend(range(answer))
        return answer

    monkeypatch.setattr(remote, "_fetch_from", fetch_from)
    assert remote.fetch(KEYS) == []  # timed out: A is marked
    assert remote.locate_prefix(KEYS) == 0  # a lookup counts none of A's pages
    assert remote.fetch(KEYS) == []  # not tried
    assert tried == [("A", 3)]
    assert remote.metrics.get("transfer_skips", "A") == 2
    fake_clock.sleep(4.9)
    assert not remote.reachable("A")
    fake_clock.sleep(0.1)
    assert remote.reachable("A") and remote.locate_prefix(KEYS) == 3
    assert remote.fetch(KEYS) == [0, 1, 2]  # tried again, and it answered: the mark is gone
    assert tried == [("A", 3), ("A", 3)]
    assert remote._unreachable == {}
    assert remote.num_in_flight == 0


def test_the_other_holder_is_asked_while_one_is_skipped(fake_clock, monkeypatch):
    remote = make_remote(fake_clock, holders=("A", "B"))
    remote._failed("A", TransferTimeoutError("timed out"))
    tried: list[str] = []

    def fetch_from(node_id: str, keys: list[bytes], pinned: list[int]) -> int:
        tried.append(node_id)
        pinned.extend(range(len(keys)))
        return len(keys)

    monkeypatch.setattr(remote, "_fetch_from", fetch_from)
    assert remote.locate_prefix(KEYS) == 3
    assert remote.fetch(KEYS) == [0, 1, 2]
    assert tried == ["B"]


def test_retry_s_zero_never_skips(fake_clock):
    remote = make_remote(fake_clock, retry_s=0.0)
    remote._failed("A", TransferTimeoutError("timed out"))
    assert remote.reachable("A") and remote.locate_prefix(KEYS) == 3


@pytest.mark.timeout(10)
@pytest.mark.parametrize("why", ["every holder skipped", "no time left"])
def test_a_fetch_with_no_peer_to_try_ends(fake_clock, monkeypatch, why):
    remote = make_remote(fake_clock)
    if why == "no time left":
        remote.timeout_s = 0.0  # the bound is spent before the first peer is asked
    else:
        remote._failed("A", TransferTimeoutError("timed out"))
    monkeypatch.setattr(remote, "_fetch_from", lambda *a: pytest.fail("a peer was asked"))
    assert remote.fetch(KEYS) == []
    assert remote.metrics.get("misses", "remote") == 1
