"""The process's UCX runtime: one ucxx context, driven from one asyncio loop thread.

ucxx keeps a single context (one UCX worker) per process, so every store node in a process
shares it and runs its UCX coroutines on the loop returned by `loop()`.

Requests complete through ucxx's notifier thread (Python futures) instead of its default
`wait_yield`, which awaits `asyncio.sleep(0)` until a request completes: with the accept loop's
receive always pending, that kept the loop thread spinning a whole core even when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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


def loop() -> asyncio.AbstractEventLoop:
    """The loop UCX runs on (started, with the ucxx context, on first use)."""
    global _loop
    with _lock:
        if _loop is None:
            lp = asyncio.new_event_loop()
            threading.Thread(target=lp.run_forever, name="kv-ucx", daemon=True).start()

            async def init() -> None:
                import ucxx

                ucxx.get_worker_address()  # creates the context; its notifier binds this loop

            asyncio.run_coroutine_threadsafe(init(), lp).result(60)
            # The notifier thread is not a daemon: stop it before the interpreter waits for
            # non-daemon threads at exit (atexit handlers run too late for that).
            # private CPython API, not in typeshed
            threading._register_atexit(_stop_notifier)  # type: ignore[attr-defined]  # noqa: SLF001
            _loop = lp
        return _loop


def _stop_notifier() -> None:
    with contextlib.suppress(Exception):
        import ucxx

        ucxx.stop_notifier_thread()
