"""The process's UCX runtime: one ucxx context, driven from one asyncio loop thread.

ucxx keeps a single context (one UCX worker) per process, so every store node in a process
shares it and runs its UCX coroutines on the loop returned by `loop()`.

Requests complete through ucxx's notifier thread (Python futures) instead of its default
`wait_yield`, which awaits `asyncio.sleep(0)` until a request completes: with the accept loop's
receive always pending, that kept the loop thread spinning a whole core even when idle.
The loop's selector counts its waits, how each ended and its polls without a wait (`wakeups`,
the node's `ucx_loop` stats counters), so a test can tell a loop that sleeps until something
happens from one that polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import threading

# UCX's own process-level variables, not kvrelay settings (KVRELAY_* go through
# kvrelay.core.config): setdefault keeps an operator's values.
# Read by ucxx when its context is created (the first ucxx call, made on our loop below).
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# UCX over TCP (the listener; hosts without RDMA): 1 MiB segments let a page go by zero-copy
# rendezvous instead of 16 KiB bounce fragments (~1.3x on loopback). Set before ucxx starts.
os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "1m")
os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "1m")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_selector: WakeCountingSelector | None = None


class WakeCountingSelector(selectors.EpollSelector):
    """The UCX loop's selector: counts the loop's waits and why each one returned."""

    def __init__(self) -> None:
        super().__init__()
        # Written by the loop thread only, read by others without a lock: plain ints.
        self.wait = 0  # waits begun (nothing was ready: the loop may sleep until a deadline)
        self.event = 0  # ... that ended because a descriptor became ready (a completion, a call)
        self.timeout = 0  # ... that ended with nothing ready: their deadline (a timer) was due
        self.nowait = 0  # polls that did not wait at all, because callbacks were ready

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            self.nowait += 1
            return super().select(timeout)
        self.wait += 1
        ready = super().select(timeout)
        if ready:
            self.event += 1
        else:
            self.timeout += 1
        return ready


def wakeups() -> dict[str, int]:
    """The UCX loop's waits begun, how they ended, and its polls without a wait (empty: none)."""
    sel = _selector
    if sel is None:
        return {}
    # The loop is asleep in a wait now if `wait` exceeds `event + timeout`. Read `wait` first:
    # a wait that ends or begins meanwhile then reads as not asleep, never the other way round.
    wait = sel.wait
    return {"wait": wait, "event": sel.event, "timeout": sel.timeout, "nowait": sel.nowait}


def loop() -> asyncio.AbstractEventLoop:
    """The loop UCX runs on (started, with the ucxx context, on first use)."""
    global _loop, _selector
    with _lock:
        if _loop is None:
            sel = WakeCountingSelector()
            lp = asyncio.SelectorEventLoop(sel)
            threading.Thread(target=lp.run_forever, name="kv-ucx", daemon=True).start()

            async def init() -> None:
                import ucxx

                ucxx.get_worker_address()  # creates the context; its notifier binds this loop

            asyncio.run_coroutine_threadsafe(init(), lp).result(60)
            # The notifier thread is not a daemon: stop it before the interpreter waits for
            # non-daemon threads at exit (atexit handlers run too late for that).
            # private CPython API, not in typeshed
            threading._register_atexit(_stop_notifier)  # type: ignore[attr-defined]  # noqa: SLF001
            _loop, _selector = lp, sel
        return _loop


def _stop_notifier() -> None:
    with contextlib.suppress(Exception):
        import ucxx

        ucxx.stop_notifier_thread()
