"""A second `kvrelay up` never joins a running stack: its ports and run dir are refused up front,
and the running stack stops cleanly (every program exits 0 on SIGTERM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.e2e.stack import kvrelay_up


def kvrelay(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvrelay.cli.main", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def up(run_dir: Path, port: int, *extra: str) -> subprocess.CompletedProcess:
    return kvrelay_up(run_dir, port, "--arena-bytes", str(64 << 20),
                      "--kv-cache-bytes", str(96 << 20), "--timeout", "150", *extra)  # fmt: skip


def test_second_stack_is_refused_and_first_stops_cleanly(tmp_path):
    port = free_port()
    first = up(tmp_path / "a", port)
    try:
        assert first.returncode == 0, first.stderr
        state = json.loads(first.stdout.strip().splitlines()[-1])
        assert (state["ready"], state["mode"], state["port"]) == (True, "colocated", port)
        # no --prefill/--decode on a CPU host: one decode worker with every core
        topo = state["topology"]
        cores = os.cpu_count() or 1
        assert (topo["prefill"], topo["decode"], topo["auto"]) == (0, (cores // 16) or 1, True)
        assert f"kvrelay: topology: {topo['summary']}\n" in first.stderr
        redis_port = int(state["redis_url"].rsplit(":", 1)[1].split("/")[0])
        for extra_port, extra in ((port, ()), (free_port(), ("--redis-port", str(redis_port)))):
            done = up(tmp_path / "b", extra_port, *extra)
            busy = port if not extra else redis_port
            assert (done.returncode, done.stderr, done.stdout) == (
                2,
                f"kvrelay up: error: port {busy} on 127.0.0.1 is in use\n",
                "",
            )
            assert not (tmp_path / "b").exists()
        again = up(tmp_path / "a", free_port())
        assert (again.returncode, again.stderr) == (
            1,
            f"kvrelay up: error: a stack is already running in {tmp_path / 'a'}\n",
        )
    finally:
        down = kvrelay("down", "--run-dir", str(tmp_path / "a"), timeout=120)
    assert (down.returncode, down.stderr) == (0, "")
    log = (tmp_path / "a" / "logs" / "supervisord.log").read_text()
    stopped = sorted(line.split("INFO ", 1)[1] for line in log.splitlines() if "stopped:" in line)
    assert stopped == [
        f"stopped: {name} (exit status 0)" for name in ("decode-0", "ingress", "store", "valkey")
    ]
