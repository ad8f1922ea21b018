"""The UCX loop's selector (`transport/ucx_runtime.py`) counts its waits and how each ended."""

from __future__ import annotations

import os
import selectors

from kvrelay.kvstore.transport.ucx_runtime import WakeCountingSelector


def test_each_wait_counts_by_how_it_ended_and_a_poll_is_no_wait():
    sel = WakeCountingSelector()
    r, w = os.pipe()
    try:
        sel.register(r, selectors.EVENT_READ)
        assert sel.select(0) == []  # callbacks were ready: a poll, not a wait
        assert sel.select(0.01) == []  # a wait that ran to its deadline
        os.write(w, b"x")
        assert [key.fd for key, _ in sel.select(None)] == [r]  # a wait that a descriptor ended
        assert [key.fd for key, _ in sel.select(0)] == [r]  # ready, but polled: no wait
        assert (sel.wait, sel.event, sel.timeout, sel.nowait) == (2, 1, 1, 2)
    finally:
        sel.close()
        os.close(r)
        os.close(w)
