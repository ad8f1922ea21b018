"""supervisord, restarting a program the moment it dies (`python -m` this module: its CLI).

supervisord's loop (supervisor 4.x) waits in poll() with a 1 s timeout and notices a dead child
only when something wakes it: a SIGKILLed worker's closing pipes do, but often before the child
can be reaped (its files close before it becomes a zombie, and SIGCHLD does not interrupt a
poll: PEP 475 retries it), and the loop starts an exited program again only in the iteration
after the one that reaped it. So a killed worker came back 1-2 s after its death (measured: 1.0
s to spawn after the reap, up to 1.0 s more to the reap), the largest part of a restart. Here a
signal (SIGCHLD) wakes the poll through `signal.set_wakeup_fd`, and the process groups move on
(EXITED -> STARTING: spawned) right after each reap. Nothing else changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from supervisor import supervisord


class _WakingPoller:
    """supervisord's poller, also returning from poll() when a signal arrives."""

    def __init__(self, poller: Any, wake_fd: int):
        self._poller = poller
        self._wake_fd = wake_fd

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)

    def poll(self, timeout: float) -> tuple[list[int], list[int]]:
        self._poller.register_readable(self._wake_fd)
        readable, writable = self._poller.poll(timeout)
        if self._wake_fd in readable:
            readable.remove(self._wake_fd)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_fd, 512):
                    pass
        return readable, writable


def _runforever(self: supervisord.Supervisor) -> None:
    # after daemonizing (a fork) and setsignals: the wakeup fd is this process's
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self.options.poller = _WakingPoller(self.options.poller, read)
    _original_runforever(self)


def _reap(self: supervisord.Supervisor, once: bool = False, recursionguard: int = 0) -> None:
    _original_reap(self, once, recursionguard)
    if recursionguard == 0:  # the outermost call: every dead child is reaped
        for group in sorted(self.process_groups.values()):
            group.transition()


_original_runforever = supervisord.Supervisor.runforever
_original_reap = supervisord.Supervisor.reap


def main() -> None:
    """supervisord's main with the prompt restart (same arguments)."""
    supervisord.Supervisor.runforever = _runforever
    supervisord.Supervisor.reap = _reap
    supervisord.main()


if __name__ == "__main__":
    main()
