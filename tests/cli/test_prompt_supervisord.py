"""`kvrelay.cli.up.prompt_supervisord`: a signal (SIGCHLD) wakes supervisord's poll, and the
process groups move on (a dead program is spawned again) right after each reap."""

from __future__ import annotations

import os
import select
import signal
import threading

from supervisor import supervisord
from supervisor.poller import PollPoller

from kvrelay.cli.up import launch, prompt_supervisord


class _Options:
    class logger:  # noqa: N801 - the attribute supervisord's poller calls
        @staticmethod
        def blather(*_args, **_kwargs) -> None:
            pass


def test_a_signal_wakes_the_poll_and_its_bytes_are_drained():
    """poll() with an hour's timeout returns when a signal arrives, reporting no fd of its
    own; the wakeup pipe is empty afterwards (the next poll sleeps again)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    other_read, other_write = os.pipe()
    try:
        poller = prompt_supervisord._WakingPoller(PollPoller(_Options()), read)
        poller.register_readable(other_read)
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        assert poller.poll(3600) == ([], [])
        timer.join()
        assert select.select([read], [], [], 0)[0] == []  # drained
        os.write(other_write, b"x")  # the fds supervisord registered still come back
        assert poller.poll(3600) == ([other_read], [])
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, previous)
        for fd in (read, write, other_read, other_write):
            os.close(fd)


def test_the_groups_transition_right_after_a_reap(monkeypatch):
    """After the outermost reap every process group transitions (EXITED -> spawned at once),
    once per reap, not inside supervisord's own recursion."""
    calls: list[str] = []

    class Group:
        def __init__(self, name: str):
            self.name = name

        def __lt__(self, other: Group) -> bool:
            return self.name < other.name

        def transition(self) -> None:
            calls.append(f"transition {self.name}")

    def reap(self, once=False, recursionguard=0):
        calls.append(f"reap {recursionguard}")
        if recursionguard < 2:  # supervisord reaps every dead child, one call each
            prompt_supervisord._reap(self, once, recursionguard + 1)

    monkeypatch.setattr(prompt_supervisord, "_original_reap", reap)
    sup = supervisord.Supervisor.__new__(supervisord.Supervisor)
    sup.process_groups = {"b": Group("b"), "a": Group("a")}
    prompt_supervisord._reap(sup)
    assert calls == ["reap 0", "reap 1", "reap 2", "transition a", "transition b"]


def test_stacks_start_through_it():
    assert prompt_supervisord.__name__ == launch.PROMPT_SUPERVISORD
