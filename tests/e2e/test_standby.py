"""A SIGKILLed worker's name is served again at once (`kvrelay.workers.slot`): with
`up --standby` its loaded standby takes the slot and the dead process's entries; without one
(both processes killed) the restarted process takes them at its start. The lease is set to
ten minutes here, so a stream that completes proves the takeover: the lease never expired."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.stack import MODEL, Stack

LEASE_MS = 600_000
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(
        tmp_path_factory.mktemp("run"),
        prefill=0,
        decode=1,
        env={"KVRELAY_WORKER_LEASE_MS": str(LEASE_MS)},
        extra=["--standby"],
    )
    s.up()
    yield s
    s.down()


def _serving_pid(stack: Stack, name: str = "decode-0") -> int:
    return int(stack.redis.hget(stack.keys.worker(name), "pid"))


def _standby_pid(stack: Stack, name: str = "decode-0") -> int | None:
    value = stack.redis.get(stack.keys.standby(name))
    return int(value) if value else None


def _wait_standby(stack: Stack, timeout: float = 180) -> int:
    """The pid of decode-0's standby once it announces itself (loaded, waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _standby_pid(stack)
        running = {p for state, p in stack.sup.status().values() if state == "RUNNING"}
        if pid in running and pid != _serving_pid(stack):
            return pid
        time.sleep(0.2)
    raise AssertionError("no standby announced" + stack.logs())


def _stream(stack: Stack, request_id: str, kill_at: int = 0, victims=lambda: []) -> str:
    """Stream the request; at its `kill_at`-th token SIGKILL the `victims()` pids."""
    text, n = "", 0
    with httpx.Client(timeout=180) as client, client.stream(
        "POST", stack.url + "/v1/chat/completions", json=BODY,
        headers={"X-Request-Id": request_id},
    ) as resp:  # fmt: skip
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
            n += 1
            if n == kill_at:
                for pid in victims():
                    os.kill(pid, signal.SIGKILL)
    return text


def test_the_standby_serves_a_killed_workers_stream(stack):
    ref = _stream(stack, "standby-ref")
    ref_tokens = stack.out_tokens("standby-ref")
    standby = _wait_standby(stack)
    serving = _serving_pid(stack)
    status = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "status", "--json", "--run-dir",
         str(stack.run_dir)], capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(status.stdout)["standbys"] == [{"name": "decode-0", "pid": standby}]
    assert _stream(stack, "standby-victim", 5, lambda: [serving]) == ref
    assert stack.out_tokens("standby-victim") == ref_tokens
    assert _serving_pid(stack) == standby  # the standby took the name
    # the killed program comes back as the standby
    assert _wait_standby(stack) not in (serving, standby)


def test_both_processes_killed_the_restarted_one_takes_over_at_its_start(stack):
    ref = _stream(stack, "both-ref")
    ref_tokens = stack.out_tokens("both-ref")
    _wait_standby(stack)
    victims = [_serving_pid(stack), _standby_pid(stack)]
    assert _stream(stack, "both-victim", 5, lambda: victims) == ref
    assert stack.out_tokens("both-victim") == ref_tokens
    assert _serving_pid(stack) not in victims
    logs = stack.logs(tail=200)
    assert "taking over decode-0." in logs and "at once (their process is gone)" in logs
